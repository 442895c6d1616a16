"""The coupling's fast path at large d: the stored Gram matrix serves the row marginal and the
draws (backends/triton/dense.py, sample.py ``dense_plan_argmax``), and the eps ladder starts
at a bound of the largest distance (coupling/minibatch.py ``cost_scale``). Kernels against the
torch backend on the same potentials (the Triton interpreter on the CPU)."""

import math

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import TorchBackend, gumbel, transient_path
from flashsinkhorn.backends.triton import dense
from flashsinkhorn.coupling.minibatch import cost_scale, solve_batches
from flashsinkhorn.coupling.sampling import draw_rows
from flashsinkhorn.tuning import override

from .interpreter_versions import needs_interpreter_3_3

# A draw whose two best perturbed scores lie within the backends' score rounding may differ
# (tests/test_coupling_kernels.py); the bound leaves room for one such draw in a hundred.
AGREE = 0.99
# (B, n, m, d): n, m not multiples of the tiles; m = 300 spans two 256-wide column tiles (there
# Triton 3.2's interpreter, whose argmax interpreter_versions.py describes, draws column 0 for
# row 0 of the second matrix; 3.9.0's draws the reference's column 117)
CASES = [(None, 45, 77, 3), pytest.param(2, 37, 300, 20, marks=needs_interpreter_3_3)]


def _solved(B, n, m, d, device, seed=0, rho=None):
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    x = torch.rand(*lead, n, d, generator=g).to(device)
    y = (torch.rand(*lead, m, d, generator=g) * 0.8 + 0.3).to(device)
    a = torch.rand(*lead, n, generator=g) + 0.2
    b = torch.rand(*lead, m, generator=g) + 0.2
    a, b = (a / a.sum(-1, keepdim=True)).to(device), (b / b.sum(-1, keepdim=True)).to(device)
    res = fs.sinkhorn(x, y, a, b, eps=0.05, rho_x=rho, rho_y=rho, backend="torch",
                      precision="ieee", tol=1e-2)  # fmt: skip
    return res, dense.DenseTritonBackend(res.solution.problem)


def _sweeps(res, backend, rows, seed, transposed=False):
    sol = res.solution
    p = sol.problem
    R, C, pot = (p.Y, p.X, sol.f) if transposed else (p.X, p.Y, sol.g)
    return (backend.plan_argmax(R, C, pot, sol.eps, "ieee"),
            backend.plan_argmax(R, C, pot, sol.eps, "ieee", rows, seed))  # fmt: skip


@pytest.mark.parametrize("B,n,m,d", CASES)
@pytest.mark.parametrize("transposed", [False, True])
def test_dense_draws_match_the_reference(device, B, n, m, d, transposed):
    res, dk = _solved(B, n, m, d, device, seed=1)
    gen = torch.Generator(device=device).manual_seed(3)
    k = 200
    size = m if transposed else n
    rows = torch.randint(0, size, (res.solution.problem.B, k), generator=gen, device=device)
    seed = gumbel.seed_words(gen, device)
    at, jt = _sweeps(res, TorchBackend(), rows, seed, transposed)
    ak, jk = _sweeps(res, dk, rows, seed, transposed)
    assert jk.dtype == torch.int64 and jk.shape == rows.shape
    assert torch.equal(at.cpu(), ak.cpu())
    assert (jt.cpu() == jk.cpu()).double().mean().item() >= AGREE
    # split column sweeps merge to the same draws
    with override(softmin_split=2):
        ak2, jk2 = _sweeps(res, dk, rows, seed, transposed)
    assert torch.equal(ak2, ak) and torch.equal(jk2, jk)


def test_dense_draws_skip_zero_weight_columns(device):
    g = torch.Generator().manual_seed(5)
    x, y = torch.rand(20, 2, generator=g).to(device), torch.rand(35, 2, generator=g).to(device)
    b = torch.ones(35, device=device)
    b[::3] = 0.0
    res = fs.sinkhorn(x, y, None, b / b.sum(), eps=0.05, backend="torch", precision="ieee")
    dk = dense.DenseTritonBackend(res.solution.problem)
    rows = torch.randint(0, 20, (1, 500), generator=torch.Generator().manual_seed(0)).to(device)
    _, j = _sweeps(res, dk, rows, gumbel.seed_words(None, device))
    assert not torch.isin(j.cpu(), torch.arange(0, 35, 3)).any()


@pytest.mark.parametrize("rho", [None, 0.5])
def test_dense_marginal_matches_float64(device, rho):
    # the marginal from one soft-min over K against the float64 torch transport
    res, dk = _solved(None, 45, 77, 3, device, seed=2, rho=rho)
    sol = res.solution
    p = sol.problem
    out, marg = dk.transport(p.X, p.Y, sol.f, sol.g, sol.eps, None, None, None, "ieee")
    assert out is None
    X64, Y64 = (type(s)(**{**s.__dict__, **_f64(s)}) for s in (p.X, p.Y))
    _, ref = TorchBackend().transport(X64, Y64, sol.f.double(), sol.g.double(), sol.eps, None,
                                      None, None, "ieee")  # fmt: skip
    assert (marg.double().cpu() - ref.cpu()).abs().max() <= 1e-5 * ref.abs().max()
    # the sampler's rows come from it: a non-uniform marginal of the right sum
    rows = draw_rows(res, 10, True, None)
    assert rows.shape == (1, 10)


def _f64(side):
    return {k: getattr(side, k).double() for k in ("x", "sq", "w", "logw")}


def test_cost_scale_bounds_the_largest_distance():
    g = torch.Generator().manual_seed(0)
    for n, m, d, shift in ((50, 70, 2, 0.0), (40, 30, 512, 0.0), (30, 20, 64, 1e3)):
        x0 = torch.randn(n, d, generator=g, dtype=torch.float64) + shift
        x1 = torch.rand(m, d, generator=g, dtype=torch.float64) * 2 - 1 + shift
        cs = cost_scale(x0, x1)
        C = torch.cdist(x0, x1) ** 2
        assert cs.msd == pytest.approx(C.mean().item(), rel=1e-9)
        assert cs.diameter**2 >= C.max().item() * (1 - 1e-12)
        assert cs.diameter <= math.sqrt(cs.box2) * (1 + 1e-12)
        if d >= 64:
            # in high dimension the box diagonal overstates the largest distance many times
            assert cs.diameter**2 < 0.2 * cs.box2


def test_high_dimensional_coupling_starts_without_a_ladder():
    # flattened images: eps = 0.01 x the mean squared distance is 5e-3 of the largest cost
    # bound but 4e-4 of the box diagonal², which made the rule anneal from the diagonal
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(128, 3, 16, 16, generator=g).flatten(1)
    x1 = (torch.rand(128, 3, 16, 16, generator=g) * 2 - 1).flatten(1)
    kw = dict(rho=None, tol=1e-3, n_iters=1000, backend="torch", precision="auto")
    res = solve_batches(x0, x1, eps=None, mode="entropic", **kw)
    assert res.n_annealing == 0 and res.converged
    # the near-exact mode still anneals, from the bound
    exact = solve_batches(x0, x1, eps=None, mode="exact", **kw)
    assert exact.n_annealing > 0 and exact.converged


def test_transient_path_is_auto_off_cuda():
    x = torch.zeros(4, 300)
    assert transient_path(x, x, "auto") == "auto"
