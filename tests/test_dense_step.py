"""The dense path's symmetric step (backends/triton/dense.py): two soft-min sweeps over the
stored Gram matrix, whose rows are padded to 16 floats so that the kernels load 16-byte
vectors. Interpreter on CPU, real kernels on CUDA; against the float64 torch backend."""

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import TorchBackend
from flashsinkhorn.backends.triton import dense
from flashsinkhorn.problem import prepare
from flashsinkhorn.tuning import TUNING

from .loop_reference import torch_iterate

# odd sizes (m = 32: no padding), d = 1..130; the soft-min tiles are 256 columns wide, so the
# last two span several column tiles (m = 531; n = 600 for the column sweep), which the
# default split puts in separate chunks (several tiles in one chunk: the chunk test, split 1)
SHAPES = [(1, 37, 53, 3), (2, 21, 38, 130), (1, 50, 17, 1), (1, 33, 70, 17), (1, 20, 32, 3),
          (1, 30, 531, 3), (2, 600, 45, 5)]  # fmt: skip


def _problem(B, n, m, d, device, seed=0, rho=None, zero_weights=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, d, generator=g, dtype=torch.float64)
    y = torch.rand(B, m, d, generator=g, dtype=torch.float64) * 1.3 + 0.2
    a = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.05
    b = torch.rand(B, m, generator=g, dtype=torch.float64) + 0.05
    if zero_weights:
        a[:, 1::4] = 0.0
        b[:, ::3] = 0.0
    a, b = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    args = [t.to(device=device) for t in (x, y, a, b)]
    p32 = prepare(*[t.float() for t in args], rho_x=rho, rho_y=rho, precision="ieee")
    p64 = prepare(*[t.cpu() for t in args], rho_x=rho, rho_y=rho, precision="ieee")
    return p32, p64


def _check(got, ref):
    for gt, rf in zip(got, ref, strict=True):
        assert torch.isfinite(gt).all()
        assert (gt.double().cpu() - rf).abs().max() <= 5e-6 * rf.abs().max()


@pytest.mark.parametrize("B,n,m,d", SHAPES)
@pytest.mark.parametrize("rho", [None, 0.7])
@pytest.mark.parametrize("k", [0, 3])
def test_dense_step_matches_float64(device, B, n, m, d, rho, k):
    """One dense symmetric step against the float64 torch step, from zero potentials and from
    a loop iterate, with the schedule's average and unequal damping weights."""
    eps = 0.1
    p, p64 = _problem(B, n, m, d, device, rho=rho)
    f64, g64 = torch_iterate(p64, eps, k)
    f, g = f64.float().to(device), g64.float().to(device)
    lx = p.X.damping(eps)
    tail = (eps, 0.5, 0.5 * lx, 0.4 * lx, True, "ieee")
    got = dense.DenseTritonBackend(p).symmetric_step(p.X, p.Y, f, g, *tail)
    _check(got, TorchBackend().symmetric_step(p64.X, p64.Y, f64, g64, *tail))


@pytest.mark.parametrize("split", [1, 3])
def test_dense_step_column_chunks(device, monkeypatch, split):
    """Both sweeps over one and over several column chunks (partials merged): at 600 × 700
    and 256-wide tiles, split 3 gives three chunks on each side."""
    eps = 0.2
    p, p64 = _problem(2, 600, 700, 5, device, seed=2)
    calls = []
    real = dense.plan_split

    def spy(*a):
        calls.append(real(*a)[0])
        return calls[-1], real(*a)[1]

    monkeypatch.setattr(dense, "plan_split", spy)
    f64, g64 = torch_iterate(p64, eps, 2)
    f, g = f64.float().to(device), g64.float().to(device)
    monkeypatch.setattr(TUNING, "softmin_split", split)
    tail = (eps, 0.0, 1.0, 1.0, False, "ieee")
    got = dense.DenseTritonBackend(p).symmetric_step(p.X, p.Y, f, g, *tail)
    assert calls == [split, split]
    assert got[2] is None and got[3] is None
    _check(got[:2], TorchBackend().symmetric_step(p64.X, p64.Y, f64, g64, *tail)[:2])


