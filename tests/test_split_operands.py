"""Precision "tf32x3" on float32 points: float16 hi/lo parts (problem.split_half) and three
exact float16 products per score in the soft-min and transport kernels (flag "f16x3").

Triton runs under the interpreter on CPU, at odd sizes and d = 1, 3, 17, 130 (d = 130 crosses
the d-tiling of the parts); references are the torch backend on the same float32 points and
dense float64 math.
"""

from dataclasses import replace

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import TorchBackend, resolve_backend
from flashsinkhorn.distributed._sweep import payload, unpack
from flashsinkhorn.problem import SPLIT_HEADROOM, prepare, split_half

SHAPES = [(1, 37, 53, 1), (2, 45, 29, 3), (1, 33, 70, 17), (2, 21, 38, 130)]


def _problem(B, n, m, d, device, seed=0, spread=5.0, zero_weight=False, **kw):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, d, generator=g) * spread
    y = (torch.rand(B, m, d, generator=g) * 1.3 + 0.2) * spread
    a = torch.rand(B, n, generator=g) + 0.05
    b = torch.rand(B, m, generator=g) + 0.05
    if zero_weight:
        a[:, 2::5] = 0.0
        b[:, 1::7] = 0.0
    a, b = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    dev = lambda t: t.to(device)  # noqa: E731
    return prepare(dev(x), dev(y), dev(a), dev(b), rho_x=None, rho_y=None, precision="tf32x3", **kw)


def _poisoned(side):
    """The side with NaN points: a kernel that reads x instead of the parts xk gives NaN."""
    return replace(side, x=torch.full_like(side.x, float("nan")))


def _rel(u, v):
    return float((u.double().cpu() - v.double().cpu()).abs().max() / v.double().abs().max())


def test_split_parts_hold_22_bits_inside_float16_range():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, 7, generator=g) * torch.logspace(-6, 3, 7)
    p = prepare(x, x.flip(1) + 1.0, None, None, rho_x=None, rho_y=None, precision="tf32x3")
    X = p.X
    assert X.split and X.xk.dtype == torch.float16 and X.xk.shape == (3, 50, 14)
    # The float32 points are kept as they are (no rounding, unlike "tf32").
    assert torch.equal(X.x, (x - p.centre[:, None, :]).float())
    hi, lo = X.xk[..., :7].float(), X.xk[..., 7:].float()
    amax = float(torch.maximum(p.X.x.abs().max(), p.Y.x.abs().max()))
    assert SPLIT_HEADROOM / 2 < amax / X.kscale <= SPLIT_HEADROOM
    assert float(hi.abs().max()) <= SPLIT_HEADROOM
    err = ((hi + lo) * X.kscale - X.x).abs()
    assert float(err.max()) <= 2.0**-22 * amax
    # Per coordinate: 22 significant bits wherever the low part is a normal float16.
    big = X.x.abs() >= amax * 2.0**-17
    assert bool((err[big] <= 2.0**-21 * X.x.abs()[big]).all())
    # The low part is needed: the high part alone is only 11 bits.
    assert float((hi * X.kscale - X.x).abs().max()) > 2.0**-16 * amax
    assert torch.equal(split_half(X.x, X.kscale), X.xk)


@pytest.mark.parametrize("spread", [1e-30, 1e-41])
def test_split_parts_stay_finite_for_tiny_clouds(device, spread):
    # 1e-41 put the split scale below float32's smallest subnormal: the parts were x/0 = NaN
    # (1e-30 stays above the floor: the control).
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(1, 19, 3, generator=g) * spread).to(device)
    y = (torch.rand(1, 14, 3, generator=g) * spread).to(device)
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32x3")
    assert p.X.kscale >= 2.0**-126
    assert bool(torch.isfinite(p.X.xk.float()).all()) and bool(torch.isfinite(p.Y.xk.float()).all())
    kw = dict(eps=0.1, n_iters=5, tol=None)  # five iterations, as many as it takes to see NaN
    out = fs.sinkhorn(x[0], y[0], precision="tf32x3", backend="triton", **kw)
    ref = fs.sinkhorn(x[0].double(), y[0].double(), backend="torch", **kw)
    # The exact value is ~spread²; float32 rounding of the dual objective leaves ~1e-8, so the
    # comparison only bounds that rounding: finiteness is what is at stake.
    assert torch.isfinite(out.value) and abs(float(out.value) - float(ref.value)) <= 1e-6
    assert bool(torch.isfinite(out.f).all()) and bool(torch.isfinite(out.g).all())


