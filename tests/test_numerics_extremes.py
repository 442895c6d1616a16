"""Numerics at the extremes: eps from 1e-9 to 1e9 of diameter², coordinate scales and
offsets, weight scales, both backends. Every result is checked against float64 running the
same iterations, or must be a ValueError: never NaN, never a silently wrong number.

Error model (docs/precision.md), u = 2^-24 the float32 unit roundoff:

- value: 1e-5 relative, plus 1e-6 · mass · diameter² (the rounding of potentials of size
  diameter² over the 20 unconverged iterations), plus 4 u · eps · |M − 1| · M for weights
  whose float sums M are not exactly 1 (the potentials carry eps ln M, stored to u);
- plan-derived outputs (gradients, marginals): 1e-7 · diameter² / eps relative (1e-3 at
  eps = 1e-4 · diameter²), at least 1e-5; refused below 1.2e-5 · diameter².
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import limits
from flashsinkhorn.solvers import estimate_diameter

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

U = 2.0**-24
FLOOR = limits.PLAN_FLOOR_ULPS * torch.finfo(torch.float32).eps  # 1.19e-5
RATIOS = [1e-9, 1e-7, 1e-5, 3e-5, 1e-4, 1e-2, 1.0, 1e2, 1e4, 1e6, 1e9]


def _cloud(seed, n=9, m=7, d=3, scale=1.0, offset=0.0, mass=None, gap=1.0):
    """Points at ``scale`` around ``offset · scale`` (y shifted by half a scale), and random
    weights of total ``mass`` (b: ``gap`` times it), or uniform weights for None."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * scale + offset * scale
    y = torch.randn(m, d, generator=g) * scale + (offset + 0.5) * scale
    if mass is None:
        return x, y, None, None
    a = torch.rand(n, generator=g) + 0.5
    b = torch.rand(m, generator=g) + 0.5
    return x, y, a / a.sum() * mass, b / b.sum() * mass * gap


def _diam2(x, y) -> float:
    return estimate_diameter(x[None].double(), y[None].double()) ** 2


def _run(x, y, a, b, eps, dtype, backend="torch", precision=None, **kw):
    """(value, gradient (x and y) or the ValueError, marginals or the ValueError)."""
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    opts = {"eps": eps, "backend": backend, "tol": None, "n_iters": 20, **kw}
    if precision is not None:
        opts["precision"] = precision
    xg, yg = x.to(dtype).requires_grad_(True), y.to(dtype).requires_grad_(True)
    value = fs.ot_cost(xg, yg, cast(a), cast(b), **opts)
    try:
        gx, gy = torch.autograd.grad(value, (xg, yg))
        grad = torch.cat([gx, gy]).double()
    except ValueError as e:
        grad = e
    res = fs.sinkhorn(x.to(dtype), y.to(dtype), cast(a), cast(b), **opts)
    try:
        marg = torch.cat(res.marginals()).double()
    except ValueError as e:
        marg = e
    return float(value.detach()), grad, marg


def _value_tol(v64, eps, diam2, a, b):
    if a is None:
        return 1e-5 * abs(v64) + 1e-6 * diam2
    masses = [float(w.float().sum()) for w in (a, b)]
    drift = 4 * U * eps * sum(abs(m - 1.0) for m in masses) * max(masses)
    return 1e-5 * abs(v64) + 1e-6 * max(masses) * diam2 + drift


def _check(x, y, a, b, ratio, backend="torch", precision=None, label="", **kw):
    diam2 = _diam2(x, y)
    eps = ratio * diam2
    v32, g32, m32 = _run(x, y, a, b, eps, torch.float32, backend, precision, **kw)
    v64, g64, m64 = _run(x, y, a, b, eps, torch.float64, **kw)
    assert math.isfinite(v32), label
    assert abs(v32 - v64) <= _value_tol(v64, eps, diam2, a, b), (label, v32, v64)
    if ratio < FLOOR:
        for out in (g32, m32):
            assert isinstance(out, ValueError), label
            assert "too small" in str(out) and "float64" in str(out), label
        return
    tol = max(1e-5, 1e-7 / ratio)
    assert isinstance(g32, torch.Tensor) and bool(torch.isfinite(g32).all()), label
    err = float((g32 - g64).norm() / g64.norm())
    assert err <= tol, (label, "gradient", err, tol)
    merr = float(((m32 - m64).abs() / m64.abs()).max())
    assert merr <= tol, (label, "marginals", merr, tol)


