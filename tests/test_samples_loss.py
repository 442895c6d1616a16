"""SamplesLoss: parity with GeomLoss's tensorized backend (float64), conventions, arguments."""

import pytest
import torch

import flashsinkhorn as fs

geomloss = pytest.importorskip("geomloss")  # a test extra; absent on the GPU machine


def _data(B, n=13, m=10, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    sh = (B,) if B else ()
    x = torch.randn(*sh, n, d, generator=g, dtype=torch.float64)
    y = torch.randn(*sh, m, d, generator=g, dtype=torch.float64) * 0.7 + 0.3
    a = torch.rand(*sh, n, generator=g, dtype=torch.float64) + 0.2
    b = torch.rand(*sh, m, generator=g, dtype=torch.float64) + 0.2
    a, b = a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)
    return [t.requires_grad_(True) for t in (a, x, b, y)]


def _both(kw, args):
    outs = []
    for cls in (geomloss.SamplesLoss, fs.SamplesLoss):
        val = cls(loss="sinkhorn", p=2, backend="tensorized", **kw)(*args)
        outs.append((val, torch.autograd.grad(val.sum(), args)))
    return outs


def _rel(u, v):
    u, v = u.detach(), v.detach()
    return float((u - v).abs().max() / v.abs().max())


@pytest.mark.parametrize("B", [0, 3])
@pytest.mark.parametrize("blur", [0.05, 0.5])
@pytest.mark.parametrize("scaling", [0.5, 0.9])
@pytest.mark.parametrize("reach", [None, 1.0])
@pytest.mark.parametrize("m", [10, 13])  # m = n: the two self terms run as one batch
def test_parity_with_geomloss(B, blur, scaling, reach, m):
    args = _data(B, m=m)
    (v1, g1), (v2, g2) = _both(dict(blur=blur, scaling=scaling, reach=reach), args)
    assert v2.shape == v1.shape
    assert _rel(v2, v1) < 1e-6
    # GeomLoss's autograd scales relaxed gradients by (rho + eps/2)/(rho + eps): its custom
    # UnbalancedWeight.backward is never called. Ours is the derivative of the value.
    fac = 1.0 if reach is None else (reach**2 + blur**2) / (reach**2 + blur**2 / 2)
    for ours, theirs in zip(g2, g1, strict=True):
        assert _rel(ours, theirs * fac) < 1e-6


@pytest.mark.parametrize("reach", [None, 0.7])
def test_parity_without_debias(reach):
    args = _data(0)
    (v1, g1), (v2, g2) = _both(dict(blur=0.1, scaling=0.7, reach=reach, debias=False), args)
    assert _rel(v2, v1) < 1e-6
    fac = 1.0 if reach is None else (reach**2 + 0.01) / (reach**2 + 0.005)
    for ours, theirs in zip(g2[1::2], g1[1::2], strict=True):  # points
        assert _rel(ours, theirs * fac) < 1e-6
    if reach is None:
        for ours, theirs in zip(g2[::2], g1[::2], strict=True):  # weights
            assert _rel(ours, theirs) < 1e-6