@pytest.mark.parametrize("B,n,m,d", SHAPES)
def test_triton_tf32x3_softmin_matches_float64(device, B, n, m, d):
    p = _problem(B, n, m, d, device, seed=d)
    eps = 0.05 * d
    gen = torch.Generator().manual_seed(2)
    f = (torch.randn(B, n, generator=gen) * eps).to(device)
    g = (torch.randn(B, m, generator=gen) * eps).to(device)
    X, Y = _poisoned(p.X), _poisoned(p.Y)
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    pd = replace(p, X=replace(p.X, x=p.X.x.double(), sq=p.X.sq.double()),
                 Y=replace(p.Y, x=p.Y.x.double(), sq=p.Y.sq.double()))  # fmt: skip
    ref, _ = tb.softmin(pd.X, pd.Y, g.double(), eps, f.double(), 0.3, 0.7, False, "ieee")
    out, _ = tri.softmin(X, Y, g, eps, f, 0.3, 0.7, False, "tf32x3")
    # Potentials ~ d·spread²: fp32 rounding of the norms alone is ~1e-7 of that.
    scale = float(p.X.sq.abs().max())
    assert float((out.double().cpu() - ref.cpu()).abs().max()) < 4e-6 * scale
    fn, gn, _, _ = tri.symmetric_step(X, Y, f, g, eps, 0.5, 0.5, 0.5, False, "tf32x3")
    fr, gr, _, _ = tb.symmetric_step(pd.X, pd.Y, f.double(), g.double(), eps, 0.5, 0.5, 0.5,
                                     False, "ieee")  # fmt: skip
    assert float((fn.double().cpu() - fr.cpu()).abs().max()) < 4e-6 * scale
    assert float((gn.double().cpu() - gr.cpu()).abs().max()) < 4e-6 * scale


def test_triton_tf32x3_is_fp32_accurate_where_tf32_is_not(device):
    # Spread points and a small eps: the score error of 11-bit products shows in the
    # potentials; the split parts bring it to the float32 level of the torch backend.
    B, n, m, d, eps = 1, 45, 61, 17, 0.05
    p = _problem(B, n, m, d, device, spread=20.0)
    g = torch.zeros(B, m, device=device)
    f0 = torch.zeros(B, n, device=device)
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    x, y = p.X.x.double(), p.Y.x.double()
    C = ((x[:, :, None] - y[:, None]) ** 2).sum(-1).cpu()
    ref = -eps * torch.logsumexp(-C / eps + p.Y.logw.double().cpu()[:, None, :], -1)
    out, _ = tri.softmin(p.X, p.Y, g, eps, f0, 0.0, 1.0, False, "tf32x3")
    err_split = float((out.double().cpu() - ref).abs().max())
    torch_err = float((tb.softmin(p.X, p.Y, g, eps, f0, 0.0, 1.0, False, "ieee")[0].double().cpu()
                       - ref).abs().max())  # fmt: skip
    p32 = prepare(p.X.x, p.Y.x, p.X.w, p.Y.w, rho_x=None, rho_y=None, precision="tf32")
    err_tf32 = float(
        (tri.softmin(p32.X, p32.Y, g, eps, f0, 0.0, 1.0, False, "tf32")[0].double().cpu()
         - ref).abs().max()
    )  # fmt: skip
    assert err_split <= 4 * torch_err + 1e-6 * float(C.max())
    assert err_tf32 > 50 * err_split


