"""CUDA: Triton transport kernels and gradients against the float64 torch backend (``gpu``)."""

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import TorchBackend, resolve_backend
from flashsinkhorn.problem import prepare

pytestmark = pytest.mark.gpu


def _rel(u, v):
    return float((u.double() - v).abs().max() / v.abs().max())


def _half_step_problem(g, B, n, m, d, eps, precision):
    """A batched CUDA problem and potentials one soft-min half-step from zero (torch)."""
    x = torch.rand(B, n, d, generator=g).cuda()
    y = (torch.rand(B, m, d, generator=g) * 1.3 + 0.2).cuda()
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision=precision)
    tb, zx = TorchBackend(), torch.zeros_like(p.X.sq)
    gp, _ = tb.softmin(p.Y, p.X, zx, eps, torch.zeros_like(p.Y.sq), 0.0, 1.0, False, "ieee")
    fp, _ = tb.softmin(p.X, p.Y, gp, eps, zx, 0.0, 1.0, False, "ieee")
    return p, fp, gp


@pytest.mark.parametrize("n,d", [(1000, 3), (4097, 64), (20000, 3), (20000, 64), (6000, 512)])
@pytest.mark.parametrize("p_width", [1, 64, 300])
def test_transport_matches_torch_cuda(n, d, p_width):
    g = torch.Generator(device="cuda").manual_seed(n + d + p_width)
    x = torch.rand(n, d, device="cuda", generator=g)
    y = torch.rand(n + 5, d, device="cuda", generator=g)
    eps = 0.1 * max(1.0, d / 64)
    ref = fs.sinkhorn(x.double(), y.double(), eps=eps, n_iters=10, tol=None, backend="torch")
    P64 = ref.solution.problem
    P32 = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="ieee")
    f32, g32 = ref.solution.f.float(), ref.solution.g.float()
    tri = resolve_backend("triton", x.device, torch.float32)
    tb = TorchBackend()
    V = torch.randn(1, n + 5, p_width, device="cuda", generator=g)
    U = torch.randn(1, n, p_width, device="cuda", generator=g)
    tol = 2e-3 if d >= 512 else 2e-4
    out, marg = tri.transport(P32.X, P32.Y, f32, g32, eps, V, None, None, "ieee")
    rout, rmarg = tb.transport(
        P64.X, P64.Y, ref.solution.f, ref.solution.g, eps, V.double(), None, None, "ieee"
    )
    assert _rel(out, rout) < tol and _rel(marg, rmarg) < tol
    out, _ = tri.transport(P32.Y, P32.X, g32, f32, eps, U, None, None, "ieee")
    rout, _ = tb.transport(
        P64.Y, P64.X, ref.solution.g, ref.solution.f, eps, U.double(), None, None, "ieee"
    )
    assert _rel(out, rout) < tol
    for rows, cols, rp, cp, rp64, cp64, r64, c64 in (
        (P32.X, P32.Y, f32, g32, ref.solution.f, ref.solution.g, P64.X, P64.Y),
        (P32.Y, P32.X, g32, f32, ref.solution.g, ref.solution.f, P64.Y, P64.X),
    ):
        G, _ = tri.transport_grad(rows, cols, rp, cp, eps, "ieee")
        R, _ = tb.transport_grad(r64, c64, rp64, cp64, eps, "ieee")
        assert _rel(G, R) < 10 * tol


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("d", [3, 64, 128])
def test_value_tiles_at_benchmark_shapes_cuda(precision, d):
    # P V with V as wide as the points (the tile configs of bench_kernels' transport_pv: one
    # value tile of 16, 64 or 128 columns, 4 or 8 warps, a split sweep merged in place) and
    # batched, odd-sized, against float64 with the exact plan of the float32 points.
    g = torch.Generator().manual_seed(d)
    B, n, m, eps = 2, 20011, 9973, 0.1 * max(1.0, d / 64)
    p, fp, gp = _half_step_problem(g, B, n, m, d, eps, precision)
    tb, tri = TorchBackend(), resolve_backend("triton", p.device, torch.float32)
    V = torch.randn(B, m, d, generator=g).cuda()
    out, marg = tri.transport(p.X, p.Y, fp, gp, eps, V, None, None, precision)
    # the points the kernels read: "tf32" rounds them to the float16 grid (p.X.x is on it),
    # "tf32x3" splits them into float16 parts exact to 22 bits
    x64, y64 = p.X.x.double(), p.Y.x.double()
    P64 = prepare(x64, y64, None, None, rho_x=None, rho_y=None, precision="ieee")
    ref, rmarg = tb.transport(P64.X, P64.Y, fp.double(), gp.double(), eps, V.double(),
                              None, None, "ieee")  # fmt: skip
    # "tf32": the value dot rounds the plan tile and V to TF32 (unit 2^-11)
    assert _rel(out, ref) < (5e-3 if precision == "tf32" else 5e-4)
    assert _rel(marg, rmarg) < 5e-4


