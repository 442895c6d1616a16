"""Envelope gradients of ot_cost: gradcheck at convergence (float64, torch backend), induced
marginals for early-stopped solves, weights, Triton vs torch, second-order refusal, grad modes."""

import pytest
import torch

import flashsinkhorn as fs

TIGHT = dict(n_iters=3000, tol=1e-12, backend="torch")


def _clouds(batched=False, n=7, m=6, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    sh = (2,) if batched else ()
    x = torch.rand(*sh, n, d, generator=g, dtype=torch.float64)
    y = torch.rand(*sh, m, d, generator=g, dtype=torch.float64) * 0.9 + 0.3
    a = torch.rand(*sh, n, generator=g, dtype=torch.float64) + 0.2
    b = torch.rand(*sh, m, generator=g, dtype=torch.float64) + 0.2
    return x, y, a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)


@pytest.mark.parametrize("batched", [False, True])
def test_gradcheck_points(batched):
    x, y, a, b = _clouds(batched, n=5, m=4)
    x.requires_grad_(True)
    y.requires_grad_(True)
    f = lambda x, y: fs.ot_cost(x, y, a, b, eps=0.2, **TIGHT)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, y), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_balanced_weights_through_softmax():
    # Balanced weights live on the simplex: ∇_a = f is defined up to a constant, which a
    # softmax parametrisation removes.
    x, y, _, _ = _clouds()
    ta = torch.randn(7, dtype=torch.float64, requires_grad=True)
    tb = torch.randn(6, dtype=torch.float64, requires_grad=True)
    f = lambda ta, tb: fs.ot_cost(x, y, ta.softmax(0), tb.softmax(0), eps=0.1, **TIGHT)  # noqa: E731
    assert torch.autograd.gradcheck(f, (ta, tb), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("rho", [(0.5, 0.5), (None, 0.3)])
def test_gradcheck_unbalanced_weights_and_points(rho):
    x, y, a, b = _clouds()
    a = (a * 1.3).requires_grad_(True)
    b = (b * 0.8).requires_grad_(True)
    x.requires_grad_(True)
    kw = dict(eps=0.2, rho_x=rho[0], rho_y=rho[1], **TIGHT)
    f = lambda x, a, b: fs.ot_cost(x, y, a, b, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, a, b), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_early_stopped_gradient_uses_induced_marginals():
    x, y, a, b = _clouds(n=9, m=8)
    x.requires_grad_(True)
    y.requires_grad_(True)
    kw = dict(eps=0.05, n_iters=3, tol=None, backend="torch")
    val = fs.ot_cost(x, y, a, b, **kw)
    gx, gy = torch.autograd.grad(val, (x, y))
    P = fs.sinkhorn(x.detach(), y.detach(), a, b, **kw).plan()
    xd, yd = x.detach(), y.detach()
    ahat, bhat = P.sum(1), P.sum(0)
    assert float((ahat - a).abs().max()) > 1e-3  # genuinely not converged
    torch.testing.assert_close(gx, 2 * (ahat[:, None] * xd - P @ yd), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gy, 2 * (bhat[:, None] * yd - P.T @ xd), rtol=1e-10, atol=1e-12)


def test_weight_gradients_are_the_potentials_and_keep_shapes():
    x, y, a, b = _clouds(batched=True)
    a_shared = a[0].clone().requires_grad_(True)
    b3 = b[..., None].clone().requires_grad_(True)
    val = fs.ot_cost(x, y, a_shared, b3[..., 0], eps=0.1, **TIGHT)
    ga, gb = torch.autograd.grad(val.sum(), (a_shared, b3))
    res = fs.sinkhorn(x, y, a_shared, b3[..., 0].detach(), eps=0.1, **TIGHT)
    assert ga.shape == (7,) and gb.shape == (2, 6, 1)
    torch.testing.assert_close(ga, res.f.sum(0))
    torch.testing.assert_close(gb[..., 0], res.g)


def test_far_from_origin_gradient_is_translation_invariant():
    x, y, a, b = _clouds()
    g0 = torch.autograd.grad(fs.ot_cost(x.requires_grad_(), y, a, b, eps=0.05, **TIGHT), x)[0]
    xs = (x.detach() + 1e4).requires_grad_()
    g1 = torch.autograd.grad(fs.ot_cost(xs, y + 1e4, a, b, eps=0.05, **TIGHT), xs)[0]
    torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("d", [3, 17])
def test_triton_gradients_match_torch(device, d):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 37, d, generator=g)
    y = torch.rand(2, 29, d, generator=g) + 0.2
    kw = dict(eps=0.5, n_iters=5, tol=None, precision="ieee")
    out = []
    for backend, dev in (("triton", device), ("torch", "cpu")):
        xx = x.to(dev).requires_grad_()
        yy = y.to(dev).requires_grad_()
        val = fs.ot_cost(xx, yy, backend=backend, **kw)
        out.append((val, *torch.autograd.grad(val.sum(), (xx, yy))))
    for t, r in zip(out[0], out[1], strict=True):
        torch.testing.assert_close(t.cpu(), r, rtol=2e-4, atol=2e-6)