def test_dense_step_zero_weights_and_wide_range(device):
    """Zero-weight points on both sides (−inf biases, whole tile columns of them) and a small
    eps from zero potentials (exponents spread over thousands of e-folds)."""
    p, p64 = _problem(1, 37, 53, 4, device, seed=4, zero_weights=True)
    backend = dense.DenseTritonBackend(p)
    f, g = torch.zeros_like(p.X.sq), torch.zeros_like(p.Y.sq)
    for eps in (0.5, 1e-3):
        tail = (eps, 0.0, 1.0, 1.0, False, "ieee")
        got = backend.symmetric_step(p.X, p.Y, f, g, *tail)
        f64, g64 = f.double().cpu(), g.double().cpu()
        _check(got[:2], TorchBackend().symmetric_step(p64.X, p64.Y, f64, g64, *tail)[:2])


@pytest.mark.parametrize("m", [16, 53])
def test_gram_rows_padded_to_16(device, m):
    """K's row stride is a multiple of 16 floats (the kernels are specialised on it and load
    16-byte vectors up to that width); the padding columns are zeros."""
    p, _ = _problem(2, 7, m, 3, device)
    K = dense.DenseTritonBackend(p).gram
    assert K.is_contiguous() and K.shape == (2, 7, -(-m // 16) * 16)
    assert (K[..., m:] == 0).all()
    want = p.X.x.double() @ p.Y.x.double().transpose(1, 2)
    assert torch.allclose(K[..., :m].double(), want, atol=1e-5)


def test_one_compiled_soft_min_per_orientation(device):
    """New n, m at a known d reuse the dense soft-min kernel: the strides it is specialised on
    are always multiples of 16, whatever m."""
    if not hasattr(dense._dense_softmin_kernel, "device_caches"):
        pytest.skip("interpreter: nothing is compiled")

    def n_compiled():
        return sum(len(c[0]) for c in dense._dense_softmin_kernel.device_caches.values())

    def solve(n, m):
        x, y = torch.rand(n, 300, device=device), torch.rand(m, 300, device=device)
        fs.sinkhorn(x, y, eps=0.5, n_iters=2, tol=None, path="dense", backend="triton")

    solve(100, 77)
    before = n_compiled()
    for n, m in ((1, 17), (257, 53), (600, 600), (1000, 4100)):
        solve(n, m)
    assert n_compiled() == before


@pytest.mark.parametrize("rho", [None, 0.7])
@pytest.mark.parametrize("chunk", [None, 700, 12000])
@pytest.mark.parametrize("n,m,zero", [(45, 300, False), (40, 40, True)])
def test_dense_envelope_gradient_reads_the_gram_matrix(device, monkeypatch, rho, chunk, n, m, zero):
    """Both orientations of the envelope gradient go through the softmax kernel over K (the
    right orientation each) and match the float64 torch gradient and row marginal; ``chunk``:
    several row blocks; a square case (an orientation mix-up keeps the shapes) with
    zero-weight points. 700 scores make blocks of 1 row (x side) and 7 (y side); 12000 make
    blocks of 20 and 133 rows, each split over several programs (row0 > 0 inside a block)."""
    eps = 0.1
    p, p64 = _problem(2, n, m, 7, device, rho=rho, zero_weights=zero)
    f64, g64 = torch_iterate(p64, eps, 6)
    f, g = f64.float().to(device), g64.float().to(device)
    backend = dense.DenseTritonBackend(p)
    if chunk is not None:
        backend.chunk_elements = chunk
    tb = TorchBackend()
    want = [
        tb.transport_grad(p64.X, p64.Y, f64, g64, eps, "ieee"),
        tb.transport_grad(p64.Y, p64.X, g64, f64, eps, "ieee"),
    ]
    hooks = []
    real = dense.dense_transport_grad

    def spy(gram, transposed, *a):
        hooks.append(transposed)
        return real(gram, transposed, *a)

    monkeypatch.setattr(dense, "dense_transport_grad", spy)
    sides = ((p.X, p.Y, f, g), (p.Y, p.X, g, f))
    for (R, C, rp, cp), (G64, marg64) in zip(sides, want, strict=True):
        G, marg = backend.transport_grad(R, C, rp, cp, eps, "ieee")
        assert (G.double().cpu() - G64).abs().max() <= 1e-5 * G64.abs().max()
        assert (marg.double().cpu() - marg64).abs().max() <= 1e-5 * marg64.abs().max()
    assert hooks == [False, True]


def test_dense_envelope_gradient_other_sides_stream(device):
    """Sides the Gram matrix was not built from (a self term) take the streaming gradient."""
    eps = 0.2
    p, p64 = _problem(1, 30, 40, 5, device)
    backend = dense.DenseTritonBackend(p)
    f = torch.zeros_like(p.X.sq)
    G, _ = backend.transport_grad(p.X, p.X, f, f, eps, "ieee")
    f64 = torch.zeros_like(p64.X.sq)
    G64, _ = TorchBackend().transport_grad(p64.X, p64.X, f64, f64, eps, "ieee")
    assert (G.double().cpu() - G64).abs().max() <= 1e-5 * G64.abs().max()


def test_ot_cost_gradient_on_the_dense_path(device, monkeypatch):
    """End to end: ot_cost at d = 300 takes the dense path ("auto") and its gradients with
    respect to x and y come from K; they match the float64 torch backend's."""
    g = torch.Generator().manual_seed(9)
    x = torch.rand(37, 300, generator=g, dtype=torch.float64)
    y = torch.rand(29, 300, generator=g, dtype=torch.float64)
    calls = []
    real = dense.DenseTritonBackend.transport_grad

    def counted(self, *a):
        calls.append(1)
        return real(self, *a)

    monkeypatch.setattr(dense.DenseTritonBackend, "transport_grad", counted)
    kw = dict(eps=2.0, n_iters=30, tol=None, precision="ieee")
    x32 = x.float().to(device).requires_grad_()
    y32 = y.float().to(device).requires_grad_()
    gx, gy = torch.autograd.grad(fs.ot_cost(x32, y32, backend="triton", **kw), (x32, y32))
    x64, y64 = x.clone().requires_grad_(), y.clone().requires_grad_()
    rx, ry = torch.autograd.grad(fs.ot_cost(x64, y64, backend="torch", **kw), (x64, y64))
    assert len(calls) == 2
    assert (gx.double().cpu() - rx).abs().max() <= 1e-4 * rx.abs().max()
    assert (gy.double().cpu() - ry).abs().max() <= 1e-4 * ry.abs().max()


def test_dense_envelope_gradient_uses_the_stored_products(device):
    """The scores come from K itself: adding δ_j to K's column j acts as g + 2δ for the x side,
    adding δ_i to K's row i as f + 2δ for the y side (a recomputation from the points would
    ignore both)."""
    eps = 0.2
    p, p64 = _problem(2, 33, 50, 4, device, seed=6)
    f64, g64 = torch_iterate(p64, eps, 4)
    f, g = f64.float().to(device), g64.float().to(device)
    tb = TorchBackend()
    gen = torch.Generator().manual_seed(1)
    dy = torch.rand(2, 50, generator=gen, dtype=torch.float64) * 0.3
    dx = torch.rand(2, 33, generator=gen, dtype=torch.float64) * 0.3
    bx = dense.DenseTritonBackend(p)
    bx.gram[:, :, :50] += dy[:, None, :].float().to(device)
    Gx, _ = bx.transport_grad(p.X, p.Y, f, g, eps, "ieee")
    Wx, _ = tb.transport_grad(p64.X, p64.Y, f64, g64 + 2 * dy, eps, "ieee")
    assert (Gx.double().cpu() - Wx).abs().max() <= 1e-5 * Wx.abs().max()
    by = dense.DenseTritonBackend(p)
    by.gram[:, :33, :] += dx[:, :, None].float().to(device)
    Gy, _ = by.transport_grad(p.Y, p.X, g, f, eps, "ieee")
    Wy, _ = tb.transport_grad(p64.Y, p64.X, g64, f64 + 2 * dx, eps, "ieee")
    assert (Gy.double().cpu() - Wy).abs().max() <= 1e-5 * Wy.abs().max()


def test_dense_path_ignores_autocast(device):
    """Under autocast the Gram matrix stays fp32 and the gradient equals the one without."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(31, 300, generator=g).to(device)
    y = torch.rand(26, 300, generator=g).to(device)
    kw = dict(eps=2.0, n_iters=20, tol=None, precision="ieee", backend="triton")

    def grads():
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
        res = fs.sinkhorn(xr.detach(), yr.detach(), **kw)
        gx, gy = torch.autograd.grad(fs.ot_cost(xr, yr, **kw), (xr, yr))
        return res, gx, gy

    res0, gx0, gy0 = grads()
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        res1, gx1, gy1 = grads()
    assert res1.path == "dense" and res1.solution.backend.gram.dtype == torch.float32
    torch.testing.assert_close(res1.f, res0.f)
    torch.testing.assert_close(gx1, gx0)
    torch.testing.assert_close(gy1, gy0)
