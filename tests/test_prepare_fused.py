"""The fused prepare (backends/triton/prepare.py) against the torch path of problem.prepare.

On CPU the kernels run under the interpreter (``TUNING.prepare_path = "triton"``); on CUDA the same
tests compare the compiled kernels with the torch path. Sizes are odd and cross the 64-row
blocks; d covers 1, 3, 17 and 130 (more than one feature chunk).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import problem as P
from flashsinkhorn.backends.sides import prepare_sides, triton_sides
from flashsinkhorn.tuning import TUNING


@pytest.fixture
def path(monkeypatch):
    def use(kind):
        monkeypatch.setattr(TUNING, "prepare_path", kind)

    return use


def _prepare(x, y, *args, **kw):
    """``problem.prepare`` with the implementation the engine picks (``backends.sides``)."""
    return P.prepare(x, y, *args, sides=prepare_sides(x, y), **kw)


def _both(path, *args, **kw):
    path("torch")
    ref = _prepare(*args, **kw)
    path("triton")
    got = _prepare(*args, **kw)
    return ref, got


def _clouds(device, B, n, m, d, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    shape_x = (B, n, d) if B else (n, d)
    shape_y = (B, m, d) if B else (m, d)
    x = (torch.rand(shape_x, generator=g) * spread + 5.0).to(device)
    y = (torch.randn(shape_y, generator=g) * spread).to(device)
    return x, y, g


def _grid_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of coordinates that differ (a centre rounded differently can move a coordinate
    on a float16 rounding boundary by one grid step)."""
    return (a != b).float().mean().item()


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
@pytest.mark.parametrize(("B", "n", "m", "d"), [(0, 70, 37, 3), (0, 129, 65, 1), (2, 67, 90, 17),
                                                (3, 33, 71, 130)])  # fmt: skip
@pytest.mark.parametrize("weights", ["none", "given"])
def test_fused_prepare_matches_torch(device, path, precision, B, n, m, d, weights):
    x, y, g = _clouds(device, B, n, m, d)
    a = b = None
    if weights == "given":
        a = torch.rand(x.shape[:-1], generator=g, dtype=torch.float64).to(device) + 0.1
        b = torch.rand(y.shape[-2], generator=g).to(device) + 0.1  # shared (m,) when batched
        b = b / b.sum() * a.sum(-1, keepdim=True).float().mean()
        a = a / a.sum(-1, keepdim=True) * b.sum()
    ref, got = _both(path, x, y, a, b, rho_x=None, rho_y=None, precision=precision)
    assert got.precision == ref.precision and got.batched == ref.batched
    torch.testing.assert_close(got.centre, ref.centre, rtol=2e-6, atol=2e-6)
    for rs, gs, pts, w in ((ref.X, got.X, x, a), (ref.Y, got.Y, y, b)):
        assert gs.kscale == rs.kscale and gs.has_null == rs.has_null
        # the weighted mean of the centred cloud (before any float16 rounding), in float64
        p64 = pts.double() if B else pts.double()[None]
        w64 = torch.ones(p64.shape[:-1], dtype=torch.float64, device=device)
        w64 = w64 if w is None else w64 * w.double()
        want = (w64[..., None] * p64).sum(1) / w64.sum(-1, keepdim=True) - ref.centre.double()
        for side in (rs, gs):
            assert side.mean.shape == want.shape and side.mean.dtype == side.sq.dtype
            torch.testing.assert_close(side.mean.double(), want, rtol=0, atol=2e-5)
        for name in ("x", "sq", "w", "logw"):
            t = getattr(gs, name)
            assert t.shape == getattr(rs, name).shape and t.dtype == getattr(rs, name).dtype
            assert t.is_contiguous()
        torch.testing.assert_close(gs.w, rs.w, rtol=0, atol=0)
        torch.testing.assert_close(gs.logw, rs.logw, rtol=1e-6, atol=1e-6)
        # the norms are those of the points the kernels read
        torch.testing.assert_close(gs.sq, (gs.x * gs.x).sum(-1), rtol=1e-6, atol=1e-5)
        if precision == "tf32":
            assert gs.xk.dtype == torch.float16
            assert torch.equal(gs.x, gs.xk.float() * gs.kscale)
            assert _grid_mismatch(gs.xk, rs.xk) < 0.02
            torch.testing.assert_close(gs.x, rs.x, rtol=2.0**-10, atol=1e-5)
        elif precision == "tf32x3":
            dd = gs.x.shape[-1]
            assert gs.xk.shape[-1] == 2 * dd
            parts = (gs.xk[..., :dd].float() + gs.xk[..., dd:].float()) * gs.kscale
            torch.testing.assert_close(parts, gs.x, rtol=2.0**-20, atol=1e-6)
            torch.testing.assert_close(gs.x, rs.x, rtol=1e-6, atol=1e-5)
        else:
            assert gs.xk is None
            torch.testing.assert_close(gs.x, rs.x, rtol=1e-6, atol=1e-5)


