"""The plan step (backends/triton/plan.py): both soft-mins of a symmetric iteration from one
plan sweep, its range check and the guarded online-LSE fallback. Interpreter on CPU, real
kernels on CUDA, against the torch backend (float64) and the two-sweep Triton step."""

import math

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import _triton_launch as L
from flashsinkhorn.backends import TorchBackend, resolve_backend
from flashsinkhorn.backends.triton import configs, plan, softmin, split
from flashsinkhorn.problem import prepare
from flashsinkhorn.tuning import TUNING

from .loop_reference import torch_iterate

SHAPES = [(1, 37, 53, 1), (2, 45, 29, 3), (1, 33, 70, 17), (1, 30, 41, 16), (2, 21, 38, 130)]


def _problem(B, n, m, d, device, seed=0, cost="sqeuclidean", rho=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, d, generator=g, dtype=torch.float64)
    y = torch.rand(B, m, d, generator=g, dtype=torch.float64) * 1.3 + 0.2
    a = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.05
    b = torch.rand(B, m, generator=g, dtype=torch.float64) + 0.05
    a, b = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    args = [t.to(device=device, dtype=dtype) for t in (x, y, a, b)]
    return prepare(*args, rho_x=rho, rho_y=rho, precision="ieee", cost=cost)


def _spy_guards(mp):
    """Spies on the guarded fallback the plan step launches: returns the list that receives
    each step's flag (1: the fallback redid the step). The recorded launches of a first step's
    parallel compile (CUDA) are not steps and are left out."""
    flags = []
    real = softmin.symmetric_step

    def spy(*a, **kw):
        if kw.get("guard") is not None and L._RECORDING.get() is None:
            flags.append(int(kw["guard"].item()))
        return real(*a, **kw)

    mp.setattr(plan.softmin, "symmetric_step", spy)
    return flags


def _plan_with_flag(monkeypatch, *args, step=None):
    """``step(*args)`` (default plan.symmetric_step) and the value of its fallback flag (1: the
    guarded step redid it)."""
    with monkeypatch.context() as mp:
        flags = _spy_guards(mp)
        out = (step or plan.symmetric_step)(*args)
    return out, flags[-1]


@pytest.mark.parametrize("B,n,m,d", SHAPES)
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
@pytest.mark.parametrize("rho", [None, 0.7])
def test_plan_step_matches_float64(device, monkeypatch, B, n, m, d, cost, rho):
    eps = 0.2 if cost == "sqeuclidean" else 0.1
    p = _problem(B, n, m, d, device, cost=cost, rho=rho)
    f, g = torch_iterate(p, eps)
    f0, g0 = f.clone(), g.clone()
    lx = p.X.damping(eps)
    out, flag = _plan_with_flag(
        monkeypatch, p.X, p.Y, f, g, eps, 0.5, 0.5 * lx, 0.4 * lx, True, "ieee"
    )
    assert flag == 0  # the plan's sums were in range: its own result, not the fallback's
    p64 = _problem(B, n, m, d, "cpu", cost=cost, rho=rho, dtype=torch.float64)
    ref = TorchBackend().symmetric_step(
        p64.X, p64.Y, f.double().cpu(), g.double().cpu(), eps, 0.5, 0.5 * lx, 0.4 * lx, True, "ieee"
    )  # fmt: skip
    two_sweeps = softmin.symmetric_step(p.X, p.Y, f, g, eps, 0.5, 0.5 * lx, 0.4 * lx, True, "ieee")
    for got, lse_got, want in zip(out, two_sweeps, ref, strict=True):
        err = (got.double().cpu() - want).abs().max()
        # fp32 accuracy, and never worse than the online-LSE step (the euclidean cost at d = 1
        # loses digits in ‖x‖² + ‖y‖² − 2x·y for both).
        lse_err = (lse_got.double().cpu() - want).abs().max()
        assert err <= max(2e-6 * want.abs().max(), 1.5 * lse_err), (float(err), float(lse_err))
    assert torch.equal(f, f0) and torch.equal(g, g0)  # inputs read, never written
    # Without the raw outputs the updates are the same numbers.
    f2, g2, none_f, none_g = plan.symmetric_step(
        p.X, p.Y, f, g, eps, 0.5, 0.5 * lx, 0.4 * lx, False, "ieee"
    )
    assert none_f is None and none_g is None
    assert torch.equal(f2, out[0]) and torch.equal(g2, out[1])


