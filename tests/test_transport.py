"""Transport operators from potentials: torch backend vs dense float64 math, Triton (interpreter
on CPU) vs torch at odd sizes, and the SinkhornResult methods built on them."""

from dataclasses import replace

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import TorchBackend, resolve_backend
from flashsinkhorn.backends.triton import transport as triton_transport
from flashsinkhorn.problem import prepare
from flashsinkhorn.tuning import TUNING

# (B, n, m, d): n, m never multiples of the 32-wide interpreter tiles; d crosses D_TILES.
SHAPES = [(1, 37, 53, 1), (2, 45, 29, 3), (1, 33, 70, 17), (2, 21, 38, 130)]


def _problem(
    B, n, m, d, device, dtype=torch.float32, seed=0, zero_weight=False, precision="ieee",
    spread=1.0, **kw,
):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, d, generator=g, dtype=torch.float64) * spread
    y = (torch.rand(B, m, d, generator=g, dtype=torch.float64) * 1.3 + 0.2) * spread
    a = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.05
    b = torch.rand(B, m, generator=g, dtype=torch.float64) + 0.05
    if zero_weight is True:
        a[:, 2::5] = 0.0
        b[:, 1::7] = 0.0
    if zero_weight == "tail":
        b[:, m // 2 :] = 0.0  # whole column chunks of zero weight: partials with max = -inf
    a, b = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return prepare(
        cast(x), cast(y), cast(a), cast(b), rho_x=None, rho_y=None, precision=precision, **kw
    )


def _pots(problem, seed, eps=0.3, scale=0.5):
    """Potentials one half-step from a fixed point, perturbed by ~scale·eps (early-stopped)."""
    tb = TorchBackend()
    X, Y = problem.X, problem.Y
    zx = torch.zeros_like(X.sq)
    g0, _ = tb.softmin(Y, X, zx, eps, torch.zeros_like(Y.sq), 0.0, 1.0, False, "ieee")
    f0, _ = tb.softmin(X, Y, g0, eps, zx, 0.0, 1.0, False, "ieee")
    gen = torch.Generator().manual_seed(seed)
    nf = torch.randn(X.sq.shape, generator=gen, dtype=torch.float64) * scale * eps
    ng = torch.randn(Y.sq.shape, generator=gen, dtype=torch.float64) * scale * eps
    return f0 + nf.to(f0), g0 + ng.to(g0)


def _dense_plan(problem, f, g, eps):
    X, Y = problem.X, problem.Y
    x, y = X.x.double().cpu(), Y.x.double().cpu()
    C = ((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1)
    logp = (f.double().cpu()[:, :, None] + g.double().cpu()[:, None, :] - C) / eps
    return X.w.double().cpu()[:, :, None] * Y.w.double().cpu()[:, None, :] * torch.exp(logp)


def _rel(u, v):
    return float((u.double().cpu() - v.double().cpu()).abs().max() / v.double().abs().max())


# ----- torch backend against dense float64 -----


@pytest.mark.parametrize("zero_weight", [False, True])
def test_torch_transport_matches_dense(zero_weight):
    p = _problem(2, 13, 9, 3, "cpu", torch.float64, zero_weight=zero_weight)
    eps = 0.2
    f, g = _pots(p, 1, eps)
    P = _dense_plan(p, f, g, eps)
    gen = torch.Generator().manual_seed(3)
    V = torch.randn(2, 9, 4, generator=gen, dtype=torch.float64)
    U = torch.randn(2, 13, 2, generator=gen, dtype=torch.float64)
    A = torch.randn(2, 13, 3, generator=gen, dtype=torch.float64)
    Bw = torch.randn(2, 9, 3, generator=gen, dtype=torch.float64)
    tb = TorchBackend(chunk_elements=40)  # several row chunks
    out, marg = tb.transport(p.X, p.Y, f, g, eps, V, None, None, "ieee")
    torch.testing.assert_close(out, P @ V, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(marg, P.sum(2), rtol=1e-12, atol=1e-14)
    outT, margT = tb.transport(p.Y, p.X, g, f, eps, U, None, None, "ieee")
    torch.testing.assert_close(outT, P.transpose(1, 2) @ U, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(margT, P.sum(1), rtol=1e-12, atol=1e-14)
    outH, _ = tb.transport(p.X, p.Y, f, g, eps, V, A, Bw, "ieee")
    torch.testing.assert_close(outH, (P * (A @ Bw.transpose(1, 2))) @ V, rtol=1e-12, atol=1e-14)
    marg_only = tb.transport(p.X, p.Y, f, g, eps, None, None, None, "ieee")
    assert marg_only[0] is None
    torch.testing.assert_close(marg_only[1], P.sum(2), rtol=1e-12, atol=1e-14)
    grad, gm = tb.transport_grad(p.X, p.Y, f, g, eps, "ieee")
    x, y = p.X.x, p.Y.x
    ref = 2 * (P.sum(2)[..., None] * x - P @ y)
    torch.testing.assert_close(grad, ref, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(gm, P.sum(2), rtol=1e-12, atol=1e-14)


def test_torch_transport_far_from_fixed_point_does_not_overflow():
    # Potentials of size 50/eps: exp would overflow without the per-row normalisation.
    p = _problem(1, 11, 7, 2, "cpu", torch.float64)
    eps = 0.01
    f, g = _pots(p, 2, eps)
    f = f + 3.0  # 300 eps off: exp(300) overflows float64 without the normalisation
    V = torch.randn(1, 7, 3, dtype=torch.float64)
    out, marg = TorchBackend().transport(p.X, p.Y, f, g, eps, V, None, None, "ieee")
    assert torch.isfinite(out).all() and torch.isfinite(marg).all()
    P = _dense_plan(p, f, g, eps)
    torch.testing.assert_close(out, P @ V, rtol=1e-10, atol=0)


# ----- Triton kernels against the torch backend -----


@pytest.mark.parametrize("B,n,m,d", SHAPES)
@pytest.mark.parametrize("p_width", [1, 5, 40])
def test_triton_apply_matches_torch(device, B, n, m, d, p_width):
    p = _problem(B, n, m, d, device, zero_weight=(d == 3))
    f, g = _pots(p, 4)
    V = torch.randn(B, m, p_width, generator=torch.Generator().manual_seed(5)).to(device)
    tri = resolve_backend("triton", p.device, torch.float32)
    eps = 0.3
    out, marg = tri.transport(p.X, p.Y, f, g, eps, V, None, None, "ieee")
    ref, rmarg = TorchBackend().transport(p.X, p.Y, f, g, eps, V, None, None, "ieee")
    assert out.shape == (B, n, p_width)
    assert _rel(out, ref) < 2e-5
    assert _rel(marg, rmarg) < 2e-5


@pytest.mark.parametrize("B,n,m,d", SHAPES[1:3])
def test_triton_apply_T_matches_torch(device, B, n, m, d):
    p = _problem(B, n, m, d, device)
    f, g = _pots(p, 6, 0.25)
    U = torch.randn(B, n, 7, generator=torch.Generator().manual_seed(7)).to(device)
    tri = resolve_backend("triton", p.device, torch.float32)
    out, marg = tri.transport(p.Y, p.X, g, f, 0.25, U, None, None, "ieee")
    ref, rmarg = TorchBackend().transport(p.Y, p.X, g, f, 0.25, U, None, None, "ieee")
    assert _rel(out, ref) < 2e-5
    assert _rel(marg, rmarg) < 2e-5


@pytest.mark.parametrize("B,n,m,d,r,p_width", [(2, 33, 19, 3, 4, 3), (1, 29, 41, 17, 40, 33)])
def test_triton_hadamard_matches_torch(device, B, n, m, d, r, p_width):
    p = _problem(B, n, m, d, device)
    f, g = _pots(p, 8, 0.4)
    gen = torch.Generator().manual_seed(9)
    A = torch.randn(B, n, r, generator=gen).to(device)
    Bw = torch.randn(B, m, r, generator=gen).to(device)
    V = torch.randn(B, m, p_width, generator=gen).to(device)
    tri = resolve_backend("triton", p.device, torch.float32)
    out, _ = tri.transport(p.X, p.Y, f, g, 0.4, V, A, Bw, "ieee")
    ref, _ = TorchBackend().transport(p.X, p.Y, f, g, 0.4, V, A, Bw, "ieee")
    assert _rel(out, ref) < 1e-4


@pytest.mark.parametrize("B,n,m,d", SHAPES)
def test_triton_gradient_matches_torch(device, B, n, m, d):
    p = _problem(B, n, m, d, device, zero_weight=(d == 17))
    f, g = _pots(p, 10)
    tri = resolve_backend("triton", p.device, torch.float32)
    for rows, cols, rp, cp in ((p.X, p.Y, f, g), (p.Y, p.X, g, f)):
        grad, marg = tri.transport_grad(rows, cols, rp, cp, 0.3, "ieee")
        ref, rmarg = TorchBackend().transport_grad(rows, cols, rp, cp, 0.3, "ieee")
        assert grad.shape == rows.x.shape
        assert _rel(grad, ref) < 1e-4
        assert _rel(marg, rmarg) < 2e-5


def test_triton_marginals_only(device):
    p = _problem(2, 45, 29, 3, device)
    f, g = _pots(p, 11)
    tri = resolve_backend("triton", p.device, torch.float32)
    out, marg = tri.transport(p.X, p.Y, f, g, 0.3, None, None, None, "ieee")
    assert out is None
    _, ref = TorchBackend().transport(p.X, p.Y, f, g, 0.3, None, None, None, "ieee")
    assert _rel(marg, ref) < 2e-5


# ----- split column sweep (partials + merge kernel) and float16 grid operands -----


def _spy_combine(monkeypatch):
    """Counts launches of the merge kernel (the split path) without changing them."""
    from flashsinkhorn.backends.triton import transport as T

    calls, kernel = [], T._apply_combine_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

        def warmup(self, *args, **kwargs):  # the first launch's parallel compile (CUDA)
            return kernel.warmup(*args, **kwargs)

    monkeypatch.setattr(T, "_apply_combine_kernel", Spy())
    return calls


def _merges(d, p_width, r, n_cols, grad=False):
    """1 if a forced split (> 1) of this launch must go through the merge kernel, else 0."""
    from flashsinkhorn.backends.triton.configs import transport_config

    cfg = transport_config(d, p_width, r)
    wide = (cfg.d_tiles if grad else cfg.p_tiles) > 1  # the wide path is never split
    return int(not wide and n_cols > cfg.block_n)


def _spy_split_sweeps(monkeypatch):
    """Counts sweep launches split into several column chunks (the in-place merge path)."""
    from flashsinkhorn.backends.triton import transport as T

    calls, kernel = [], T._apply_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            if grid[2] > 1:
                calls.append(grid)
            return kernel[grid]

        def warmup(self, *args, **kwargs):
            return kernel.warmup(*args, **kwargs)

    monkeypatch.setattr(T, "_apply_fwd_kernel", Spy())
    return calls


def _force_split(monkeypatch, split, merge):
    """Forces the split count; returns the list of merges made: combine launches, or with the
    in-place merge the split sweeps (which must then launch no combine kernel)."""
    monkeypatch.setattr(TUNING, "transport_split", split)
    monkeypatch.setattr(TUNING, "inplace_merge", merge)
    combines = _spy_combine(monkeypatch)
    if not merge:
        return combines
    sweeps = _spy_split_sweeps(monkeypatch)

    class Merges(list):
        def __len__(self):
            assert not combines, "the in-place merge launched a combine kernel"
            return len(sweeps)

    return Merges()


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("split", [2, 3, 7])
@pytest.mark.parametrize(
    "B,n,m,d,p_width,zw",
    [(1, 37, 101, 3, 1, "tail"), (2, 21, 70, 17, 5, True), (1, 45, 83, 5, 40, False)],
)
def test_triton_split_sweep_matches_torch(
    device, monkeypatch, split, B, n, m, d, p_width, zw, merge
):
    calls = _force_split(monkeypatch, split, merge)
    p = _problem(B, n, m, d, device, zero_weight=zw, seed=split)
    f, g = _pots(p, 14)
    gen = torch.Generator().manual_seed(15)
    V = torch.randn(B, m, p_width, generator=gen).to(device)
    U = torch.randn(B, n, p_width, generator=gen).to(device)
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    out, marg = tri.transport(p.X, p.Y, f, g, 0.3, V, None, None, "ieee")
    ref, rmarg = tb.transport(p.X, p.Y, f, g, 0.3, V, None, None, "ieee")
    assert _rel(out, ref) < 2e-5 and _rel(marg, rmarg) < 2e-5
    outT, margT = tri.transport(p.Y, p.X, g, f, 0.3, U, None, None, "ieee")
    refT, rmargT = tb.transport(p.Y, p.X, g, f, 0.3, U, None, None, "ieee")
    assert _rel(outT, refT) < 2e-5 and _rel(margT, rmargT) < 2e-5
    # Wide V (P_TILES > 1, e.g. 40 > the interpreter's 32) is never split; a side of one column
    # tile cannot be.
    assert len(calls) == _merges(d, p_width, 0, m) + _merges(d, p_width, 0, n)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("r,p_width", [(4, 3), (40, 1)])
def test_triton_split_hadamard_and_grad(device, monkeypatch, r, p_width, merge):
    calls = _force_split(monkeypatch, 3, merge)
    B, n, m, d = 2, 37, 75, 3 if r == 4 else 70
    p = _problem(B, n, m, d, device, zero_weight=True)
    f, g = _pots(p, 16, 0.4)
    gen = torch.Generator().manual_seed(17)
    A = torch.randn(B, n, r, generator=gen).to(device)
    Bw = torch.randn(B, m, r, generator=gen).to(device)
    V = torch.randn(B, m, p_width, generator=gen).to(device)
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    out, marg = tri.transport(p.X, p.Y, f, g, 0.4, V, A, Bw, "ieee")
    ref, rmarg = tb.transport(p.X, p.Y, f, g, 0.4, V, A, Bw, "ieee")
    assert _rel(out, ref) < 1e-4 and _rel(marg, rmarg) < 2e-5
    for rows, cols, rp, cp in ((p.X, p.Y, f, g), (p.Y, p.X, g, f)):
        grad, gm = tri.transport_grad(rows, cols, rp, cp, 0.4, "ieee")
        gref, gmref = tb.transport_grad(rows, cols, rp, cp, 0.4, "ieee")
        assert _rel(grad, gref) < 1e-4 and _rel(gm, gmref) < 2e-5
    # d = 70 > BLOCK_D (64 under the interpreter): the gradient's value tiles are wide.
    grads = _merges(d, d, 0, m, grad=True) + _merges(d, d, 0, n, grad=True)
    assert len(calls) == _merges(d, p_width, r, m) + grads


@pytest.mark.parametrize("cost,labels", [("euclidean", False), ("sqeuclidean", "on-chip"),
                                         ("euclidean", "global")])  # fmt: skip
@pytest.mark.parametrize("merge", [False, True])
def test_triton_split_costs_match_torch(device, monkeypatch, cost, labels, merge):
    monkeypatch.setattr(TUNING, "global_labels", labels == "global")
    calls = _force_split(monkeypatch, 4, merge)
    B, n, m, d = 2, 45, 97, 3
    gen = torch.Generator().manual_seed(18)
    lab = None
    if labels:
        lx, ly = (
            torch.randint(0, 5, (B, n), generator=gen),
            torch.randint(0, 5, (B, m), generator=gen),
        )
        lab = (lx.to(device), ly.to(device), (0.7 * torch.rand(5, 5, generator=gen)).to(device))
    p = _problem(B, n, m, d, device, zero_weight=True, cost=cost, labels=lab)
    f = (torch.randn(B, n, generator=gen) * 0.3).to(device)
    g = (torch.randn(B, m, generator=gen) * 0.3).to(device)
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    for p_width in (1, 5):
        V = torch.randn(B, m, p_width, generator=gen).to(device)
        out, marg = tri.transport(p.X, p.Y, f, g, 0.4, V, None, None, "ieee")
        ref, rmarg = tb.transport(p.X, p.Y, f, g, 0.4, V, None, None, "ieee")
        assert _rel(out, ref) < 2e-5 and _rel(marg, rmarg) < 2e-5
    for rows, cols, rp, cp in ((p.X, p.Y, f, g), (p.Y, p.X, g, f)):
        grad, gm = tri.transport_grad(rows, cols, rp, cp, 0.4, "ieee")
        gref, gmref = tb.transport_grad(rows, cols, rp, cp, 0.4, "ieee")
        assert _rel(grad, gref) < 2e-5 and _rel(gm, gmref) < 2e-5
    want = _merges(d, 1, 0, m) + _merges(d, 5, 0, m)
    assert len(calls) == want + _merges(d, d, 0, m, True) + _merges(d, d, 0, n, True)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_split_half_points(device, monkeypatch, dtype, merge):
    calls = _force_split(monkeypatch, 3, merge)
    B, n, m, d = 1, 41, 99, 3
    g = torch.Generator().manual_seed(21)
    x = torch.rand(B, n, d, generator=g).to(device, dtype)
    y = (torch.rand(B, m, d, generator=g) * 1.3 + 0.2).to(device, dtype)
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="ieee")
    assert p.X.x.dtype == dtype
    f, gp = _pots(p, 22)
    V = torch.randn(B, m, 1, generator=g).to(device)
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    out, marg = tri.transport(p.X, p.Y, f, gp, 0.3, V, None, None, "ieee")
    ref, rmarg = tb.transport(p.X, p.Y, f, gp, 0.3, V, None, None, "ieee")
    assert _rel(out, ref) < 2e-5 and _rel(marg, rmarg) < 2e-5
    grad, gm = tri.transport_grad(p.X, p.Y, f, gp, 0.3, "ieee")
    gref, gmref = tb.transport_grad(p.X, p.Y, f, gp, 0.3, "ieee")
    assert _rel(grad, gref) < 1e-4 and _rel(gm, gmref) < 2e-5
    assert len(calls) == _merges(d, 1, 0, m) + _merges(d, d, 0, m, grad=True)


@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("fp16_grad", [False, True])
def test_triton_tf32_reads_the_float16_grid_points(device, monkeypatch, cost, split, fp16_grad):
    # With precision "tf32" the kernel must read the float16 copies xk (scaled by kscale), never
    # x: poisoning x with NaN proves it, and the gradient's point tiles (xk · kscale == x
    # exactly) must still give the gradient of the unpoisoned points.
    monkeypatch.setattr(TUNING, "transport_split", split)
    monkeypatch.setattr(TUNING, "fp16_grad", fp16_grad)
    B, n, m, d, eps = 2, 35, 67, 3, 2.0
    # Spread points: kscale = 8, so a missing dot_scale or point scale cannot go unnoticed.
    p = _problem(B, n, m, d, device, zero_weight=True, precision="tf32", cost=cost, spread=5.0)
    assert p.X.xk is not None and p.X.xk.dtype == torch.float16 and p.X.kscale == 8.0
    assert torch.equal(p.X.xk.float() * p.X.kscale, p.X.x)
    f, g = _pots(p, 19, eps)
    gen = torch.Generator().manual_seed(20)
    X = replace(p.X, x=torch.full_like(p.X.x, float("nan")))
    Y = replace(p.Y, x=torch.full_like(p.Y.x, float("nan")))
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    # Interpreter: every dot is exact-product fp32. CUDA: the value dots round to TF32, and the
    # score sums run in another order (scores up to ~35 here).
    exact = 2e-5 if device.type == "cpu" else 1e-4
    tol = exact if device.type == "cpu" else 3e-3
    # The float16 gradient dot rounds P to 10 bits on every device, as the TF32 dot does on
    # CUDA (its error bound is tested in test_fp16_gradient_dot_error_bound).
    gtol = (
        3e-3
        if fp16_grad and cost == "sqeuclidean"
        else max(tol, 1e-4 if cost == "euclidean" else exact)
    )
    for p_width in (1, 5):
        V = torch.randn(B, m, p_width, generator=gen).to(device)
        out, marg = tri.transport(X, Y, f, g, eps, V, None, None, "tf32")
        ref, rmarg = tb.transport(p.X, p.Y, f, g, eps, V, None, None, "ieee")
        # P·V through float16 (TUNING.pv16) rounds P to 10 bits on every device, as the TF32
        # dot does on CUDA (its bound: test_fp16_values_dot_error_bound)
        vtol = 3e-3 if TUNING.pv16 else tol
        assert _rel(out, ref) < (exact if p_width == 1 else vtol) and _rel(marg, rmarg) < exact
    for rows, cols, rows0, cols0, rp, cp in ((X, Y, p.X, p.Y, f, g), (Y, X, p.Y, p.X, g, f)):
        grad, gm = tri.transport_grad(rows, cols, rp, cp, eps, "tf32")
        gref, gmref = tb.transport_grad(rows0, cols0, rp, cp, eps, "ieee")
        assert _rel(grad, gref) < gtol
        assert _rel(gm, gmref) < exact


def _spy_sweep_flags(monkeypatch):
    """Records the EVEN_D / EVEN_P flags of every sweep launch without changing the launch."""
    from flashsinkhorn.backends.triton import transport as T

    flags, kernel = [], T._apply_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                flags.append((kw["EVEN_D"], kw["EVEN_P"]))
                return kernel[grid](*args, **kw)

            return run

        def warmup(self, *args, **kwargs):
            return kernel.warmup(*args, **kwargs)

    monkeypatch.setattr(T, "_apply_fwd_kernel", Spy())
    return flags


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("d", [16, 64])
def test_triton_whole_tiles_match_torch(device, monkeypatch, precision, split, d):
    # d and p exactly one tile wide (p = 32 under the interpreter's tiles, 64 on CUDA): the
    # kernel drops the feature and value masks and reads V with compile-time offsets.
    # Batched, odd n and m, spread points (kscale = 8), split or not.
    monkeypatch.setattr(TUNING, "transport_split", split)
    flags = _spy_sweep_flags(monkeypatch)
    B, n, m, eps = 2, 37, 45, 2.0
    p_width = 32 if device.type == "cpu" else 64
    p = _problem(B, n, m, d, device, zero_weight=True, precision=precision, spread=5.0)
    f, g = _pots(p, 23, eps)
    gen = torch.Generator().manual_seed(24)
    V = torch.randn(B, m, p_width, generator=gen).to(device)
    tri, tb = resolve_backend("triton", p.device, torch.float32), TorchBackend()
    # Interpreter: exact-product fp32 dots. CUDA: "tf32" rounds P and V to TF32; with
    # TUNING.pv16 P is rounded to float16 on every device.
    tol = 3e-3 if precision == "tf32" and (device.type == "cuda" or TUNING.pv16) else 2e-5
    out, marg = tri.transport(p.X, p.Y, f, g, eps, V, None, None, precision)
    ref, rmarg = tb.transport(p.X, p.Y, f, g, eps, V, None, None, "ieee")
    assert _rel(out, ref) < tol and _rel(marg, rmarg) < 2e-5
    assert flags[-1] == (True, True)
    for rows, cols, rp, cp in ((p.X, p.Y, f, g), (p.Y, p.X, g, f)):
        grad, gm = tri.transport_grad(rows, cols, rp, cp, eps, precision)
        gref, gmref = tb.transport_grad(rows, cols, rp, cp, eps, "ieee")
        assert _rel(grad, gref) < (3e-3 if precision == "tf32" else 1e-4)
        assert _rel(gm, gmref) < 2e-5
        assert flags[-1] == (True, True)


def _fp16_bound_case(device, monkeypatch, split, flag):
    """The problem of the float16 error-bound tests: ``TUNING.<flag>`` on, the transport
    split set to ``split``; returns (problem, f, g, eps, dense float64 plan (B, n, m))."""
    monkeypatch.setattr(TUNING, "transport_split", split)
    monkeypatch.setattr(TUNING, flag, True)
    eps = 0.5
    p = _problem(2, 45, 77, 17, device, precision="tf32", spread=3.0)
    f, g = _pots(p, 4, eps)
    return p, f, g, eps, _dense_plan(p, f, g, eps)  # the plan on the grid points


@pytest.mark.parametrize("split", [None, 2])
def test_fp16_gradient_dot_error_bound(device, monkeypatch, split):
    # The envelope gradient at "tf32" forms P y as a float16 dot: each P_ij is rounded to 10
    # bits relative to the running row maximum (times 2^15), so |Δ(P y)_ik| <= 2^-11 Σ_j P_ij
    # |y_jk| up to the fp32 sums. Against float64 that bound must hold element by element,
    # and a wrong scale (2^15 left in, kscale forgotten) breaks it by orders of magnitude. The
    # row marginal is the fp32 sum, untouched by the rounding.
    p, f, g, eps, P = _fp16_bound_case(device, monkeypatch, split, "fp16_grad")
    x, y = p.X.x.double().cpu(), p.Y.x.double().cpu()
    marg = P.sum(2)
    ref = 2.0 * (marg[..., None] * x - P @ y)
    bound = 2.0 * 2.0**-11 * (P @ y.abs()) + 1e-6 * float(ref.abs().max())
    tri = resolve_backend("triton", p.device, torch.float32)
    grad, gm = tri.transport_grad(p.X, p.Y, f, g, eps, "tf32")
    err = (grad.double().cpu() - ref).abs()
    assert float((err / bound).max()) <= 1.0
    # not trivially loose: the rounding shows, at a fraction of the bound
    assert float(err.max()) > 0.0
    assert _rel(gm, marg) < 2e-5


@pytest.mark.parametrize("split", [None, 2])
def test_fp16_values_dot_error_bound(device, monkeypatch, split):
    # P·V at "tf32" through float16 (TUNING.pv16): each P_ij rounded to 10 bits relative to
    # the running row maximum, V as hi + lo float16 parts of V·s with s a power of two per
    # column (about 22 bits of entries near the column's largest, an absolute 2^-24 of it below
    # float16's normal range). So |Δ(P V)_ik| <= 2^-11 Σ_j P_ij |V_jk| + 2^-20 max_j |V_jk|
    # Σ_j P_ij, up to the fp32 sums. Columns of very different magnitudes (1e-30 to 1e30) and
    # one all zero check the scales; a wrong one breaks the bound by orders of magnitude.
    p, f, g, eps, P = _fp16_bound_case(device, monkeypatch, split, "pv16")
    B, m = P.shape[0], P.shape[2]
    gen = torch.Generator().manual_seed(31)
    # 16 columns: whole value tiles, the shape that takes the float16 dots
    mags = torch.tensor([1.0, 1e-30, 1e30, 0.0, 3e4, 1e-3, 7.0, 0.5] * 2)
    V = torch.randn(B, m, mags.numel(), generator=gen) * mags
    V[:, :5, 0] *= 1e-6  # a wide range inside one column
    ref = P @ V.double()
    colmax = V.double().abs().amax(1, keepdim=True)
    bound = 2.0**-11 * (P @ V.double().abs()) + 2.0**-20 * P.sum(2, keepdim=True) * colmax
    bound = bound + 1e-6 * ref.abs().amax(1, keepdim=True)
    tri = resolve_backend("triton", p.device, torch.float32)
    taken = []
    real = triton_transport.split_values
    monkeypatch.setattr(triton_transport, "split_values", lambda v: taken.append(1) or real(v))
    out, marg = tri.transport(p.X, p.Y, f, g, eps, V.to(device), None, None, "tf32")
    assert taken  # the float16 value dots ran
    err = (out.double().cpu() - ref).abs()
    assert float((err / bound.clamp_min(1e-300)).max()) <= 1.0
    assert float(err[..., 0].max()) > 0.0  # the rounding shows
    assert torch.equal(out[..., 3], torch.zeros_like(out[..., 3]))
    assert _rel(marg, P.sum(2)) < 2e-5
    # A part of a value tile (p = 6 < 16) keeps the float32 value dot
    taken.clear()
    out6, _ = tri.transport(p.X, p.Y, f, g, eps, V[..., :6].contiguous().to(device), None, None,
                            "tf32")  # fmt: skip
    assert not taken
    assert torch.equal(out6[..., 3], torch.zeros_like(out6[..., 3]))
    for k in (0, 2, 4):
        assert _rel(out6[..., k], ref[..., k]) < 3e-3


# ----- SinkhornResult methods -----


def _solved(batched=False, shift=0.0, backend="torch", dtype=torch.float64):
    g = torch.Generator().manual_seed(12)
    sh = (2,) if batched else ()
    x = torch.rand(*sh, 15, 2, generator=g, dtype=torch.float64) + shift
    y = torch.rand(*sh, 11, 2, generator=g, dtype=torch.float64) * 0.8 + 0.4 + shift
    x, y = x.to(dtype), y.to(dtype)
    return x, y, fs.sinkhorn(x, y, eps=0.05, tol=1e-9, backend=backend)


def test_result_apply_and_plan_agree():
    x, y, res = _solved(batched=True)
    P = res.plan()
    assert P.shape == (2, 15, 11)
    V = torch.randn(2, 11, 3, dtype=torch.float64)
    U = torch.randn(2, 15, dtype=torch.float64)
    torch.testing.assert_close(res.apply(V), P @ V, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(res.apply_T(U), (P.transpose(1, 2) @ U[..., None])[..., 0])
    ra, rb = res.marginals()
    torch.testing.assert_close(ra, P.sum(2))
    torch.testing.assert_close(rb, P.sum(1))


def test_result_unbatched_shapes_and_bad_values():
    x, y, res = _solved()
    assert res.apply(torch.ones(11, dtype=torch.float64)).shape == (15,)
    assert res.apply(torch.ones(11, 4, dtype=torch.float64)).shape == (15, 4)
    assert res.apply_T(torch.ones(15, 2, dtype=torch.float64)).shape == (11, 2)
    with pytest.raises(ValueError, match="V must have shape"):
        res.apply(torch.ones(15, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="U must have shape"):
        res.apply_T(torch.ones(11, dtype=torch.float64))
    with pytest.raises(TypeError, match="V must be"):
        res.apply([1.0] * 11)


def test_plan_refuses_above_limit():
    _, _, res = _solved()
    with pytest.raises(ValueError, match="max_elements"):
        res.plan(max_elements=100)


def test_barycentric_map_in_caller_coordinates():
    x, y, res = _solved()
    P = res.plan()
    ref = (P @ y) / P.sum(1, keepdim=True)
    torch.testing.assert_close(res.barycentric_map(), ref, rtol=1e-10, atol=1e-12)
    # Far from the origin: the map follows the clouds (P is translation invariant).
    shift = 1000.0
    _, _, res2 = _solved(shift=shift)
    torch.testing.assert_close(res2.barycentric_map(), ref + shift, rtol=1e-10, atol=1e-9)


def test_barycentric_map_triton_batched(device):
    g = torch.Generator().manual_seed(13)
    x = torch.rand(2, 15, 2, generator=g) + 50.0
    y = torch.rand(2, 11, 2, generator=g) * 0.8 + 50.4
    opts = dict(eps=0.2, n_iters=8, tol=None, precision="ieee")
    res = fs.sinkhorn(x.to(device), y.to(device), backend="triton", **opts)
    ref = fs.sinkhorn(x.double(), y.double(), backend="torch", **opts)
    T, Tref = res.barycentric_map(), ref.barycentric_map()
    assert T.shape == (2, 15, 2)
    assert float((T.double().cpu() - Tref).abs().max()) < 1e-4