def test_side_means_with_unequal_masses(device, path):
    """Each side's weighted mean divides by that side's own mass (unbalanced: Σa ≠ Σb)."""
    x, y, g = _clouds(device, 2, 67, 90, 17)
    a = 3.0 * torch.rand(x.shape[:-1], generator=g).to(device)
    b = 0.5 * torch.rand(y.shape[:-1], generator=g).to(device)
    for kind in ("torch", "triton"):
        path(kind)
        p = _prepare(x, y, a, b, rho_x=1.0, rho_y=2.0, precision="tf32")
        for side, pts, w in ((p.X, x, a), (p.Y, y, b)):
            w64 = w.double()
            want = (w64[..., None] * pts.double()).sum(1) / w64.sum(-1, keepdim=True)
            torch.testing.assert_close(side.mean.double(), want - p.centre.double(), rtol=0,
                                       atol=2e-5)  # fmt: skip
            # without prepare's statistics: from the (float16-rounded) points
            computed = P.side_mean(dataclasses.replace(side, mean=None))
            torch.testing.assert_close(computed, side.mean, rtol=0, atol=2e-3)


def test_fused_prepare_uniform_weights_and_strides(device, path):
    # Non-contiguous clouds (every other row, transposed storage) read through their strides.
    g = torch.Generator().manual_seed(1)
    xs = torch.rand(150, 5, generator=g).to(device)
    ys = torch.rand(5, 71, generator=g).to(device)
    x, y = xs[::2], ys.t()
    assert not x.is_contiguous() and not y.is_contiguous()
    ref, got = _both(path, x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
    torch.testing.assert_close(got.centre, ref.centre, rtol=2e-6, atol=2e-6)
    assert torch.equal(got.X.w, torch.full((1, 75), 1 / 75, device=device))
    torch.testing.assert_close(got.Y.logw, torch.full((1, 71), math.log(1 / 71), device=device))
    torch.testing.assert_close(got.X.x, ref.X.x, rtol=2.0**-10, atol=1e-6)
    torch.testing.assert_close(got.Y.x, ref.Y.x, rtol=2.0**-10, atol=1e-6)
    # the caller's tensors are untouched
    assert torch.equal(xs[::2], x)


def test_fused_prepare_zero_weights_and_scale(device, path):
    x, y, g = _clouds(device, 0, 70, 45, 3, spread=1000.0)
    a = torch.rand(70, generator=g).to(device)
    a[[0, 69]] = 0.0
    a = a / a.sum()
    ref, got = _both(path, x, y, a, None, rho_x=None, rho_y=None, precision="tf32")
    assert got.X.has_null and not got.Y.has_null
    assert got.X.kscale == ref.X.kscale > 1.0
    assert got.X.w.data_ptr() == a.data_ptr()  # float32 contiguous weights are not copied


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("neg_a", "a must be non-negative"),
        ("nan_a", "a must be finite"),
        ("inf_b", "b must be finite"),
        ("nan_x", "x must not contain NaN or inf"),
        ("inf_y", "y must not contain NaN or inf"),
        ("zero_a", "a must have a positive total mass"),
        ("gap", "equal total mass"),
    ],
)
def test_fused_prepare_errors_match_torch(device, path, case, message):
    x, y, g = _clouds(device, 0, 70, 45, 17)
    a = torch.full((70,), 1 / 70, device=device)
    b = torch.full((45,), 1 / 45, device=device)
    if case == "neg_a":
        a[3] = -0.01
    elif case == "nan_a":
        a[69] = float("nan")
    elif case == "inf_b":
        b[0] = float("inf")
    elif case == "nan_x":
        x[65, 16] = float("nan")
    elif case == "inf_y":
        y[44, 0] = float("-inf")
    elif case == "zero_a":
        a.zero_()
    elif case == "gap":
        b = b * 1.01
    for kind in ("torch", "triton"):
        path(kind)
        with pytest.raises(ValueError, match=message):
            _prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")


def _dyadic_weights(n: int, g: torch.Generator) -> torch.Tensor:
    """Random positive weights k_i / 1024 (integers k_i) with a total of exactly 1."""
    k = torch.randint(1, 8, (n,), generator=g, dtype=torch.float64)
    k[-1] = 1024 - k[:-1].sum()
    return (k / 1024).float()


