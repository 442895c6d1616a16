"""Triton soft-min kernels (interpreter on CPU, real kernels on CUDA) against the torch backend."""

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import TorchBackend, resolve_backend
from flashsinkhorn.problem import prepare

SHAPES = [(1, 37, 53, 1), (2, 45, 29, 3), (1, 33, 70, 17), (1, 30, 41, 16), (2, 21, 38, 130)]


def _problem(B, n, m, d, device, seed=0, precision="ieee", zero_weight=False, rho=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, d, generator=g).to(device)
    y = (torch.rand(B, m, d, generator=g) * 1.3 + 0.2).to(device)
    a = torch.rand(B, n, generator=g) + 0.05
    b = torch.rand(B, m, generator=g) + 0.05
    if zero_weight:
        b[:, 1::7] = 0.0
    a, b = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    return prepare(x, y, a.to(device), b.to(device), rho_x=rho, rho_y=rho, precision=precision)


def _pots(problem, seed):
    g = torch.Generator().manual_seed(seed)
    f = (torch.randn(problem.X.sq.shape, generator=g) * 0.3).to(problem.device)
    gg = (torch.randn(problem.Y.sq.shape, generator=g) * 0.3).to(problem.device)
    return f, gg


@pytest.mark.parametrize("B,n,m,d", SHAPES)
@pytest.mark.parametrize("zero_weight", [False, True])
def test_softmin_matches_torch(device, B, n, m, d, zero_weight):
    p = _problem(B, n, m, d, device, zero_weight=zero_weight)
    f, g = _pots(p, 1)
    tri = resolve_backend("triton", p.device, torch.float32)
    eps, alpha, beta = 0.07, 0.3, 0.6
    out, raw = tri.softmin(p.X, p.Y, g, eps, f, alpha, beta, True, "ieee")
    ref_out, ref_raw = TorchBackend().softmin(p.X, p.Y, g, eps, f, alpha, beta, True, "ieee")
    scale = ref_raw.abs().max()
    assert torch.allclose(raw, ref_raw, atol=2e-6 * scale, rtol=0)
    assert torch.allclose(out, ref_out, atol=2e-6 * scale, rtol=0)
    # Without the raw output the kernel writes only the update.
    out2, none = tri.softmin(p.X, p.Y, g, eps, f, alpha, beta, False, "ieee")
    assert none is None and torch.equal(out2, out)


@pytest.mark.parametrize("B,n,m,d", SHAPES[:3])
def test_fused_symmetric_step_matches_two_half_steps(device, B, n, m, d):
    p = _problem(B, n, m, d, device, seed=2)
    f, g = _pots(p, 3)
    tri = resolve_backend("triton", p.device, torch.float32)
    fn, gn, tf, tg = tri.symmetric_step(p.X, p.Y, f, g, 0.05, 0.5, 0.5, 0.4, True, "ieee")
    rf, rg, rtf, rtg = TorchBackend().symmetric_step(
        p.X, p.Y, f, g, 0.05, 0.5, 0.5, 0.4, True, "ieee"
    )
    for got, want in ((fn, rf), (gn, rg), (tf, rtf), (tg, rtg)):
        assert torch.allclose(got, want, atol=2e-6 * want.abs().max(), rtol=0)
    # The inputs are read, never written.
    f2, g2 = _pots(p, 3)
    assert torch.equal(f, f2) and torch.equal(g, g2)


def test_softmin_extreme_scores_no_nan(device):
    """Tiny eps makes scores span thousands of log-units; the online max keeps it finite."""
    p = _problem(1, 40, 35, 3, device, seed=4)
    f, g = _pots(p, 5)
    tri = resolve_backend("triton", p.device, torch.float32)
    out, _ = tri.softmin(p.X, p.Y, g * 50, 1e-4, f, 0.0, 1.0, False, "ieee")
    ref, _ = TorchBackend().softmin(p.X, p.Y, g * 50, 1e-4, f, 0.0, 1.0, False, "ieee")
    assert torch.isfinite(out).all()
    assert torch.allclose(out, ref, atol=1e-4 * ref.abs().max(), rtol=0)


@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
@pytest.mark.parametrize("rho", [None, 0.5])
def test_full_solve_triton_matches_torch(device, schedule, rho):
    g = torch.Generator().manual_seed(6)
    x = torch.rand(2, 41, 3, generator=g)
    y = torch.rand(2, 35, 3, generator=g) + 0.1
    kw = dict(eps=0.05, n_iters=20, tol=None, schedule=schedule, rho_x=rho, rho_y=rho)
    tri = fs.sinkhorn(x.to(device), y.to(device), backend="triton", precision="ieee", **kw)
    ref = fs.sinkhorn(x.double(), y.double(), backend="torch", **kw)
    assert tri.backend == "triton"
    assert torch.allclose(tri.f.double().cpu(), ref.f, atol=2e-5)
    assert torch.allclose(tri.value.double().cpu(), ref.value, rtol=1e-5)