@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("B,n,m,d", SHAPES)
def test_triton_tf32x3_transport_matches_torch(device, monkeypatch, split, B, n, m, d):
    from flashsinkhorn.tuning import TUNING

    monkeypatch.setattr(TUNING, "transport_split", split)
    p = _problem(B, n, m, d, device, seed=d + 1, spread=1.0, zero_weight=True)
    eps = 0.4
    tb = TorchBackend()
    zx = torch.zeros_like(p.X.sq)
    g0, _ = tb.softmin(p.Y, p.X, zx, eps, torch.zeros_like(p.Y.sq), 0.0, 1.0, False, "ieee")
    f0, _ = tb.softmin(p.X, p.Y, g0, eps, zx, 0.0, 1.0, False, "ieee")
    gen = torch.Generator().manual_seed(3)
    tri = resolve_backend("triton", p.device, torch.float32)
    X, Y = _poisoned(p.X), _poisoned(p.Y)
    for width in (1, 5):
        V = torch.randn(B, m, width, generator=gen).to(device)
        out, marg = tri.transport(X, Y, f0, g0, eps, V, None, None, "tf32x3")
        ref, rmarg = tb.transport(p.X, p.Y, f0, g0, eps, V, None, None, "ieee")
        assert _rel(out, ref) < 2e-5 and _rel(marg, rmarg) < 2e-5
        U = torch.randn(B, n, width, generator=gen).to(device)
        out, marg = tri.transport(Y, X, g0, f0, eps, U, None, None, "tf32x3")
        ref, rmarg = tb.transport(p.Y, p.X, g0, f0, eps, U, None, None, "ieee")
        assert _rel(out, ref) < 2e-5 and _rel(marg, rmarg) < 2e-5
    # Hadamard-weighted transport (the HVP's (P ∘ A Bᵀ) V).
    A = torch.randn(B, n, 2, generator=gen).to(device)
    Bw = torch.randn(B, m, 2, generator=gen).to(device)
    V = torch.randn(B, m, 3, generator=gen).to(device)
    out, _ = tri.transport(X, Y, f0, g0, eps, V, A, Bw, "tf32x3")
    ref, _ = tb.transport(p.X, p.Y, f0, g0, eps, V, A, Bw, "ieee")
    assert _rel(out, ref) < 1e-4
    # The gradient reads the float32 points (rows in the epilogue, columns as values).
    for rows, cols, rp, cp in ((p.X, p.Y, f0, g0), (p.Y, p.X, g0, f0)):
        grad, gm = tri.transport_grad(rows, cols, rp, cp, eps, "tf32x3")
        gref, gmref = tb.transport_grad(rows, cols, rp, cp, eps, "ieee")
        assert _rel(grad, gref) < 1e-4 and _rel(gm, gmref) < 2e-5


@pytest.mark.parametrize("cost,labelled", [("euclidean", False), ("sqeuclidean", True),
                                           ("euclidean", True)])  # fmt: skip
