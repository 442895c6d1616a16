"""The plan half-step (backends/triton/plan.py ``half_step``): an alternating half-step read off
the row sums of the plan of (old, col_pot), its range check and the guarded online-LSE
fallback. Interpreter on CPU, real kernels on CUDA, against the torch backend (float64) and the
online-LSE sweep."""

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import TorchBackend, resolve_backend
from flashsinkhorn.backends.triton import plan, softmin
from flashsinkhorn.tuning import TUNING, override

from .loop_reference import torch_iterate
from .test_plan_step import SHAPES, _plan_with_flag, _problem


def _half_with_flag(monkeypatch, *args):
    """plan.half_step and its fallback flag (1: the guarded online-LSE sweep redid it)."""
    return _plan_with_flag(monkeypatch, *args, step=plan.half_step)


@pytest.mark.parametrize("B,n,m,d", SHAPES)
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
@pytest.mark.parametrize("rho", [None, 0.7])
def test_half_step_matches_float64(device, monkeypatch, B, n, m, d, cost, rho):
    eps = 0.2 if cost == "sqeuclidean" else 0.1
    p = _problem(B, n, m, d, device, cost=cost, rho=rho)
    f, g = torch_iterate(p, eps)
    f0, g0 = f.clone(), g.clone()
    lx, ly = p.X.damping(eps), p.Y.damping(eps)
    p64 = _problem(B, n, m, d, "cpu", cost=cost, rho=rho, dtype=torch.float64)
    tb = TorchBackend()
    # both orientations: x rows against y columns, and y rows against x columns
    for R, C, pot, old, R64, C64, lam in (
        (p.X, p.Y, g, f, p64.X, p64.Y, lx),
        (p.Y, p.X, f, g, p64.Y, p64.X, ly),
    ):
        (out, raw), flag = _half_with_flag(
            monkeypatch, R, C, pot, eps, old, 0.3, 0.7 * lam, True, "ieee"
        )
        assert flag == 0  # the plan's sums were in range: its own result
        want = tb.softmin(R64, C64, pot.double().cpu(), eps, old.double().cpu(), 0.3,
                          0.7 * lam, True, "ieee")  # fmt: skip
        lse = softmin.softmin(R, C, pot, eps, old, 0.3, 0.7 * lam, True, "ieee")
        for got, lse_got, w in zip((out, raw), lse, want, strict=True):
            err = (got.double().cpu() - w).abs().max()
            lse_err = (lse_got.double().cpu() - w).abs().max()
            assert err <= max(2e-6 * w.abs().max(), 1.5 * lse_err), (float(err), float(lse_err))
        # without the raw output the update is the same numbers
        out2, none = plan.half_step(R, C, pot, eps, old, 0.3, 0.7 * lam, False, "ieee")
        assert none is None and torch.equal(out2, out)
    assert torch.equal(f, f0) and torch.equal(g, g0)  # inputs read, never written


@pytest.mark.parametrize("shift", [0.0, 8.0])
def test_out_of_range_half_step_falls_back_bitwise(device, monkeypatch, shift):
    """Zero potentials at small eps underflow every plan entry; potentials 8 above the
    balanced ones overflow them: the guarded online-LSE sweep must redo the half-step, bit for
    bit."""
    p = _problem(2, 37, 45, 5, device, seed=3)
    eps = 0.01
    if shift:
        f, g = torch_iterate(p, eps)
        f, g = f + shift, g + shift
    else:
        f, g = torch.zeros_like(p.X.sq), torch.zeros_like(p.Y.sq)
    (out, raw), flag = _half_with_flag(monkeypatch, p.X, p.Y, g, eps, f, 0.5, 0.5, True, "ieee")
    assert flag == 1
    want = softmin.symmetric_step(p.X, p.Y, f, g, eps, 0.5, 0.5, 0.5, True, "ieee", x_only=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out, want[0]) and torch.equal(raw, want[2])


def test_flag_is_reset_every_half_step(device, monkeypatch):
    """A raised flag from one half-step must not send the next (in-range) one to the fallback."""
    p = _problem(1, 29, 31, 3, device, seed=5)
    z = torch.zeros_like(p.X.sq)
    _, flag = _half_with_flag(monkeypatch, p.X, p.Y, z[:, :31], 1e-3, z, 0.0, 1.0, False, "ieee")
    assert flag == 1
    f, g = torch_iterate(p, 0.1)
    _, flag = _half_with_flag(monkeypatch, p.X, p.Y, g, 0.1, f, 0.0, 1.0, False, "ieee")
    assert flag == 0


def test_alternating_solve_takes_the_plan_half_step(device, monkeypatch):
    """The default alternating loop runs its half-steps from an iterate through the plan sweep,
    and gives the online-LSE solve's potentials to fp32 round-off."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand(67, 5, generator=g).to(device)
    y = torch.rand(59, 5, generator=g).to(device) + 0.3
    calls = []
    real = plan.half_step

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(plan, "half_step", spy)
    monkeypatch.setattr(plan, "HALF_MIN_SCORES", 0)  # a small problem takes it too
    kw = dict(eps=0.05, schedule="alternating", tol=1e-5, backend="triton", precision="ieee")
    res = fs.sinkhorn(x, y, **kw)
    assert calls, "the alternating schedule never took the plan half-step"
    monkeypatch.setattr(plan, "half_step", real)
    with override(plan_half=False):
        ref = fs.sinkhorn(x, y, **kw)
    assert TUNING.plan_half
    assert res.n_iters == ref.n_iters
    scale = ref.f.abs().max()
    assert (res.f - ref.f).abs().max() <= 2e-5 * scale
    assert (res.g - ref.g).abs().max() <= 2e-5 * scale
    assert abs(float(res.value) - float(ref.value)) <= 1e-5 * abs(float(ref.value))


def test_small_problems_keep_the_online_sweep(device):
    """Below HALF_MIN_SCORES the plan half-step's extra launches would not pay on a GPU."""
    p = _problem(1, 37, 53, 5, device)
    big = plan.half_eligible(p.X, p.Y, 0.1)
    assert big == (device.type == "cpu")  # the interpreter takes it at any size (CI coverage)


def test_dense_path_keeps_its_stored_scores(device):
    """The stored-Gram backend reads its own scores for every half-step (no plan sweep); the
    streaming backend takes the plan sweep."""
    from flashsinkhorn.backends.base import Backend
    from flashsinkhorn.backends.triton.dense import DenseTritonBackend

    assert DenseTritonBackend.half_step is Backend.half_step
    streaming = type(resolve_backend("triton", device, torch.float32))
    assert streaming.half_step is not Backend.half_step