@pytest.mark.parametrize("spread", [1.0, 300.0, 1e-3])
def test_tf32_mode_solves_the_rounded_problem(device, spread):
    """precision='tf32' rounds the centred points once to an 11-bit grid (float16 operands
    divided by a power of two); the solve is then exact for the rounded points."""
    g = torch.Generator().manual_seed(7)
    x = torch.rand(39, 17, generator=g) * spread
    y = torch.rand(44, 17, generator=g) * spread
    eps = 0.1 * spread**2
    tri = fs.sinkhorn(
        x.to(device),
        y.to(device),
        eps=eps,
        n_iters=30,
        tol=None,
        backend="triton",
        precision="tf32",
    )
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
    mant = p.X.x.view(torch.int32) & 0x1FFF
    assert (mant == 0).all()
    assert torch.equal(p.X.xk.float() * p.X.kscale, p.X.x)
    ref = fs.sinkhorn(p.X.x[0].double(), p.Y.x[0].double(), eps=eps, n_iters=30, tol=None)
    assert torch.allclose(tri.value.double().cpu(), ref.value, rtol=2e-6)
    exact = fs.sinkhorn(x.double(), y.double(), eps=eps, n_iters=30, tol=None)
    assert abs(tri.value.item() - exact.value.item()) <= 2e-3 * exact.value.item()


def test_no_recompile_for_new_n(device):
    """A new n, m at a known d reuses the compiled kernel: n and m are not specialised, except
    whether the column count is a multiple of 16 (the column-vector loads vectorise then,
    operands.aligned_cols), which costs at most one more compilation."""
    from flashsinkhorn.backends.triton import softmin

    if not hasattr(softmin._softmin_fwd_kernel, "device_caches"):
        pytest.skip("interpreter: nothing is compiled")

    def n_compiled():
        return sum(len(c[0]) for c in softmin._softmin_fwd_kernel.device_caches.values())

    def solve(n, m):
        x, y = torch.rand(n, 8, device=device), torch.rand(m, 8, device=device)
        fs.sinkhorn(x, y, eps=0.1, n_iters=2, tol=None, schedule="alternating")

    solve(100, 77)
    start = n_compiled()
    solve(1024, 96)  # the other alignment
    warmed = n_compiled()
    assert warmed - start <= 1
    for n, m in ((257, 1000), (3001, 4097), (2048, 160), (77, 300), (4096, 33)):
        solve(n, m)
    assert n_compiled() == warmed


@pytest.mark.parametrize("split", [1, 2, 3])
def test_column_split_paths_agree(device, monkeypatch, split):
    """Single sweep and split sweeps (partial max/sum merged by the combine kernel) agree."""
    from flashsinkhorn.tuning import TUNING

    monkeypatch.setattr(TUNING, "softmin_split", split)
    p = _problem(2, 45, 97, 3, device, seed=8, zero_weight=True)
    f, g = _pots(p, 9)
    tri = resolve_backend("triton", p.device, torch.float32)
    out, raw = tri.softmin(p.X, p.Y, g, 0.05, f, 0.5, 0.5, True, "ieee")
    ref_out, ref_raw = TorchBackend().softmin(p.X, p.Y, g, 0.05, f, 0.5, 0.5, True, "ieee")
    assert torch.allclose(raw, ref_raw, atol=2e-6 * ref_raw.abs().max(), rtol=0)
    assert torch.allclose(out, ref_out, atol=2e-6 * ref_raw.abs().max(), rtol=0)
    fn, gn, tf, tg = tri.symmetric_step(p.X, p.Y, f, g, 0.05, 0.5, 0.5, 0.5, True, "ieee")
    rf, rg, _, rtg = TorchBackend().symmetric_step(
        p.X, p.Y, f, g, 0.05, 0.5, 0.5, 0.5, True, "ieee"
    )
    for got, want in ((fn, rf), (gn, rg), (tg, rtg)):
        assert torch.allclose(got, want, atol=2e-6 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
@pytest.mark.parametrize("B,n,m,d", [(1, 37, 53, 3), (2, 45, 29, 17)])
def test_dense_path_matches_streaming(device, schedule, B, n, m, d):
    """The stored-Gram path runs the same iterations as the streaming kernels."""
    g = torch.Generator().manual_seed(11)
    x = torch.rand(B, n, d, generator=g).to(device)
    y = torch.rand(B, m, d, generator=g).to(device)
    b = (torch.rand(B, m, generator=g) + 0.05).to(device)
    b[:, ::5] = 0.0
    b = b / b.sum(1, keepdim=True)
    kw = dict(eps=0.05, n_iters=12, tol=None, schedule=schedule, precision="ieee", rho_y=1.0)
    dense = fs.sinkhorn(x, y, None, b, path="dense", backend="triton", **kw)
    stream = fs.sinkhorn(x, y, None, b, path="streaming", backend="triton", **kw)
    # the log-domain torch backend, the oracle (the CPU default is the stored-kernel path)
    ref = fs.sinkhorn(
        x.double().cpu(), y.double().cpu(), None, b.double().cpu(), backend="torch", **kw
    )
    assert dense.path == "dense" and stream.path == "streaming" and ref.path == "dense"
    assert torch.allclose(dense.f, stream.f, atol=2e-5)
    assert torch.allclose(dense.g.double().cpu(), ref.g, atol=2e-5)
    assert torch.allclose(dense.value.double().cpu(), ref.value, rtol=1e-5)
    assert dense.marginal_error.shape == (B,)


def test_path_choice(device):
    x = torch.rand(20, 3, device=device)
    assert fs.sinkhorn(x, x + 0.5, eps=0.1, backend="triton").path == "streaming"
    with pytest.raises(ValueError, match="path must be one of"):
        fs.sinkhorn(x, x, eps=0.1, path="tiled")
    with pytest.raises(ValueError, match="path='streaming' needs backend='triton'"):
        fs.sinkhorn(x.double(), x.double(), eps=0.1, path="streaming")
