"""The OTDD label-augmented cost C_ij = fw·c(x_i, y_j) + lw·W[l_i, l_j] (docs/costs.md):
values, potentials, gradients (points and label_cost) against dense float64 references,
batching, the divergence's self terms, argument checks."""

import numpy as np
import pytest
import torch

import flashsinkhorn as fs
from tests import cost_reference as ref

TIGHT = dict(tol=1e-12, n_iters=20000, check_every=10)
COSTS = ["sqeuclidean", "euclidean", "cosine"]


def _data(n=11, m=9, d=3, V=4, B=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    sh = (B,) if B else ()
    x = torch.randn(*sh, n, d, generator=g, dtype=torch.float64)
    y = torch.randn(*sh, m, d, generator=g, dtype=torch.float64) * 0.8 + 0.4
    a = torch.rand(*sh, n, generator=g, dtype=torch.float64) + 0.2
    b = torch.rand(*sh, m, generator=g, dtype=torch.float64) + 0.2
    lx = torch.randint(0, V, (*sh, n), generator=g)
    ly = torch.randint(0, V, (*sh, m), generator=g)
    W = torch.rand(V, V, generator=g, dtype=torch.float64) * 2
    return x, y, a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True), lx, ly, W


def _rel(u, v):
    u = torch.as_tensor(u, dtype=torch.float64)
    v = torch.as_tensor(v, dtype=torch.float64)
    return float((u - v).abs().max() / v.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("cost", COSTS)
def test_label_cost_values_and_gradients_match_dense(cost):
    x, y, a, b, lx, ly, W = _data()
    kw = dict(cost=cost, feature_weight=0.6, label_weight=1.7)
    C = ref.full_cost(x, y, cost, None, 0.6, lx, ly, W, 1.7)
    f, g, P, value = ref.solve_cost(C.numpy(), a.numpy(), b.numpy(), 0.3)
    res = fs.sinkhorn(x, y, a, b, eps=0.3, label_x=lx, label_y=ly, label_cost=W, **kw, **TIGHT)
    assert abs(float(res.value) - value) <= 1e-9 * abs(value)
    shift = float((res.f.numpy() - f).mean())
    assert np.abs(res.f.numpy() - f - shift).max() <= 1e-9 * np.abs(f).max()
    assert _rel(res.plan(), P) <= 1e-9
    xr, yr, Wr = (t.clone().requires_grad_(True) for t in (x, y, W))
    val = fs.ot_cost(xr, yr, a, b, eps=0.3, label_x=lx, label_y=ly, label_cost=Wr, **kw, **TIGHT)
    gx, gy, gW = torch.autograd.grad(val, (xr, yr, Wr))
    rx, ry = ref.envelope_grads(x, y, P, cost=cost, fw=0.6, lx=lx, ly=ly, W=W, lw=1.7)
    assert _rel(gx, rx) <= 1e-8 and _rel(gy, ry) <= 1e-8
    assert _rel(gW, ref.label_grad(P, lx, ly, 4, 1.7)) <= 1e-9


def test_label_cost_gradient_matches_finite_differences():
    x, y, a, b, lx, ly, W = _data(V=3)

    def val(Wt):
        return fs.ot_cost(x, y, a, b, eps=0.3, label_x=lx, label_y=ly, label_cost=Wt, **TIGHT)

    Wr = W.clone().requires_grad_(True)
    (gW,) = torch.autograd.grad(val(Wr), Wr)
    h = 1e-6
    for k, l in [(0, 1), (2, 2), (1, 0)]:
        E = torch.zeros_like(W)
        E[k, l] = h
        fd = (val(W + E) - val(W - E)) / (2 * h)
        assert abs(float(gW[k, l] - fd)) <= 1e-7 * max(1.0, abs(float(fd)))


def test_zero_label_cost_equals_no_labels_and_large_w_separates_classes():
    x, y, a, b, lx, ly, W = _data()
    v0 = fs.sinkhorn(x, y, a, b, eps=0.2, **TIGHT).value
    v1 = fs.sinkhorn(
        x, y, a, b, eps=0.2, label_x=lx, label_y=ly, label_cost=torch.zeros_like(W), **TIGHT
    ).value
    assert abs(float(v0 - v1)) <= 1e-12 * abs(float(v0))
    # A constant W adds exactly its value.
    v2 = fs.sinkhorn(
        x, y, a, b, eps=0.2, label_x=lx, label_y=ly, label_cost=torch.full_like(W, 0.5), **TIGHT
    ).value
    assert abs(float(v2 - v0 - 0.5)) <= 1e-10


@pytest.mark.parametrize("shared", [False, True])
def test_batched_labels_equal_loop(shared):
    x, y, a, b, lx, ly, W = _data(B=3)
    if shared:
        lx, ly = lx[0], ly[0]
    xr = x.clone().requires_grad_(True)
    Wr = W.clone().requires_grad_(True)
    val = fs.ot_cost(xr, y, a, b, eps=0.3, label_x=lx, label_y=ly, label_cost=Wr, **TIGHT)
    gx, gW = torch.autograd.grad(val.sum(), (xr, Wr))
    gW_loop = torch.zeros_like(W)
    for k in range(3):
        lxk, lyk = (lx, ly) if shared else (lx[k], ly[k])
        xk = x[k].clone().requires_grad_(True)
        Wk = W.clone().requires_grad_(True)
        vk = fs.ot_cost(
            xk, y[k], a[k], b[k], eps=0.3, label_x=lxk, label_y=lyk, label_cost=Wk, **TIGHT
        )
        gxk, gWk = torch.autograd.grad(vk, (xk, Wk))
        assert abs(float(val[k].detach() - vk.detach())) <= 1e-10 * abs(float(vk.detach()))
        assert _rel(gx[k], gxk) <= 1e-9
        gW_loop += gWk
    assert _rel(gW, gW_loop) <= 1e-9


def test_divergence_uses_own_labels_for_self_terms():
    x, y, a, b, lx, ly, W = _data()
    W = W + W.T  # symmetric
    W.fill_diagonal_(0.0)
    kw = dict(label_cost=W, eps=0.3, **TIGHT)
    s = fs.sinkhorn_divergence(x, y, a, b, label_x=lx, label_y=ly, **kw)
    xy = fs.ot_cost(x, y, a, b, label_x=lx, label_y=ly, **kw)
    # The self terms run the symmetric schedule (SinkhornOptions.for_self_transport): on a
    # cloud against itself the alternating one crawls far short of TIGHT's tolerance.
    own = dict(kw, schedule="symmetric")
    xx = fs.ot_cost(x, x, a, a, label_x=lx, label_y=lx, **own)
    yy = fs.ot_cost(y, y, b, b, label_x=ly, label_y=ly, **own)
    assert abs(float(s - (xy - 0.5 * (xx + yy)))) <= 1e-12
    assert float(s) > 0
    s0 = fs.sinkhorn_divergence(x, x, a, a, label_x=lx, label_y=lx, **own)
    assert abs(float(s0)) <= 1e-10
    Wr = W.clone().requires_grad_(True)
    s = fs.sinkhorn_divergence(x, y, a, b, label_x=lx, label_y=ly, label_cost=Wr, eps=0.3, **TIGHT)
    s.backward()
    assert Wr.grad is not None and torch.isfinite(Wr.grad).all()


def test_bad_label_arguments():
    x, y, a, b, lx, ly, W = _data()
    ok = dict(label_x=lx, label_y=ly, label_cost=W)
    for fn in (fs.sinkhorn, fs.ot_cost, fs.sinkhorn_divergence):
        for drop in ok:
            kw = {k: v for k, v in ok.items() if k != drop}
            with pytest.raises(ValueError, match="together"):
                fn(x, y, eps=0.1, **kw)
        with pytest.raises(ValueError, match="label_x"):
            fn(x, y, eps=0.1, **{**ok, "label_x": lx + 4})
        with pytest.raises(ValueError, match="label_y"):
            fn(x, y, eps=0.1, **{**ok, "label_y": ly - 5})
        with pytest.raises(TypeError, match="label_x"):
            fn(x, y, eps=0.1, **{**ok, "label_x": lx.double()})
        with pytest.raises(TypeError, match="label_y"):
            fn(x, y, eps=0.1, **{**ok, "label_y": ly.bool()})
        with pytest.raises(TypeError, match="label_x"):
            fn(x, y, eps=0.1, **{**ok, "label_x": lx.tolist()})
        with pytest.raises(ValueError, match="label_x"):
            fn(x, y, eps=0.1, **{**ok, "label_x": lx[:-1]})
        with pytest.raises(ValueError, match="label_cost"):
            fn(x, y, eps=0.1, **{**ok, "label_cost": W[:, :3]})
        with pytest.raises(ValueError, match="label_cost"):
            fn(x, y, eps=0.1, **{**ok, "label_cost": W[0]})
        with pytest.raises(ValueError, match="label_cost"):
            fn(x, y, eps=0.1, **{**ok, "label_cost": -W})
        with pytest.raises(ValueError, match="label_cost"):
            fn(x, y, eps=0.1, **{**ok, "label_cost": W.clone().fill_(float("nan"))})
        with pytest.raises(TypeError, match="label_cost"):
            fn(x, y, eps=0.1, **{**ok, "label_cost": W.long()})
    xb, yb, ab, bb, lxb, lyb, _ = _data(B=2)
    with pytest.raises(ValueError, match="label_x"):
        fs.sinkhorn(xb, yb, eps=0.1, label_x=lxb[:, :-1], label_y=lyb, label_cost=W)


def test_hvp_refuses_labels():
    x, y, a, b, lx, ly, W = _data()
    with pytest.raises(ValueError, match="squared Euclidean"):
        fs.hvp(x, y, torch.ones_like(x), eps=0.1, label_x=lx, label_y=ly, label_cost=W)
    xr = x.clone().requires_grad_(True)
    val = fs.ot_cost(xr, y, eps=0.1, label_x=lx, label_y=ly, label_cost=W)
    (gx,) = torch.autograd.grad(val, xr, create_graph=True)
    with pytest.raises(ValueError, match="squared Euclidean"):
        torch.autograd.grad(gx.sum(), xr)
