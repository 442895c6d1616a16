"""Numerics under stress: small eps, far-from-origin clouds, degenerate clouds, extreme d,
half-precision inputs and the finiteness check, on the torch backend and (tiny) on the Triton
kernels under the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashsinkhorn as fs

from . import reference as ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _clouds(n, m, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, d, generator=g, dtype=dtype), torch.rand(m, d, generator=g, dtype=dtype)


def _ref_value(x, y, eps, a=None, b=None):
    x, y = x.double().numpy(), y.double().numpy()
    a = np.full(len(x), 1 / len(x)) if a is None else a.double().numpy()
    b = np.full(len(y), 1 / len(y)) if b is None else b.double().numpy()
    f, g, P = ref.solve(x, y, a, b, eps, iters=200000, tol=1e-12 * eps)
    return float(a @ f + b @ g)


# ----- small eps -----


@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_small_eps_fp32_torch_finite_and_accurate(schedule, offset):
    x, y = _clouds(40, 30, 3)
    diam2 = float(ref.cost(x, y).max())
    eps = 1e-3 * diam2
    res = fs.sinkhorn(
        x + offset, y + offset, eps=eps, backend="torch", schedule=schedule, scaling=0.7,
        tol=1e-4, n_iters=20000,
    )  # fmt: skip
    assert torch.isfinite(res.f).all() and torch.isfinite(res.g).all()
    assert res.converged
    assert abs(float(res.value) - _ref_value(x, y, eps)) <= 1e-4 * diam2


def test_small_eps_fp32_triton_finite(device):
    x, y = _clouds(20, 17, 3)
    diam2 = float(ref.cost(x, y).max())
    eps = 1e-3 * diam2
    kw = dict(eps=eps, tol=None, n_iters=6, scaling=0.5, precision="ieee")
    r_tr = fs.sinkhorn((x + 1e3).to(device), (y + 1e3).to(device), backend="triton", **kw)
    r_to = fs.sinkhorn(x + 1e3, y + 1e3, backend="torch", **kw)
    assert torch.isfinite(r_tr.f).all() and torch.isfinite(r_tr.g).all()
    torch.testing.assert_close(r_tr.f.cpu(), r_to.f, rtol=0, atol=1e-5 * diam2)


def test_small_eps_gradient_finite():
    x, y = _clouds(30, 30, 2, seed=3)
    eps = 1e-3 * float(ref.cost(x, y).max())
    x.requires_grad_(True)
    fs.sinkhorn_divergence(x, y, eps=eps, scaling=0.7, n_iters=5000, backend="torch").backward()
    assert torch.isfinite(x.grad).all()


# ----- translation invariance in fp32 -----


@pytest.mark.parametrize("offset", [1e2, 1e3, 1e4])
def test_translation_invariance_fp32(offset):
    # Compared with a float64 solve of the same fp32 points: far from the origin fp32 inputs
    # are themselves rounded (ulp 2e-3 at 2e4), which is the caller's data, not our error.
    x, y = _clouds(50, 40, 5, seed=1)
    shift = offset * torch.tensor([1.0, -0.5, 0.3, 2.0, -1.0])
    xf, yf = x + shift, y + shift
    eps = 0.05
    far = fs.sinkhorn(xf, yf, eps=eps, tol=1e-5, backend="torch")
    exact = fs.sinkhorn(xf.double(), yf.double(), eps=eps, tol=1e-9)
    assert abs(float(far.value) - float(exact.value)) <= 1e-5
    xg = xf.clone().requires_grad_(True)
    fs.ot_cost(xg, yf, eps=eps, tol=1e-5, backend="torch").backward()
    x64 = xf.double().requires_grad_(True)
    fs.ot_cost(x64, yf.double(), eps=eps, tol=1e-9).backward()
    torch.testing.assert_close(xg.grad.double(), x64.grad, rtol=0, atol=1e-4)


# ----- degenerate clouds -----


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_identical_clouds_divergence_zero(backend, device):
    dev = device if backend == "triton" else torch.device("cpu")
    x, _ = _clouds(13, 1, 3)
    kw = dict(
        eps=0.1, backend=backend, precision="ieee", n_iters=50 if backend == "triton" else 1000
    )
    s = fs.sinkhorn_divergence(x.to(dev), x.to(dev), **kw)
    assert torch.isfinite(s) and abs(float(s)) <= 1e-5


@pytest.mark.parametrize("scaling", [None, 0.5])
def test_single_identical_points(scaling):
    # Diameter 0: annealing must not take log(0) (a GeomLoss complaint).
    x = torch.tensor([[0.3, -2.0]])
    res = fs.sinkhorn(x, x.clone(), eps=0.1, scaling=scaling, backend="torch")
    assert torch.isfinite(res.f).all() and abs(float(res.value)) <= 1e-6
    s = fs.sinkhorn_divergence(x, x.clone(), eps=0.1, scaling=scaling, backend="torch")
    assert abs(float(s)) <= 1e-6


def test_single_points_exact_value():
    # One point each: the plan is a_1 b_1 = 1 and OT_eps = ‖x − y‖² exactly.
    x, y = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.0, 0.0, 1.0]])
    res = fs.sinkhorn(x, y, eps=0.01, backend="torch")
    assert abs(float(res.value) - 9.0) <= 1e-5


def test_duplicate_points_match_merged_weights():
    # Splitting a point into two copies with half the weight changes nothing.
    x, y = _clouds(10, 8, 2, seed=4)
    x64, y64 = x.double(), y.double()
    xd = torch.cat([x64, x64[:3]])
    # Points 0..2 and their copies (rows 10..12) carry half of the weight 0.1 each.
    w = lambda k, v: torch.full((k,), v, dtype=torch.float64)  # exact float64 masses
    a = torch.cat([w(3, 0.05), w(7, 0.1), w(3, 0.05)])
    v_dup = fs.sinkhorn(xd, y64, a, eps=0.05, tol=1e-13).value
    a0 = w(10, 0.1)
    v_one = fs.sinkhorn(x64, y64, a0, eps=0.05, tol=1e-13).value
    assert abs(float(v_dup - v_one)) <= 1e-9


def test_zero_weight_points_are_ignored():
    x, y = _clouds(12, 9, 3, seed=5)
    far = torch.full((3, 3), 1e3)
    a = torch.cat([torch.full((12,), 1 / 12), torch.zeros(3)])
    res = fs.sinkhorn(torch.cat([x, far]), y, a, eps=0.05, tol=1e-6, backend="torch")
    base = fs.sinkhorn(x, y, eps=0.05, tol=1e-6, backend="torch")
    assert torch.isfinite(res.f).all()
    assert abs(float(res.value - base.value)) <= 1e-5
    xg = torch.cat([x, far]).requires_grad_(True)
    fs.ot_cost(xg, y, a, eps=0.05, tol=1e-6, backend="torch").backward()
    assert torch.isfinite(xg.grad).all() and float(xg.grad[12:].abs().max()) == 0.0


def test_d1_matches_reference():
    x, y = _clouds(25, 31, 1, seed=6)
    res = fs.sinkhorn(x.double(), y.double(), eps=0.01, tol=1e-10)
    assert abs(float(res.value) - _ref_value(x, y, 0.01)) <= 1e-8


def test_d4096_torch_matches_reference():
    x, y = _clouds(16, 12, 4096, seed=7)
    eps = 0.1 * float(ref.cost(x, y).max())
    res = fs.sinkhorn(x, y, eps=eps, tol=1e-5, backend="torch")
    assert abs(float(res.value) - _ref_value(x, y, eps)) <= 1e-5 * eps * 10


def test_d4096_triton_tiny(device):
    x, y = _clouds(3, 2, 4096, seed=8)
    eps = 0.1 * float(ref.cost(x, y).max())
    kw = dict(eps=eps, tol=None, n_iters=2, precision="ieee")
    r_tr = fs.sinkhorn(x.to(device), y.to(device), backend="triton", path="streaming", **kw)
    r_to = fs.sinkhorn(x, y, backend="torch", **kw)
    torch.testing.assert_close(r_tr.value.cpu(), r_to.value, rtol=1e-5, atol=0)


# ----- half precision -----


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_half_inputs_accumulate_in_fp32(dtype, backend, device):
    dev = device if backend == "triton" else torch.device("cpu")
    x, y = _clouds(20, 17, 3, seed=9)
    xh, yh = x.to(dtype), y.to(dtype)
    kw = dict(eps=0.05, tol=None, n_iters=30, backend=backend)
    res = fs.sinkhorn(xh.to(dev), yh.to(dev), **kw)
    assert res.f.dtype == res.g.dtype == res.value.dtype == torch.float32
    # The solve reads half points (centred in fp32, rounded once back to the input dtype) and
    # accumulates in fp32: it must match a float64 solve of exactly those points to fp32
    # round-off, i.e. far better than the half-precision unit roundoff.
    Xh, Yh = res.solution.problem.X.x, res.solution.problem.Y.x
    assert Xh.dtype == Yh.dtype == dtype  # no upcast copy handed to the kernels
    kw64 = dict(eps=0.05, tol=None, n_iters=30)
    exact = fs.sinkhorn(Xh[0].cpu().double(), Yh[0].cpu().double(), **kw64)
    assert abs(float(res.value) - float(exact.value)) <= 2e-6
    # Against the caller's half points: within the half-precision grid of the centred clouds.
    given = fs.sinkhorn(xh.double(), yh.double(), **kw64)
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert abs(float(res.value) - float(given.value)) <= 2 * unit
    xg = xh.to(dev).requires_grad_(True)
    v = fs.ot_cost(xg, yh.to(dev), **kw)
    v.backward()
    assert v.dtype == torch.float32 and xg.grad.dtype == dtype
    x64 = Xh[0].cpu().double().requires_grad_(True)
    fs.ot_cost(x64, Yh[0].cpu().double(), **kw64).backward()
    # The gradient is computed in fp32 and rounded once to the input dtype.
    torch.testing.assert_close(xg.grad.cpu().double(), x64.grad, rtol=2 * unit, atol=unit * 0.1)


def test_half_divergence_and_samples_loss():
    x, y = _clouds(15, 11, 2, seed=10)
    s = fs.sinkhorn_divergence(x.half(), y.half(), eps=0.05, backend="torch")
    assert s.dtype == torch.float32 and torch.isfinite(s) and float(s) >= -1e-6
    loss = fs.SamplesLoss(blur=0.2, backend="torch")
    v = loss(x.bfloat16(), y.bfloat16())
    assert torch.isfinite(v)


# ----- finiteness check -----


@pytest.mark.parametrize(
    "fn,warns",
    [
        (lambda x, y, **k: fs.sinkhorn(x, y, eps=0.1, **k), True),
        (lambda x, y, **k: fs.ot_cost(x, y, eps=0.1, **k), True),
        (lambda x, y, **k: fs.sinkhorn_divergence(x, y, eps=0.1, **k), True),
        (lambda x, y, **k: fs.SinkhornDivergence(eps=0.1, **k)(x, y), True),
        (lambda x, y, **k: fs.SamplesLoss(blur=0.3, **k)(x, y), False),
    ],
    ids=["sinkhorn", "ot_cost", "sinkhorn_divergence", "SinkhornDivergence", "SamplesLoss"],
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_check_finite_default_and_opt_out(fn, warns, bad):
    x, y = _clouds(6, 5, 2)
    x[2, 1] = bad
    with pytest.raises(ValueError, match="x must not contain NaN or inf"):
        fn(x, y, backend="torch")
    # Opting out skips the check (one synchronisation less); the result is then not finite,
    # and the entry points with a tolerance say that their solve diverged (sinkhorn's result
    # also says converged=False; SamplesLoss has no tolerance).
    if warns:
        with pytest.warns(fs.ConvergenceWarning, match="diverged"):
            out = fn(x, y, backend="torch", check_finite=False)
    else:
        out = fn(x, y, backend="torch", check_finite=False)
    if isinstance(out, fs.SinkhornResult):
        assert out.converged is False
        out = out.value
    assert not torch.isfinite(out).all()