# ----- the grid: torch backend -----


@pytest.mark.parametrize("ratio", RATIOS)
def test_float32_matches_float64_or_refuses(ratio):
    grid = itertools.product([1e-3, 1.0, 1e3], [0.0, 100.0], [None, 1e-3, 1.0, 1e3])
    for k, (scale, offset, mass) in enumerate(grid):
        d = (1, 3, 5)[k % 3]
        x, y, a, b = _cloud(k, d=d, scale=scale, offset=offset, mass=mass)
        _check(x, y, a, b, ratio, label=(ratio, d, scale, offset, mass))


@pytest.mark.parametrize("ratio", [1e-4, 1.0, 1e4, 1e9])
def test_unbalanced_float32_matches_float64(ratio):
    for k, (rho, semi, mass) in enumerate(itertools.product([1e-2, 1.0, 1e2], [False, True],
                                                            [1.0, 1e3])):  # fmt: skip
        x, y, a, b = _cloud(100 + k, mass=mass, gap=1.0 if semi else 1.3)
        r = rho * _diam2(x, y)
        _check(x, y, a, b, ratio, rho_x=None if semi else r, rho_y=r,
               label=(ratio, rho, semi, mass))  # fmt: skip


# ----- the grid: Triton kernels under the interpreter -----


@pytest.mark.parametrize(
    "ratio, precision, dtype, rho",
    [
        (1e-9, "ieee", torch.float32, None),
        (1e-4, "ieee", torch.float32, None),
        (1.0, "tf32x3", torch.float32, None),
        (1e4, "ieee", torch.float32, 1.0),
        (1e9, "ieee", torch.float32, None),
        (1e9, "tf32x3", torch.float16, None),
    ],
)
def test_triton_matches_float64_or_refuses(device, ratio, precision, dtype, rho):
    x, y, a, b = _cloud(7, n=11, m=9, mass=1.0 if rho else None, gap=1.3 if rho else 1.0)
    kw = dict(n_iters=4)
    if rho is not None:
        r = rho * _diam2(x, y)
        kw.update(rho_x=r, rho_y=r)
    if dtype != torch.float32:
        # Half points are centred and rounded once more to the half grid: the float64
        # reference reads the points of the solve (docs/conventions.md, half precision).
        xs, ys = x.to(dtype).to(device), y.to(dtype).to(device)
        eps = ratio * _diam2(x, y)
        res = fs.sinkhorn(xs, ys, a, b, eps=eps, backend="triton", precision=precision,
                          tol=None, **kw)  # fmt: skip
        X, Y = (s.x[0].double().cpu() for s in (res.solution.problem.X, res.solution.problem.Y))
        ref = fs.sinkhorn(X, Y, eps=eps, tol=None, **kw)
        tol = _value_tol(float(ref.value), eps, _diam2(x, y), a, b)
        assert abs(float(res.value) - float(ref.value)) <= tol
        return
    _check(x.to(device), y.to(device), a, b, ratio, backend="triton", precision=precision,
           label=(ratio, precision), **kw)  # fmt: skip