def test_second_derivative_is_the_hvp():
    # Double backward through ot_cost applies the streaming HVP (tests/test_hvp.py checks values).
    x, y, a, b = _clouds()
    x.requires_grad_(True)
    val = fs.ot_cost(x, y, a, b, eps=0.1, backend="torch", tol=1e-6)
    (gx,) = torch.autograd.grad(val, x, create_graph=True)
    (hv,) = torch.autograd.grad(gx.pow(2).sum(), x)
    ref = fs.hvp(x.detach(), y, 2.0 * gx.detach(), a, b, eps=0.1, backend="torch", tol=1e-6)
    torch.testing.assert_close(hv, ref.hvp, rtol=1e-4, atol=1e-6)


def test_second_derivative_raises_for_relaxed_samples_loss():
    # SamplesLoss differentiates twice for p = 2 without reach (tests/test_samples_loss.py);
    # with reach, as for unbalanced ot_cost, a second derivative is refused.
    x, y, _, _ = _clouds()
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(
        fs.SamplesLoss(blur=0.3, reach=0.5, backend="tensorized")(x, y), x, create_graph=True
    )
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(gx.sum(), x)


def test_no_grad_and_inference_mode():
    x, y, a, b = _clouds()
    x.requires_grad_(True)
    with torch.no_grad():
        v = fs.ot_cost(x, y, a, b, eps=0.1, backend="torch")
        s = fs.sinkhorn_divergence(x, y, a, b, eps=0.1, backend="torch")
        s2 = fs.SamplesLoss(blur=0.3, backend="tensorized")(x, y)
        assert not torch.is_grad_enabled()
    assert not (v.requires_grad or s.requires_grad or s2.requires_grad)
    with torch.inference_mode():
        xi, yi = x.detach().clone(), y.clone()
        v2 = fs.ot_cost(xi, yi, a, b, eps=0.1, backend="torch")
        s3 = fs.sinkhorn_divergence(xi, yi, eps=0.1, backend="torch")
        s4 = fs.SamplesLoss(blur=0.3, backend="tensorized")(xi, yi)
        assert not torch.is_grad_enabled()
    torch.testing.assert_close(v2, v)
    assert s3.shape == () and s4.shape == ()


def test_inputs_not_modified():
    x, y, a, b = _clouds(batched=True)
    x.requires_grad_(True)
    a.requires_grad_(True)
    saved = [t.detach().clone() for t in (x, y, a, b)]
    val = fs.sinkhorn_divergence(x, y, a, b, eps=0.1, backend="torch", tol=1e-6)
    val.sum().backward()
    val = fs.SamplesLoss(blur=0.2)(a, x, b, y)
    val.sum().backward()
    for t, s in zip((x, y, a, b), saved, strict=True):
        assert torch.equal(t.detach(), s)
