"""CUDA: compiled Triton kernels for the costs of docs/costs.md against the torch backend
(float64), marker ``gpu``."""

import pytest
import torch

import flashsinkhorn as fs

pytestmark = pytest.mark.gpu


def _inputs(n, m, d, V=7, B=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sh = (B,) if B else ()
    x = torch.rand(*sh, n, d, device="cuda", generator=g)
    y = torch.rand(*sh, m, d, device="cuda", generator=g)
    lx = torch.randint(0, V, (*sh, n), device="cuda", generator=g)
    ly = torch.randint(0, V, (*sh, m), device="cuda", generator=g)
    W = torch.rand(V, V, device="cuda", generator=g)
    return x, y, lx, ly, W


def _rel(u, v):
    u, v = u.detach().double(), v.detach().double()
    return float((u - v).abs().max() / v.abs().max())


@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean", "cosine"])
@pytest.mark.parametrize("labels", [False, True])
@pytest.mark.parametrize("n,d,B", [(4097, 64, None), (1000, 3, 4), (3000, 130, None)])
def test_gpu_costs_match_torch(cost, labels, n, d, B):
    x, y, lx, ly, W = _inputs(n, n + 5, d, B=B)
    kw = dict(eps=0.1, n_iters=10, tol=None, cost=cost)
    if labels:
        kw.update(label_x=lx, label_y=ly, label_weight=0.5)
    outs = []
    for be, dt in (("triton", torch.float32), ("torch", torch.float64)):
        xr = x.to(dt).requires_grad_(True)
        Wr = W.to(dt).requires_grad_(True)
        extra = dict(label_cost=Wr) if labels else {}
        val = fs.ot_cost(xr, y.to(dt), backend=be, precision="ieee", **kw, **extra)
        grads = torch.autograd.grad(val.sum(), (xr, Wr) if labels else (xr,))
        outs.append((val, *grads))
    (v1, *g1), (v2, *g2) = outs
    assert _rel(v1, v2) <= 1e-5
    for u, v in zip(g1, g2, strict=True):
        assert _rel(u, v) <= 1e-4 or cost == "euclidean"
    if cost == "euclidean":
        # Each row of the euclidean gradient is â_i (= 1/n) times an average of unit vectors;
        # the fp32 distance expansion (docs/costs.md) is accurate relative to that bound.
        err = (g1[0].double() - g2[0]).abs().max()
        assert float(err) <= 1e-3 / n


@pytest.mark.parametrize("cost", ["euclidean", "cosine"])
def test_gpu_costs_tf32_and_half(cost):
    x, y, lx, ly, W = _inputs(5000, 5003, 64)
    kw = dict(eps=0.1, n_iters=10, tol=None, cost=cost, label_x=lx, label_y=ly, label_cost=W)
    ref = fs.sinkhorn(x.double(), y.double(), backend="torch", **kw).value
    out = fs.sinkhorn(x, y, backend="triton", precision="tf32", **kw).value
    assert _rel(out, ref) <= 2e-3
    for dt in (torch.float16, torch.bfloat16):
        xh = x.to(dt).requires_grad_(True)
        val = fs.ot_cost(xh, y.to(dt), backend="triton", **kw)
        (gx,) = torch.autograd.grad(val, xh)
        assert torch.isfinite(gx).all()
        assert _rel(val, ref) <= 3e-2


def test_gpu_mahalanobis_and_large_label_set():
    x, y, lx, ly, _ = _inputs(4000, 4001, 32, V=300)
    W = torch.rand(300, 300, device="cuda")
    L = torch.randn(16, 32, device="cuda")
    kw = dict(eps=0.2, n_iters=10, tol=None, feature_map=L, label_x=lx, label_y=ly, label_cost=W)
    ref = fs.sinkhorn(
        x.double(),
        y.double(),
        backend="torch",
        **{**kw, "feature_map": L.double(), "label_cost": W.double()},
    )
    out = fs.sinkhorn(x, y, backend="triton", precision="ieee", **kw)
    assert _rel(out.value, ref.value) <= 1e-5
    assert _rel(out.f, ref.f) <= 1e-4