def test_triton_large_eps_matches_torch_backend(device):
    # The large-eps kernel variant against the torch backend (same float32 arithmetic).
    x, y, _, _ = _cloud(3, n=13, m=10, d=5)
    for eps in (1e2, 1e6):
        for schedule in ("symmetric", "alternating"):
            kw = dict(eps=eps * _diam2(x, y), tol=None, n_iters=3, schedule=schedule)
            tr = fs.sinkhorn(x.to(device), y.to(device), backend="triton", precision="ieee", **kw)
            to = fs.sinkhorn(x, y, backend="torch", **kw)
            torch.testing.assert_close(tr.f.cpu(), to.f, rtol=1e-6, atol=1e-6 * _diam2(x, y))
            torch.testing.assert_close(tr.value.cpu(), to.value, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["euclidean", "labels", "float16"])
def test_triton_large_eps_variants_match_torch_backend(device, kind):
    # The other branches of the large-eps kernel: the euclidean cost (scores p − C), the
    # label term, half-precision operands.
    x, y, _, _ = _cloud(4, n=13, m=10, d=4)
    kw = dict(eps=1e5 * _diam2(x, y), tol=None, n_iters=2)
    if kind == "euclidean":
        kw["cost"] = "euclidean"
    if kind == "labels":
        g = torch.Generator().manual_seed(0)
        kw.update(label_x=torch.randint(0, 3, (13,), generator=g),
                  label_y=torch.randint(0, 3, (10,), generator=g),
                  label_cost=torch.rand(3, 3, generator=g) * _diam2(x, y))  # fmt: skip
    if kind == "float16":
        x, y = x.half(), y.half()
    tr = fs.sinkhorn(x.to(device), y.to(device), backend="triton", precision="ieee",
                     **{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                        for k, v in kw.items()})  # fmt: skip
    assert tr.solution.problem.X.large_eps <= kw["eps"]  # the variant ran
    to = fs.sinkhorn(x, y, backend="torch", **kw)
    scale = float(to.f.abs().max())
    torch.testing.assert_close(tr.f.cpu(), to.f, rtol=0, atol=2e-6 * scale)
    torch.testing.assert_close(tr.value.cpu(), to.value, rtol=2e-6, atol=0)


# ----- the known float32 failures: 50 and 40 points, the second cloud shifted by 0.5 -----


def _shifted_pair():
    g = torch.Generator().manual_seed(0)
    return torch.rand(50, 3, generator=g), torch.rand(40, 3, generator=g) + 0.5


def test_tiny_eps_divergence_refuses_its_convergence_test():
    x, y = _shifted_pair()
    with pytest.raises(ValueError, match=r"eps=1e-10 is too small for the convergence test"):
        fs.sinkhorn_divergence(x, y, eps=1e-10)
    with pytest.raises(ValueError, match="float64"):
        fs.sinkhorn(x, y, eps=1e-10)


@pytest.mark.parametrize("eps", [1e-7, 1e-8, 1e-10])
def test_tiny_eps_gradient_refused_not_nan(eps):
    # The value holds (same iterations in float64); the gradient was NaN (1e-10), 41x off
    # (1e-8) and 15% off (1e-7).
    x, y = _shifted_pair()
    xg = x.clone().requires_grad_(True)
    s = fs.sinkhorn_divergence(xg, y, eps=eps, tol=None, n_iters=200, backend="torch")
    ref64 = fs.sinkhorn_divergence(x.double(), y.double(), eps=eps, tol=None, n_iters=200)
    assert abs(float(s.detach()) - float(ref64)) <= 1e-5 * abs(float(ref64))
    with pytest.raises(ValueError, match="too small for gradients in float32"):
        s.backward()


@pytest.mark.parametrize("blur", [1e-4, 1e-5])
def test_samples_loss_small_blur_gradient_refused(blur):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(30, 3, generator=g).requires_grad_(True)
    y = torch.rand(25, 3, generator=g)
    loss = fs.SamplesLoss(blur=blur, backend="torch")(x, y)
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match="too small for gradients"):
        loss.backward()