@pytest.mark.parametrize("d", [3, 64])
def test_hadamard_matches_torch_cuda(d):
    n = 3001
    g = torch.Generator(device="cuda").manual_seed(d)
    x = torch.rand(n, d, device="cuda", generator=g)
    y = torch.rand(n - 7, d, device="cuda", generator=g)
    ref = fs.sinkhorn(x.double(), y.double(), eps=0.1, n_iters=10, tol=None, backend="torch")
    P64 = ref.solution.problem
    P32 = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="ieee")
    A = torch.randn(1, n, d, device="cuda", generator=g)
    V = torch.randn(1, n - 7, d, device="cuda", generator=g)
    tri = resolve_backend("triton", x.device, torch.float32)
    Bw = P32.Y.x
    out, _ = tri.transport(
        P32.X, P32.Y, ref.solution.f.float(), ref.solution.g.float(), 0.1, V, A, Bw, "ieee"
    )
    rout, _ = TorchBackend().transport(
        P64.X, P64.Y, ref.solution.f, ref.solution.g, 0.1, V.double(), A.double(), P64.Y.x, "ieee"
    )
    assert _rel(out, rout) < 1e-3


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
@pytest.mark.parametrize("d", [17, 70, 130])
def test_hadamard_every_rank_and_precision_cuda(precision, d):
    # Rank blocks of 16, 32 and 64 against every score-operand layout (tile configs of 4 and 8
    # warps, one or three d-tiles): 16-wide tensor-core rank blocks once gave wrong weights
    # and an illegal address on the H200 (configs.TC_MIN_RANK_BLOCK).
    g = torch.Generator().manual_seed(d)
    B, n, m, eps = 2, 213, 338, 0.4
    p, fp, gp = _half_step_problem(g, B, n, m, d, eps, precision)
    tb, tri = TorchBackend(), resolve_backend("triton", p.device, torch.float32)
    # The value dot of "tf32" rounds the plan tile to TF32 (unit 2^-11).
    tol = 5e-3 if precision == "tf32" else 2e-5
    for r in (2, 17, 40, 64):
        A = torch.randn(B, n, r, generator=g).cuda()
        Bw = torch.randn(B, m, r, generator=g).cuda()
        V = torch.randn(B, m, 3, generator=g).cuda()
        out, _ = tri.transport(p.X, p.Y, fp, gp, eps, V, A, Bw, precision)
        ref, _ = tb.transport(p.X, p.Y, fp, gp, eps, V, A, Bw, "ieee")
        assert _rel(out, ref.double()) < tol, r


@pytest.mark.parametrize("n,d", [(10000, 64), (10000, 512)])
def test_ot_cost_fwd_bwd_tf32_cuda(n, d):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.rand(n, d, device="cuda", generator=g).requires_grad_()
    y = torch.rand(n, d, device="cuda", generator=g)
    kw = dict(eps=0.1, n_iters=10, tol=None)
    ref_x = x.detach().double().requires_grad_()
    ref = fs.ot_cost(ref_x, y.double(), backend="torch", **kw)
    (gref,) = torch.autograd.grad(ref, ref_x)
    for precision, tol in (("ieee", 1e-3), ("tf32", 5e-2)):
        val = fs.ot_cost(x, y, precision=precision, **kw)
        (gx,) = torch.autograd.grad(val, x)
        assert abs(val.item() - ref.item()) / abs(ref.item()) < tol
        assert _rel(gx, gref) < tol, (precision, _rel(gx, gref))


def test_batched_training_shape_cuda():
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.rand(64, 1024, 3, device="cuda", generator=g).requires_grad_()
    y = torch.rand(64, 1024, 3, device="cuda", generator=g)
    s = fs.sinkhorn_divergence(x, y, eps=0.1, n_iters=10, tol=None)
    assert s.shape == (64,)
    s.sum().backward()
    assert torch.isfinite(x.grad).all()
    # ieee: S is a difference of nearly equal OT values, TF32 errors would dominate it.
    loss = fs.SamplesLoss(blur=0.3, precision="ieee")(x, y)
    (gx,) = torch.autograd.grad(loss.sum(), x)
    ref_x = x.detach().double().requires_grad_()
    ref = fs.SamplesLoss(blur=0.3, backend="tensorized")(ref_x, y.double())
    (gref,) = torch.autograd.grad(ref.sum(), ref_x)
    assert _rel(loss.detach(), ref.detach()) < 1e-3
    assert _rel(gx, gref) < 1e-3


@pytest.mark.parametrize("d", [64, 128])
def test_inplace_merge_is_deterministic_and_lean_cuda(monkeypatch, d):
    # The split sweeps merge into the output in chunk order (tickets): the gradient must equal
    # the per-chunk-partials path, be bit-identical run to run, and allocate no per-chunk
    # accumulators (the combine path's split x n x d floats).
    from flashsinkhorn.backends.triton import transport as T
    from flashsinkhorn.tuning import TUNING

    g = torch.Generator(device="cuda").manual_seed(7)
    n = 10_000
    x = torch.rand(n, d, device="cuda", generator=g)
    y = torch.rand(n, d, device="cuda", generator=g)
    res = fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None)
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
    f, gg = res.f[None].contiguous(), res.g[None].contiguous()
    V = torch.randn(1, n, 1, device="cuda", generator=g)
    out = {}
    for merge in (False, True, True):
        monkeypatch.setattr(TUNING, "inplace_merge", merge)
        T.transport_grad(p.X, p.Y, f, gg, 0.1, "tf32")  # compiled and loaded
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        G, marg = T.transport_grad(p.X, p.Y, f, gg, 0.1, "tf32")
        PV, _ = T.transport(p.X, p.Y, f, gg, 0.1, V, None, None, "tf32")
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        out.setdefault(merge, []).append((G, marg, PV, extra))
    ((G0, m0, v0, extra0),) = out[False]
    (G1, m1, v1, extra1), (G2, m2, v2, _) = out[True]
    assert torch.equal(G1, G2) and torch.equal(m1, m2) and torch.equal(v1, v2)
    assert _rel(G1, G0) < 1e-5 and _rel(m1, m0) < 1e-6 and _rel(v1, v0) < 1e-6
    # outputs (G, marginals, P V) and a few (B, n) rows: well under one extra n x d buffer
    assert extra1 < G1.numel() * 4 * 1.5 + 40 * n * 4, (extra1, extra0)
    assert extra1 < extra0