@pytest.mark.parametrize("m", [29, 128, 129])
def test_column_biases_are_padded_with_minus_infinity(device, m):
    """The sweep reads each column tile's biases unmasked: v's rows run to a multiple of
    V_PAD (every column tile's width) and the padding holds -inf, so past-the-end columns
    add exact zeros to the sums; the x side is not padded."""
    p = _problem(2, 37, m, 3, device)
    f, g = torch_iterate(p, 0.2)
    sw = plan.sweep(p.X, p.Y, f, g, 0.2, "ieee", None, cols=True)
    assert sw.v.shape[1] % plan.V_PAD == 0 and sw.v.shape[1] >= m
    assert torch.isneginf(sw.v[:, m:]).all() and torch.isfinite(sw.v[:, :m]).all()
    assert sw.u.shape == (2, 37)
    for tiles in (configs.plan_config(3), configs.half_config(3), configs.plan_config(64, True)):
        assert plan.V_PAD % tiles.block_n == 0


@pytest.mark.parametrize("eps", [0.02, 1e-4])
def test_out_of_range_plan_falls_back_to_online_lse(device, monkeypatch, eps):
    """Zero potentials at small eps: every plan entry underflows; the guarded online-LSE step
    must redo the step, bit for bit."""
    p = _problem(2, 37, 45, 5, device, seed=3)
    f, g = torch.zeros_like(p.X.sq), torch.zeros_like(p.Y.sq)
    out, flag = _plan_with_flag(monkeypatch, p.X, p.Y, f, g, eps, 0.5, 0.5, 0.5, True, "ieee")
    assert flag == 1
    want = softmin.symmetric_step(p.X, p.Y, f, g, eps, 0.5, 0.5, 0.5, True, "ieee")
    for got, w in zip(out, want, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, w)


def test_overflowing_plan_falls_back(device, monkeypatch):
    """Potentials far above the balanced ones overflow the plan's exps: fallback again."""
    p = _problem(1, 29, 31, 3, device, seed=4)
    f, g = torch_iterate(p, 0.05)
    f, g = f + 8.0, g + 8.0  # exp(16 / 0.05) overflows fp32
    out, flag = _plan_with_flag(monkeypatch, p.X, p.Y, f, g, 0.05, 0.5, 0.5, 0.5, False, "ieee")
    assert flag == 1
    want = softmin.symmetric_step(p.X, p.Y, f, g, 0.05, 0.5, 0.5, 0.5, False, "ieee")
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert torch.isfinite(out[0]).all()


def test_guard_flag_is_reset_every_step(device, monkeypatch):
    """A raised flag from one step must not make the next (in-range) step fall back."""
    p = _problem(1, 29, 31, 3, device, seed=5)
    f, g = torch.zeros_like(p.X.sq), torch.zeros_like(p.Y.sq)
    _, flag = _plan_with_flag(monkeypatch, p.X, p.Y, f, g, 1e-3, 0.5, 0.5, 0.5, False, "ieee")
    assert flag == 1
    f, g = torch_iterate(p, 0.2)
    _, flag = _plan_with_flag(monkeypatch, p.X, p.Y, f, g, 0.2, 0.5, 0.5, 0.5, False, "ieee")
    assert flag == 0