def test_tiny_eps_plan_outputs_refused():
    x, y = _shifted_pair()
    res = fs.sinkhorn(x, y, eps=1e-8, tol=None, n_iters=50, backend="torch")
    assert torch.isfinite(res.value)
    for call, what in [
        (res.barycentric_map, "barycentric_map"),
        (res.marginals, "marginals"),
        (lambda: res.marginal_error, "marginal error"),
        (lambda: res.apply(torch.ones(40)), "apply"),
        (res.plan, "plan"),
    ]:
        with pytest.raises(ValueError, match=f"too small for .*{what}"):
            call()
    # Above the floor they are there, and agree with float64.
    eps = 1e-3
    r32 = fs.sinkhorn(x, y, eps=eps, tol=None, n_iters=50, backend="torch")
    r64 = fs.sinkhorn(x.double(), y.double(), eps=eps, tol=None, n_iters=50)
    torch.testing.assert_close(r32.barycentric_map().double(), r64.barycentric_map(),
                               rtol=0, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_large_eps_value_is_the_mean_cost(backend, device):
    x, y = _shifted_pair()
    dev = device if backend == "triton" else torch.device("cpu")
    mean_cost = float(((x.double()[:, None] - y.double()[None]) ** 2).sum(-1).mean())
    kw = dict(tol=None, n_iters=3, backend=backend)
    if backend == "triton":
        kw["precision"] = "ieee"
    for eps in (1e4, 1e6, 1e8):
        v = float(fs.sinkhorn(x.to(dev), y.to(dev), eps=eps, **kw).value)
        v64 = float(fs.sinkhorn(x.double(), y.double(), eps=eps, tol=None, n_iters=3).value)
        assert abs(v - v64) <= 1e-5 * v64, (eps, v, v64)
    assert abs(v - mean_cost) <= 1e-5 * mean_cost


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_large_eps_divergence_is_the_squared_mean_gap(backend, device):
    x, y = _shifted_pair()
    dev = device if backend == "triton" else torch.device("cpu")
    gap = float(((x.double().mean(0) - y.double().mean(0)) ** 2).sum())
    kw = dict(eps=1e8, tol=None, n_iters=3, backend=backend)
    if backend == "triton":
        kw["precision"] = "ieee"
    s = float(fs.sinkhorn_divergence(x.to(dev), y.to(dev), **kw))
    assert abs(s - gap) <= 1e-5 * gap, (s, gap)


def test_large_eps_default_solve():
    # The default options (tol, acceleration; no annealing at this eps).
    x, y = _shifted_pair()
    mean_cost = float(((x.double()[:, None] - y.double()[None]) ** 2).sum(-1).mean())
    assert abs(float(fs.sinkhorn(x, y, eps=1e8).value) - mean_cost) <= 1e-5 * mean_cost
    gap = float(((x.double().mean(0) - y.double().mean(0)) ** 2).sum())
    assert abs(float(fs.sinkhorn_divergence(x, y, eps=1e8)) - gap) <= 1e-5 * gap


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_of_range_raise(backend, device):
    x, y = _shifted_pair()
    dev = device if backend == "triton" else torch.device("cpu")
    x, y = x.to(dev), y.to(dev)
    kw = dict(backend=backend, tol=None, n_iters=2)
    cases = [
        (dict(eps=1e-40), r"eps=1e-40 is too small for float32"),
        (dict(eps=1e300), r"eps=1e\+300 is too large for float32"),
        (dict(eps=0.1, rho_x=1e-300), r"rho_x is too small for float32"),
        (dict(eps=0.1, rho_y=1e300), r"rho_y is too large for float32"),
    ]
    for opts, match in cases:
        with pytest.raises(ValueError, match=match):
            fs.sinkhorn(x, y, **opts, **kw)
    with pytest.raises(ValueError, match="x and y are too large for float32"):
        fs.sinkhorn(x * 1e20, y * 1e20, eps=1.0, **kw)
    heavy = torch.full((50,), 2e19 / 50, device=dev), torch.full((40,), 2e19 / 40, device=dev)
    with pytest.raises(ValueError, match="a and b are too large for float32"):
        fs.sinkhorn(x, y, *heavy, eps=0.1, **kw)
    with pytest.raises(ValueError, match="reach is too small for float32"):
        fs.SamplesLoss(blur=0.1, reach=1e-30, backend=backend)(x, y)


def test_float64_keeps_what_float32_refuses():
    x, y = _shifted_pair()
    x, y = x.double(), y.double()
    mean_cost = float(((x[:, None] - y[None]) ** 2).sum(-1).mean())
    assert abs(float(fs.sinkhorn(x, y, eps=1e300).value) - mean_cost) <= 1e-12 * mean_cost
    s = fs.sinkhorn_divergence(x.requires_grad_(True), y, eps=1e-8, tol=None, n_iters=50)
    s.backward()
    assert torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="too small for float64"):
        fs.sinkhorn(x, y, eps=1e-320, tol=None, n_iters=2)


