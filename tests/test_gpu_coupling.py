"""The compiled sampling kernel on a GPU against the torch reference (same potentials)."""

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import TorchBackend, gumbel, transient_path
from flashsinkhorn.backends.triton import TritonBackend
from flashsinkhorn.coupling.minibatch import solve_batches
from flashsinkhorn.coupling.sampling import draw_rows

pytestmark = pytest.mark.gpu


def _sweep(res, backend, rows=None, seed=None):
    sol = res.solution
    p = sol.problem
    return backend.plan_argmax(p.X, p.Y, sol.g, sol.eps, p.precision, rows, seed)


@pytest.mark.parametrize(
    "n,d,precision",
    [(4099, 3, "ieee"), (2053, 64, "tf32"), (1031, 3072, "tf32"), (1031, 130, "tf32x3")],
)
def test_compiled_kernel_against_reference(n, d, precision):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, d, device="cuda", generator=g)
    y = torch.rand(n + 17, d, device="cuda", generator=g) * 2
    msd = (x.var(0, unbiased=False).sum() + y.var(0, unbiased=False).sum()
           + (x.mean(0) - y.mean(0)).square().sum()).item()  # fmt: skip
    res = fs.sinkhorn(x, y, eps=0.01 * msd, precision=precision)
    assert res.backend == "triton"
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = draw_rows(res, n, True, gen)
    seed = gumbel.seed_words(gen, torch.device("cuda"))
    jt = _sweep(res, TorchBackend(), rows, seed)
    jk = _sweep(res, TritonBackend(), rows, seed)
    # the reference forms its scores with cuBLAS at the same precision; near-ties may differ
    assert (jt == jk).double().mean().item() >= 0.98
    at, ak = _sweep(res, TorchBackend()), _sweep(res, TritonBackend())
    assert (at == ak).double().mean().item() >= 0.98


def test_couple_on_gpu_matches_the_plan():
    g = torch.Generator(device="cuda").manual_seed(2)
    x0 = torch.randn(512, 3, 8, 8, device="cuda", generator=g)
    x1 = torch.rand(512, 3, 8, 8, device="cuda", generator=g)
    a, b = fs.couple(x0, x1, seed=0)
    assert a.shape == b.shape == x0.shape and a.device.type == "cuda"
    i, j = fs.couple_indices(x0, x1, seed=0)
    assert torch.equal(a, x0[i]) and torch.equal(b, x1[j])
    # the mean cost of the sampled pairs is the plan's expected cost (couple's default eps:
    # 0.01 x the mean squared distance), below the independent pairing's
    f0, f1 = x0.flatten(1), x1.flatten(1)
    C = torch.cdist(f0.double(), f1.double()) ** 2
    res = fs.sinkhorn(f0, f1, eps=0.01 * C.mean().item())
    expected = float((res.plan().double() * C).sum())
    sampled = (a - b).flatten(1).double().square().sum(1).mean().item()
    assert abs(sampled - expected) < 0.03 * expected
    assert expected < 0.97 * C.mean().item()


def test_dense_coupling_matches_streaming():
    # image-shaped batches take the stored Gram matrix; its marginal and draws against the
    # streaming kernels on the same potentials
    g = torch.Generator(device="cuda").manual_seed(3)
    x0 = torch.randn(2053, 3072, device="cuda", generator=g)
    x1 = torch.rand(2053, 3072, device="cuda", generator=g) * 2 - 1
    assert transient_path(x0, x1, "auto") == "dense"
    assert transient_path(x0[:, :64], x1[:, :64], "auto") == "auto"
    res = solve_batches(x0, x1, eps=None, mode="entropic", rho=None, tol=1e-3, n_iters=1000,
                        backend="auto", precision="auto", path="dense")  # fmt: skip
    assert res.path == "dense" and res.n_annealing == 0
    sol = res.solution
    p = sol.problem
    dk, sk = sol.backend, TritonBackend()
    args = (p.X, p.Y, sol.f, sol.g, sol.eps, None, None, None, p.precision)
    _, md = dk.transport(*args)
    _, ms = sk.transport(*args)
    assert (md - ms).abs().max() <= 1e-4 * ms.abs().max()
    gen = torch.Generator(device="cuda").manual_seed(4)
    rows = draw_rows(res, 2053, True, gen)
    seed = gumbel.seed_words(gen, torch.device("cuda"))
    jd = dk.plan_argmax(p.X, p.Y, sol.g, sol.eps, p.precision, rows, seed)
    js = sk.plan_argmax(p.X, p.Y, sol.g, sol.eps, p.precision, rows, seed)
    assert (jd == js).double().mean().item() >= 0.98
    ad = dk.plan_argmax(p.X, p.Y, sol.g, sol.eps, p.precision)
    assert (ad == sk.plan_argmax(p.X, p.Y, sol.g, sol.eps, p.precision)).double().mean() >= 0.98