def test_fused_prepare_solve_matches_torch_path(device, path):
    # Coordinates on a 1/8 grid and dyadic weights: every weighted sum of the centre is exact
    # in float32 whatever the summation order, so both paths centre the clouds identically.
    # (With arbitrary data the two centres differ in the last bit, which can move a coordinate
    # across a float16 rounding boundary: one grid step, 0.05 in a potential of 350 here.)
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(0, 128, (90, 17), generator=g) / 8.0 + 5.0).to(device)
    y = (torch.randint(-64, 64, (77, 17), generator=g) / 8.0).to(device)
    a = _dyadic_weights(90, g).to(device)
    b = _dyadic_weights(77, g).to(device)
    kw = dict(eps=0.3, n_iters=5, tol=None, precision="tf32", backend="triton")
    path("torch")
    ref = fs.sinkhorn(x, y, a, b, **kw)
    prob_ref = _prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")
    path("triton")
    got = fs.sinkhorn(x, y, a, b, **kw)
    prob = _prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")
    assert torch.equal(prob.X.x, prob_ref.X.x) and torch.equal(prob.Y.x, prob_ref.Y.x)
    torch.testing.assert_close(got.f, ref.f, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.g, ref.g, rtol=1e-4, atol=1e-4)
    assert abs(float(got.value) - float(ref.value)) <= 1e-4 * abs(float(ref.value)) + 1e-5


def test_prepare_path_auto_selects_by_device_and_dtype(monkeypatch):
    monkeypatch.setattr(TUNING, "prepare_path", "auto")
    x = torch.zeros(3, 2)
    assert (prepare_sides(x, x) is triton_sides) == x.is_cuda
    assert prepare_sides(x.double(), x.double()) is None
    monkeypatch.setattr(TUNING, "prepare_path", "triton")
    assert prepare_sides(x, x) is triton_sides and prepare_sides(x.half(), x.half()) is None
    monkeypatch.setattr(TUNING, "prepare_path", "torch")
    assert prepare_sides(x, x) is None


@pytest.mark.gpu
def test_prepare_graphs_replay_new_values_and_scales(path):
    # Once a call pattern repeats, stats and sides replay from CUDA graphs keyed on addresses:
    # a replay must read the values now at those addresses (new points, a new operand scale,
    # invalid weights) exactly as the eager launches would.
    from flashsinkhorn.backends.triton import prepare as tp

    dev = torch.device("cuda")
    x, y, g = _clouds(dev, 0, 301, 257, 17)
    a = torch.rand(301, generator=g).to(dev) + 0.1
    b = torch.rand(257, generator=g).to(dev) + 0.1
    b = b / b.sum() * a.sum()
    tp.clear_graphs()
    kw = dict(rho_x=None, rho_y=None, precision="tf32")

    def check(scale_expected=None):
        path("torch")
        ref = _prepare(x, y, a, b, **kw)
        path("triton")
        got = _prepare(x, y, a, b, **kw)
        assert got.X.kscale == ref.X.kscale
        if scale_expected is not None:
            assert got.X.kscale == scale_expected
        for s_ref, s_got in ((ref.X, got.X), (ref.Y, got.Y)):
            assert _grid_mismatch(s_ref.x, s_got.x) < 1e-3
            torch.testing.assert_close(s_got.w, s_ref.w)
            torch.testing.assert_close(s_got.logw, s_ref.logw)
            torch.testing.assert_close(s_got.sq, s_ref.sq, rtol=2e-3, atol=1e-3)
        del got, ref  # free the outputs: the next call lands on the same addresses

    for _ in range(4):
        check()
    st = tp.graph_stats()
    assert st["captured"] >= 2 and st["replayed"] >= 2, st
    # new values in place, same scale: a replay
    before = tp.graph_stats()["replayed"]
    x.mul_(1.01)
    check()
    assert tp.graph_stats()["replayed"] > before
    # a scale 8x larger: the sides launch with the new scale (eager, then a graph of its own)
    x.mul_(8.0)
    y.mul_(8.0)
    for _ in range(3):
        check()
    # negative weights written in place: the replayed statistics must catch them
    a[5] = -1.0
    with pytest.raises(ValueError, match="a must be non-negative"):
        _prepare(x, y, a, b, **kw)
    tp.clear_graphs()


@pytest.mark.parametrize(("B", "d"), [(0, 3), (3, 130)])
def test_diameter_is_the_largest_bounding_box_diagonal(device, path, B, d):
    # Problem.diameter (the annealing ladder's start and the "auto" rule's scale) comes with
    # prepare's one synchronisation, on both paths: the diagonal of the box of both clouds,
    # the largest over a batch (each problem of a batch has its own box). The clouds live on
    # the kernels' device (the Triton path reads CPU tensors only under the interpreter).
    x, y, _ = _clouds(device, B, 67, 41, d)
    if B:
        x = x * torch.arange(1.0, B + 1.0, device=device)[:, None, None]  # one box per problem
    xb, yb = (x, y) if B else (x[None], y[None])
    pts = torch.cat([xb, yb], 1).double().cpu()
    want = (pts.amax(1) - pts.amin(1)).norm(dim=-1).max().item()
    ref, got = _both(path, x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
    assert ref.diameter == pytest.approx(want, rel=1e-6)
    assert got.diameter == pytest.approx(want, rel=1e-6)