def test_zero_weight_points_do_not_set_the_scale():
    # Far points without mass move neither the plan floor nor the large-eps switch.
    x, y, _, _ = _cloud(5, n=12, m=9)
    far = torch.full((3, 3), 1e3)
    a = torch.cat([torch.full((12,), 1 / 12), torch.zeros(3)])
    xf = torch.cat([x, far])
    eps = 1e-3 * _diam2(x, y)
    res = fs.sinkhorn(xf, y, a, eps=eps, tol=1e-4, n_iters=5000, backend="torch")
    assert torch.isfinite(res.marginals()[0]).all()
    big = fs.sinkhorn(xf, y, a, eps=1e6 * _diam2(x, y), tol=None, n_iters=3, backend="torch")
    ref = fs.sinkhorn(xf.double(), y.double(), a.double(), eps=1e6 * _diam2(x, y), tol=None,
                      n_iters=3)  # fmt: skip
    assert abs(float(big.value) - float(ref.value)) <= 1e-5 * float(ref.value)


# ----- GPU (compiled kernels) -----


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
def test_gpu_large_eps_value_and_divergence(precision):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3000, 16, generator=g)
    y = torch.rand(2000, 16, generator=g) + 0.5
    for eps in (1e2, 1e5, 1e8):
        kw = dict(eps=eps, tol=None, n_iters=5, precision=precision)
        res = fs.sinkhorn(x.cuda(), y.cuda(), **kw)
        # precision "tf32" solves the problem of its rounded points: compare with those
        X = res.solution.problem.X.x[0].double().cpu()
        Y = res.solution.problem.Y.x[0].double().cpu()
        ref = fs.sinkhorn(X, Y, eps=eps, tol=None, n_iters=5)
        assert abs(float(res.value) - float(ref.value)) <= 1e-5 * float(ref.value)
        s = fs.sinkhorn_divergence(x.cuda(), y.cuda(), **kw)
        ref64 = fs.sinkhorn_divergence(X, Y, eps=eps, tol=None, n_iters=5)
        assert abs(float(s) - float(ref64)) <= 1e-5 * float(ref64)


@pytest.mark.gpu
def test_gpu_small_eps_gradient_refused_and_floor_gradient_accurate():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2000, 3, generator=g)
    y = torch.rand(1500, 3, generator=g) + 0.5
    d2 = _diam2(x, y)
    xg = x.cuda().requires_grad_(True)
    s = fs.sinkhorn_divergence(xg, y.cuda(), eps=1e-7 * d2, tol=None, n_iters=20)
    with pytest.raises(ValueError, match="too small for gradients"):
        s.backward()
    kw = dict(eps=1e-3 * d2, tol=None, n_iters=50)
    xg = x.cuda().requires_grad_(True)
    fs.ot_cost(xg, y.cuda(), precision="ieee", **kw).backward()
    x64 = x.double().requires_grad_(True)
    fs.ot_cost(x64, y.double(), **kw).backward()
    err = float((xg.grad.cpu().double() - x64.grad).norm() / x64.grad.norm())
    assert err <= 1e-4