@pytest.mark.parametrize("debias", [True, False])
def test_relaxed_gradients_are_derivatives_of_the_value(debias):
    # Converged (slow annealing): finite differences of the value confirm our gradients, where
    # GeomLoss's are off by (rho + eps/2)/(rho + eps).
    # A diameter just above blur and scaling ~1 give ~100 iterations at (almost) the final eps:
    # the schedule's fixed iteration count then reaches the fixed point.
    a, x, b, y = _data(0, n=5, m=4, d=2)
    loss = fs.SamplesLoss(blur=0.5, reach=0.7, scaling=0.99999, diameter=0.5005, debias=debias)
    f = lambda a, x, b: loss(a, x, b, y.detach())  # noqa: E731
    assert torch.autograd.gradcheck(f, (a, x, b), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_call_forms_and_weight_shapes():
    a, x, b, y = _data(2)
    loss = fs.SamplesLoss(blur=0.1)
    ref = loss(a, x, b, y)
    assert ref.shape == (2,)
    torch.testing.assert_close(loss(a[..., None], x, b[..., None], y), ref)
    xs, ys = x[0], y[0]
    v = loss(a[0], xs, b[0], ys)
    torch.testing.assert_close(loss(a[0][:, None], xs, b[0][:, None], ys), v)
    gv = geomloss.SamplesLoss(blur=0.1, backend="tensorized")(a[0], xs, b[0], ys)
    assert _rel(v.detach(), gv.detach()) < 1e-6
    u = loss(xs, ys)
    gl = geomloss.SamplesLoss(blur=0.1, backend="tensorized")(xs, ys)
    assert u.shape == () and _rel(u, gl) < 1e-6
    a3 = a.detach()[..., None].clone().requires_grad_(True)
    (ga,) = torch.autograd.grad(loss(a3, x, b, y).sum(), a3)
    assert ga.shape == a3.shape


def test_potentials_match_geomloss():
    a, x, b, y = [t.detach() for t in _data(2)]
    for reach in (None, 0.5):
        kw = dict(blur=0.2, reach=reach, potentials=True)
        F1, G1 = geomloss.SamplesLoss(backend="tensorized", **kw)(a, x, b, y)
        F2, G2 = fs.SamplesLoss(**kw)(a, x, b, y)
        assert F2.shape == F1.shape and G2.shape == G1.shape
        assert _rel(F2, F1) < 1e-6 and _rel(G2, G1) < 1e-6


def test_identical_clouds_give_zero():
    _, x, _, _ = _data(0)
    x = x.detach()
    v = fs.SamplesLoss(blur=0.05)(x, x.clone())
    assert abs(float(v)) < 1e-12
    # A single repeated point: diameter 0 (GeomLoss would take log 0).
    p = torch.zeros(4, 2, dtype=torch.float64)
    assert abs(float(fs.SamplesLoss()(p, p.clone()))) < 1e-12


def test_triton_matches_torch(device):
    a, x, b, y = [t.detach().float() for t in _data(2, n=37, m=29)]
    kw = dict(blur=0.3, scaling=0.5, precision="ieee")
    out = []
    for backend, dev in (("triton", device), ("torch", "cpu")):
        xx = x.to(dev).requires_grad_()
        val = fs.SamplesLoss(backend=backend, **kw)(a.to(dev), xx, b.to(dev), y.to(dev))
        out.append((val, torch.autograd.grad(val.sum(), xx)[0]))
    torch.testing.assert_close(out[0][0].cpu(), out[1][0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out[0][1].cpu(), out[1][1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(loss="energy"), "loss"),
        (dict(p=3), "p"),
        (dict(blur=0.0), "blur"),
        (dict(reach=-1.0), "reach"),
        (dict(scaling=1.5), "scaling"),
        (dict(backend="keops"), "backend"),
        (dict(cost="x-y"), "cost"),
        (dict(precision="fp8"), "precision"),
    ],
)
def test_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        fs.SamplesLoss(**kw)


def test_bad_call():
    x = torch.rand(5, 2)
    with pytest.raises(TypeError, match="SamplesLoss takes"):
        fs.SamplesLoss()(x)
    with pytest.raises(ValueError, match="a must have shape"):
        fs.SamplesLoss()(torch.ones(4) / 4, x, torch.ones(5) / 5, x)


# ----- potentials in GeomLoss's shapes -----


@pytest.mark.parametrize("form", ["xy", "weights", "weights_n1"])
@pytest.mark.parametrize("B", [0, 1, 3])
def test_potential_shapes_match_geomloss(B, form):
    # (N, D) clouds: GeomLoss returns (1, N) and (1, M) potentials; we returned (N,), (M,).
    a, x, b, y = [t.detach() for t in _data(B)]
    if form == "xy":
        args = (x, y)
    elif form == "weights":
        args = (a, x, b, y)
    else:
        args = (a[..., None], x, b[..., None], y)
    F1, G1 = geomloss.SamplesLoss(backend="tensorized", potentials=True)(*args)
    for backend in ("tensorized", "auto", "online"):
        F2, G2 = fs.SamplesLoss(backend=backend, potentials=True)(*args)
        assert F2.shape == F1.shape == ((B or 1), 13) and G2.shape == G1.shape == ((B or 1), 10)
        assert _rel(F2, F1) < 1e-6 and _rel(G2, G1) < 1e-6


def test_potential_shapes_of_the_multiscale_route():
    # GeomLoss's multiscale routine keeps (N,) for unbatched clouds and a batch of one (it
    # squeezes the batch); with more it falls back to the tensorized one, (B, N).
    from flashsinkhorn.autograd.samples_loss import geomloss_multiscale

    a, x, b, y = [t.detach() for t in _data(0)]
    F, G = fs.SamplesLoss(backend="multiscale", potentials=True)(x, y)
    assert F.shape == (13,) and G.shape == (10,)
    F, G = fs.SamplesLoss(backend="multiscale", potentials=True)(x[None], y[None])
    assert F.shape == (13,) and G.shape == (10,)
    F, G = fs.SamplesLoss(backend="multiscale", potentials=True)(x.expand(2, 13, 3),
                                                                 y.expand(2, 10, 3))  # fmt: skip
    assert F.shape == (2, 13)
    # "auto" takes it above 10^8 point pairs in <= 3 dimensions for p = 2 only
    assert geomloss_multiscale("auto", 0, 10_001, 10_000, 3, 2)
    assert not geomloss_multiscale("auto", 0, 10_000, 10_000, 3, 2)
    assert not geomloss_multiscale("auto", 0, 10_001, 10_000, 4, 2)
    assert not geomloss_multiscale("auto", 0, 10_001, 10_000, 3, 1)
    assert not geomloss_multiscale("auto", 2, 10_001, 10_000, 3, 2)


# ----- second derivatives -----


def _hvp_vs_finite_differences(loss, x, y, v, w, h=1e-5):
    xx, yy = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    gx, gy = torch.autograd.grad(loss(xx, yy).sum(), (xx, yy), create_graph=True)
    hx, hy = torch.autograd.grad((gx * v).sum() + (gy * w).sum(), (xx, yy))

    def grads(s):
        u, z = (x + s * h * v).requires_grad_(True), (y + s * h * w).requires_grad_(True)
        return torch.autograd.grad(loss(u, z).sum(), (u, z))

    (px, py), (mx, my) = grads(1.0), grads(-1.0)
    return (hx, hy), ((px - mx) / (2 * h), (py - my) / (2 * h))


@pytest.mark.parametrize("debias", [True, False])
@pytest.mark.parametrize("B", [0, 2])
def test_double_backward_is_the_derivative_of_the_gradient(B, debias):
    # It raised a RuntimeError; through sinkhorn_divergence it worked. A slow ladder (1000
    # steps near the final eps) reaches the fixed point, where the gradient's derivative is
    # the Hessian (exact Schur solve: tau = 0).
    _, x, _, y = [t.detach() for t in _data(B, n=7, m=5, d=2)]
    g = torch.Generator().manual_seed(11)
    v, w = torch.randn(x.shape, generator=g, dtype=x.dtype), torch.randn(y.shape, generator=g,
                                                                         dtype=y.dtype)  # fmt: skip
    loss = fs.SamplesLoss(blur=0.7, scaling=0.999999, diameter=0.7007, debias=debias,
                          hvp_options=dict(tau=0.0, cg_tol=1e-12))  # fmt: skip
    (hx, hy), (fx, fy) = _hvp_vs_finite_differences(loss, x, y, v, w)
    assert _rel(hx, fx) < 2e-5 and _rel(hy, fy) < 2e-5


def test_double_backward_matches_the_divergence():
    # Same fixed point, eps = 2 blur², GeomLoss's half cost: half the divergence's HVP.
    _, x, _, y = [t.detach() for t in _data(0, n=7, m=5, d=2)]
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(12), dtype=x.dtype)
    hv = dict(tau=0.0, cg_tol=1e-12)
    loss = fs.SamplesLoss(blur=0.7, scaling=0.999999, diameter=0.7007, hvp_options=hv)
    xs = x.clone().requires_grad_(True)
    (g1,) = torch.autograd.grad(loss(xs, y), xs, create_graph=True)
    (h1,) = torch.autograd.grad((g1 * v).sum(), xs)
    xd = x.clone().requires_grad_(True)
    S = fs.sinkhorn_divergence(xd, y, eps=0.98, tol=1e-12, n_iters=100_000, hvp_options=hv)
    (g2,) = torch.autograd.grad(S, xd, create_graph=True)
    (h2,) = torch.autograd.grad((g2 * v).sum(), xd)
    assert _rel(g1, g2 / 2) < 1e-5 and _rel(h1, h2 / 2) < 1e-5


def test_double_backward_refusals():
    a, x, b, y = _data(0, n=7, m=5, d=2)
    for kw, exc, match in (
        (dict(reach=0.5), RuntimeError, "second derivatives"),
        (dict(p=1), ValueError, "squared Euclidean cost only"),
    ):
        (gx,) = torch.autograd.grad(fs.SamplesLoss(**kw)(x, y), x, create_graph=True)
        with pytest.raises(exc, match=match):
            torch.autograd.grad(gx.sum(), x)
    # through the weights: refused, as for ot_cost
    (gx,) = torch.autograd.grad(fs.SamplesLoss()(a, x, b, y), x, create_graph=True)
    with pytest.raises(RuntimeError, match="through the weights a, b"):
        torch.autograd.grad(gx.sum(), a)


def test_hvp_options_are_checked():
    with pytest.raises(ValueError, match="hvp_options: unknown key"):
        fs.SamplesLoss(hvp_options={"damping": 1.0})
    with pytest.raises(ValueError, match="tau must be finite"):
        fs.SamplesLoss(hvp_options={"tau": -1.0})