def test_triton_tf32x3_other_costs_match_torch(device, cost, labelled):
    # The split parts under the euclidean kernel cost (dot_scale inside the distance) and the
    # label term (on-chip W rows), for the soft-min, P V and the fused gradient.
    B, n, m, d, eps = 2, 45, 71, 17, 0.4
    gen = torch.Generator().manual_seed(7)
    lab = None
    if labelled:
        lx = torch.randint(0, 5, (B, n), generator=gen)
        ly = torch.randint(0, 5, (B, m), generator=gen)
        lab = (lx.to(device), ly.to(device), (0.7 * torch.rand(5, 5, generator=gen)).to(device))
    p = _problem(B, n, m, d, device, seed=8, spread=1.0, zero_weight=True, cost=cost, labels=lab)
    assert p.X.split
    f = (torch.randn(B, n, generator=gen) * 0.3).to(device)
    g = (torch.randn(B, m, generator=gen) * 0.3).to(device)
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    out, _ = tri.softmin(_poisoned(p.X), _poisoned(p.Y), g, eps, f, 0.0, 1.0, False, "tf32x3")
    ref, _ = tb.softmin(p.X, p.Y, g, eps, f, 0.0, 1.0, False, "ieee")
    assert float((out - ref).abs().max()) < 2e-5 * float(ref.abs().max() + 1)
    V = torch.randn(B, m, 5, generator=gen).to(device)
    out, marg = tri.transport(_poisoned(p.X), _poisoned(p.Y), f, g, eps, V, None, None, "tf32x3")
    ref, rmarg = tb.transport(p.X, p.Y, f, g, eps, V, None, None, "ieee")
    assert _rel(out, ref) < 2e-5 and _rel(marg, rmarg) < 2e-5
    for rows, cols, rp, cp in ((p.X, p.Y, f, g), (p.Y, p.X, g, f)):
        grad, gm = tri.transport_grad(rows, cols, rp, cp, eps, "tf32x3")
        gref, gmref = tb.transport_grad(rows, cols, rp, cp, eps, "ieee")
        assert _rel(grad, gref) < 1e-4 and _rel(gm, gmref) < 2e-5


def test_tf32x3_solve_and_gradient_match_float64(device):
    g = torch.Generator().manual_seed(4)
    x = torch.rand(45, 3, generator=g) * 4
    y = torch.rand(38, 3, generator=g) * 4 + 0.5
    kw = dict(eps=0.2, n_iters=30, tol=None)
    xt = x.to(device).requires_grad_()
    val = fs.sinkhorn_divergence(xt, y.to(device), backend="triton", precision="tf32x3", **kw)
    (gx,) = torch.autograd.grad(val, xt)
    x64 = x.double().requires_grad_()
    ref = fs.sinkhorn_divergence(x64, y.double(), backend="torch", **kw)
    (gref,) = torch.autograd.grad(ref, x64)
    assert abs(float(val.detach()) - float(ref.detach())) < 2e-5 * abs(float(ref.detach()))
    assert _rel(gx, gref) < 1e-4


def test_distributed_payload_ships_split_parts():
    p = _problem(1, 29, 31, 5, torch.device("cpu"))
    for side in (p.X, p.Y):
        # The iterations ship the parts the owner made once: nothing is re-split on arrival.
        pts, sqw = payload(side, True, grad=False)
        assert pts.dtype == torch.float16 and torch.equal(pts, side.xk)
        back = unpack(pts, sqw, side, True)
        assert back.split and torch.equal(back.xk, side.xk) and back.kscale == side.kscale
        # its points (hi + lo) · kscale: 22 bits of the owner's (the large-eps shift only)
        assert float((back.x - side.x).abs().max()) <= 2.0**-20 * float(side.x.abs().max())
        # A gradient sweep ships the float32 points (its transport reads them): split once
        # on arrival, bitwise the owner's parts.
        pts, sqw = payload(side, True, grad=True)
        assert pts.dtype == torch.float32
        back = unpack(pts, sqw, side, True)
        assert back.split and torch.equal(back.xk, side.xk) and torch.equal(back.x, side.x)
        # a backend without compiled kernels reads the points only
        pts, sqw = payload(side, False, grad=False)
        back = unpack(pts, sqw, side, False)
        assert back.xk is None and torch.equal(back.x, side.x)


def test_split_sides_are_never_read_as_grid_copies():
    # Sides prepared for "tf32x3" asked for at "tf32": the 2d-wide parts must not pass for the
    # d-wide float16 grid copies (the kernel would read the high parts only, at 11 bits).
    from flashsinkhorn.backends.triton.operands import operands

    p = _problem(1, 29, 31, 5, torch.device("cpu"))
    xr, xc, scale, flag = operands(p.X, p.Y, "tf32")
    assert xr is p.X.x and xc is p.Y.x and scale == 1.0 and flag == "tf32"
    xr, xc, scale, flag = operands(p.X, p.Y, "tf32x3")
    assert xr is p.X.xk and flag == "f16x3" and scale == p.X.kscale**2