@pytest.mark.parametrize("rho", [None, 0.5])
def test_solve_with_plan_steps_matches_two_sweep_steps(device, monkeypatch, rho):
    g = torch.Generator().manual_seed(6)
    x = torch.rand(2, 41, 3, generator=g).to(device)
    y = torch.rand(2, 35, 3, generator=g).to(device)
    kw = dict(eps=0.05, n_iters=15, tol=None, schedule="symmetric", backend="triton",
              precision="ieee")  # fmt: skip
    if rho is not None:
        kw.update(rho_x=rho, rho_y=rho)
    with_plan = fs.sinkhorn(x, y, **kw)
    monkeypatch.setattr(TUNING, "plan_step", False)
    two_sweeps = fs.sinkhorn(x, y, **kw)
    for a, b in ((with_plan.f, two_sweeps.f), (with_plan.g, two_sweeps.g)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    ref = fs.sinkhorn(x.double().cpu(), y.double().cpu(), **{**kw, "backend": "torch"})
    assert (with_plan.value.double().cpu() - ref.value).abs().max() <= 1e-5 * ref.value.abs().max()


def test_zero_weights_and_labels_take_the_two_sweep_step(device):
    """Zero-weight points have zero plan rows and the label table would need one orientation:
    those problems are not eligible (and solve as before)."""
    p = _problem(1, 20, 22, 3, device)
    assert plan.eligible(p.X, p.Y)
    a = torch.rand(1, 20).to(device)
    a[0, 3] = 0.0
    pz = prepare(p.X.x, p.Y.x, a / a.sum(), None, rho_x=None, rho_y=None, precision="ieee")
    assert not plan.eligible(pz.X, pz.Y)
    tri = resolve_backend("triton", pz.device, torch.float32)
    f, g = torch_iterate(pz, 0.2)
    got = tri.symmetric_step(pz.X, pz.Y, f, g, 0.2, 0.5, 0.5, 0.5, True, "ieee", phase="iterate")
    want = softmin.symmetric_step(pz.X, pz.Y, f, g, 0.2, 0.5, 0.5, 0.5, True, "ieee")
    for u, v in zip(got, want, strict=True):
        assert torch.equal(u, v)
    lx = (torch.arange(20, device=device) % 2)[None]
    ly = (torch.arange(22, device=device) % 2)[None]
    table = torch.tensor([[0.0, 1.0], [1.0, 0.0]], device=device)
    pl = prepare(
        p.X.x, p.Y.x, None, None, rho_x=None, rho_y=None, precision="ieee", labels=(lx, ly, table)
    )
    assert not plan.eligible(pl.X, pl.Y)


def test_many_row_blocks(device, monkeypatch):
    """More x-row blocks than the finishing kernel adds per load (the column-sum partials)."""
    p = _problem(1, 601, 45, 3, device, seed=7)
    f, g = torch_iterate(p, 0.2)
    out, flag = _plan_with_flag(monkeypatch, p.X, p.Y, f, g, 0.2, 0.5, 0.5, 0.5, True, "ieee")
    assert flag == 0
    want = softmin.symmetric_step(p.X, p.Y, f, g, 0.2, 0.5, 0.5, 0.5, True, "ieee")
    for got, w in zip(out, want, strict=True):
        assert (got - w).abs().max() <= 2e-6 * w.abs().max()


@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
def test_zero_phase_shift_is_minus_the_mean_cost(device, cost):
    """The "zero" shift: minus the weighted mean of the squared distances (closed form), or
    for the euclidean cost the square root of that mean."""
    p = _problem(2, 33, 41, 17, device, cost=cost)
    z = torch.zeros_like(p.X.sq)
    got = plan.phase_shift(p.X, p.Y, z, torch.zeros_like(p.Y.sq), 0.0, "zero")
    x, y = p.X.x.double(), p.Y.x.double()
    sq = ((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1)
    wa = p.X.w.double() / p.X.w.double().sum(-1, keepdim=True)
    wb = p.Y.w.double() / p.Y.w.double().sum(-1, keepdim=True)
    mean_sq = torch.einsum("bi,bij,bj->b", wa, sq, wb)
    want = -(mean_sq.sqrt() if cost == "euclidean" else mean_sq)
    assert torch.allclose(got.double(), want, rtol=1e-5)
    assert plan.phase_shift(p.X, p.Y, z, torch.zeros_like(p.Y.sq), 0.1, "iterate") is None
    # The centring term: (34 − ln N) eps.
    moved = plan.phase_shift(p.X, p.Y, z, torch.zeros_like(p.Y.sq), 0.1, "zero")
    assert torch.allclose(moved - got, torch.full_like(got, 0.1 * (34 - math.log(41))))
    with pytest.raises(ValueError, match="phase"):
        plan.symmetric_step(p.X, p.Y, z, z, 0.1, 0.0, 1.0, 1.0, False, "ieee", "cold")


@pytest.mark.parametrize("cost,eps", [("sqeuclidean", 0.1), ("euclidean", 0.05)])
@pytest.mark.parametrize("rho", [None, 0.7])
def test_first_two_steps_in_range_with_their_shift(device, monkeypatch, cost, eps, rho):
    """From zero potentials, and from the plain update that follows, the unshifted plan leaves
    the trusted range (it would fall back); with the phase's shift it stays in range and gives
    the float64 soft-mins."""
    d = 130
    p = _problem(1, 47, 39, d, device, seed=8, cost=cost, rho=rho)
    p64 = _problem(1, 47, 39, d, "cpu", seed=8, cost=cost, rho=rho, dtype=torch.float64)
    lam = p.X.damping(eps)
    f, g = torch.zeros_like(p.X.sq), torch.zeros_like(p.Y.sq)
    for phase, (al, w) in (("zero", (0.0, 1.0)), ("second", (0.5, 0.5))):
        args = (p.X, p.Y, f, g, eps, al, w * lam, w * lam, True, "ieee")
        _, unshifted = _plan_with_flag(monkeypatch, *args, "iterate")
        assert unshifted == 1, phase
        out, flag = _plan_with_flag(monkeypatch, *args, phase)
        assert flag == 0, phase
        ref = TorchBackend().symmetric_step(
            p64.X, p64.Y, f.double().cpu(), g.double().cpu(), eps, al, w * lam, w * lam, True,
            "ieee",
        )  # fmt: skip
        for got, want in zip(out, ref, strict=True):
            assert (got.double().cpu() - want).abs().max() <= 2e-6 * want.abs().max() + 1e-6
        f, g = out[0], out[1]


def test_solve_never_falls_back_with_phases(device, monkeypatch):
    """The loop passes the phases: a 10-iteration solve whose first plan would leave the range
    without its shift (checked on the interpreter) takes every step from the plan (d > 32: CUDA
    takes it too)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.rand(1, 43, 40, generator=gen).to(device)
    y = torch.rand(1, 38, 40, generator=gen).to(device)
    flags = _spy_guards(monkeypatch)
    res = fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None, schedule="symmetric", backend="triton",
                      precision="ieee")  # fmt: skip
    assert flags == [0] * 10
    ref = fs.sinkhorn(x.double().cpu(), y.double().cpu(), eps=0.1, n_iters=10, tol=None,
                      schedule="symmetric", backend="torch", precision="ieee")  # fmt: skip
    assert (res.value.double().cpu() - ref.value).abs() <= 1e-5 * ref.value.abs()


def test_split_for_fills_one_wave_where_the_residency_is_known(monkeypatch):
    from flashsinkhorn.backends.triton.configs import LSEConfig

    monkeypatch.setattr(split, "sm_count", lambda device: 132)
    monkeypatch.setattr(TUNING, "softmin_split", None)
    cuda = torch.device("cuda")
    cfg = LSEConfig(128, 128, 64, 1, 4, 3, blocks_per_sm=3)
    # 10k, d = 64: 79 row blocks, 3 x 132 = 396 slots -> 5 chunks (395 blocks, one wave)
    assert split.split_for(79, 10_000, cfg, cuda) == 5
    # no room for two chunks per wave (50k: 391 blocks): the soft-min's rule (4 per SM)
    assert split.split_for(391, 50_000, cfg, cuda) == split.split_count(391, 50_000, 128, cuda) == 2
    # never more chunks than column tiles
    assert split.split_for(10, 300, cfg, cuda) == 3
    # without a measured residency, or with a forced split, the soft-min's rule
    plain = LSEConfig(128, 128, 64, 1, 4, 3)
    assert split.split_for(79, 10_000, plain, cuda) == split.split_count(79, 10_000, 128, cuda) == 7
    monkeypatch.setattr(TUNING, "softmin_split", 2)
    assert split.split_for(79, 10_000, cfg, cuda) == 2


def test_wave_split_cost_model(monkeypatch):
    monkeypatch.setattr(split, "sm_count", lambda device: 132)
    monkeypatch.setattr(TUNING, "softmin_split", None)
    cuda = torch.device("cuda")
    # the gradient pass at 10k, d = 128: 79 row blocks, 1 per SM. 7 chunks (split_count's four
    # programs per SM) run in 5 waves (cost 5/7); 5 chunks in 3 full waves (3/5), the ideal
    # being 79/132.
    assert split.wave_split(79, 10_000, 128, 1, cuda) == 5
    for s in range(1, 20):
        cost = -(-79 * s // 132) / s
        assert cost >= 0.6 - 1e-12
    # a grid past several waves, too: 313 blocks (40k) -> 5 chunks, 12 waves of 1/5 (2.4
    # against 2.5 for split_count's 2 chunks)
    assert split.wave_split(313, 40_000, 128, 1, cuda) == 5


def test_blocks_per_sm_matches_nsight_compute():
    from flashsinkhorn._triton_launch import blocks_per_sm

    h100 = (65536, 233472, 2048)
    # Nsight Compute on the H200: the plan kernel at d = 64 (168 registers, 4 warps, 3 by
    # registers, 4 by shared memory), at d = 128 (221 registers, 8 warps: 1), the gradient
    # pass (255 registers, 8 warps: 1)
    assert blocks_per_sm(168, 50_000, 4, h100) == 3
    assert blocks_per_sm(221, 90_000, 8, h100) == 1
    assert blocks_per_sm(255, 150_000, 8, h100) == 1
    # capped at 128 registers two blocks of 8 warps fit, if shared memory allows
    assert blocks_per_sm(128, 90_000, 8, h100) == 2
    assert blocks_per_sm(128, 120_000, 8, h100) == 1
    # small kernels: the 32-block and thread limits
    assert blocks_per_sm(16, 0, 1, h100) == 32
    assert blocks_per_sm(32, 0, 4, h100) == 16
