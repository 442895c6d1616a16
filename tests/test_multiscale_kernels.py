"""The multiscale path's block-sparse soft-min: the torch path against masked dense
float64 math, the Triton kernels (exact and shifted) under the interpreter against it."""

import math

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.multiscale import bounds, sparse_torch
from flashsinkhorn.multiscale.clustering import TILE, build_layout

from .multiscale_cases import DT, small_clouds, small_weights


def _dense_masked_lse(lx, ly, hc, eps, rows, cols, values=None):
    xr, xc = lx.x[0], ly.x[0]
    z = hc[0][None, :] - torch.cdist(xr, xc) ** 2 / eps
    mask = torch.zeros(lx.tiles, ly.tiles, dtype=torch.bool)
    mask[rows, cols] = True
    mask = mask.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)
    z = torch.where(mask, z, -math.inf)
    L = torch.logsumexp(z, 1)
    if values is None:
        return L, None
    return L, torch.softmax(z, 1).nan_to_num(0.0) @ values


def _pattern_case(n=300, m=260, eps=3e-3, seed=5, dtype=DT):
    x, y = small_clouds(n, m, d=2, seed=seed, dtype=dtype)
    a, b = small_weights(n, 1, dtype), small_weights(m, 2, dtype)
    lx, ly = build_layout(x[None], a[None], dtype), build_layout(y[None], b[None], dtype)
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(1, ly.N, generator=gen, dtype=dtype) * 0.01
    hc = g / eps + ly.logw
    # a random half of the tile pairs
    keep = torch.rand(lx.tiles, ly.tiles, generator=gen) < 0.5
    rows, cols = keep.nonzero(as_tuple=True)
    rowptr, cidx = bounds._csr(rows, cols, lx.tiles)
    return lx, ly, hc, eps, rows, cols, rowptr, cidx


def test_sparse_lse_matches_masked_dense():
    lx, ly, hc, eps, rows, cols, rowptr, cidx = _pattern_case()
    vals = ly.x[0] * 1.7 - 0.3
    L, S = sparse_torch.sparse_lse(lx.x[0], ly.x[0], hc[0], rowptr, cidx, eps, vals)
    Lr, Sr = _dense_masked_lse(lx, ly, hc, eps, rows, cols, vals)
    torch.testing.assert_close(L, Lr, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, Sr, rtol=1e-10, atol=1e-10)


def test_sparse_lse_chunks(monkeypatch):
    """Merging chunks of pairs (online LSE across chunks) changes nothing."""
    lx, ly, hc, eps, rows, cols, rowptr, cidx = _pattern_case(seed=6)
    L1, S1 = sparse_torch.sparse_lse(lx.x[0], ly.x[0], hc[0], rowptr, cidx, eps, ly.x[0])
    monkeypatch.setattr(sparse_torch, "SCORE_CHUNK", TILE * TILE * 3)
    L2, S2 = sparse_torch.sparse_lse(lx.x[0], ly.x[0], hc[0], rowptr, cidx, eps, ly.x[0])
    torch.testing.assert_close(L1, L2, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(S1, S2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bary", [False, True])
def test_triton_sparse_kernel_matches_torch(bary, device):
    """``_lse_sparse_fwd_kernel`` (interpreter on CPU) against the torch block-sparse LSE."""
    from flashsinkhorn.backends.triton.sparse import sparse_lse as tr_lse

    lx, ly, hc, eps, rows, cols, rowptr, cidx = _pattern_case(n=150, m=130, dtype=torch.float32)
    # a row tile with no visited tile gives −inf (and zero barycentre)
    L, S = sparse_torch.sparse_lse(lx.x[0], ly.x[0], hc[0], rowptr, cidx, eps,
                                   ly.x[0] if bary else None)  # fmt: skip
    dev = [t.to(device).contiguous() for t in (lx.x[0], ly.x[0], hc[0], rowptr, cidx)]
    Lt, St = tr_lse(*dev, eps, bary, TILE)
    Lt, St = Lt.cpu(), (None if St is None else St.cpu())
    fin = torch.isfinite(L)
    assert torch.equal(fin, torch.isfinite(Lt))
    torch.testing.assert_close(Lt[fin], L[fin], rtol=2e-5, atol=2e-4)
    if bary:
        torch.testing.assert_close(St[fin], S[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shift", [-1e31, 1e31])
def test_triton_sparse_kernel_far_scores(shift, device):
    """Scores far below (or above) zero, as tiny eps gives them (|cost/eps| up to about
    FLT_MAX/256 passes the float32 range checks), keep their rows alive next to massless
    columns (padding): the kernel equals the torch block-sparse LSE."""
    from flashsinkhorn.backends.triton.sparse import sparse_lse as tr_lse

    lx, ly, hc, eps, rows, cols, rowptr, cidx = _pattern_case(n=150, m=130, dtype=torch.float32)
    hc = hc[0] + shift
    assert torch.isinf(hc).any()  # massless columns are visited
    L, S = sparse_torch.sparse_lse(lx.x[0], ly.x[0], hc, rowptr, cidx, eps, ly.x[0])
    dev = [t.to(device).contiguous() for t in (lx.x[0], ly.x[0], hc, rowptr, cidx)]
    Lt, St = tr_lse(*dev, eps, True, TILE)
    Lt, St = Lt.cpu(), St.cpu()
    fin = torch.isfinite(L)
    assert fin.any()
    assert torch.equal(fin, torch.isfinite(Lt))
    torch.testing.assert_close(Lt[fin], L[fin], rtol=1e-6, atol=0)
    assert torch.isfinite(St).all()


def _shift_launch(dev, shift, eps):
    """The shift kernel alone: (L, flags per row tile)."""
    from flashsinkhorn.backends.triton import sparse

    xr, xc, hc, rowptr, cols = dev
    R = xr.shape[0] // TILE
    lse = torch.empty(xr.shape[0], device=xr.device)
    flag = torch.full((R,), -1, dtype=torch.int32, device=xr.device)
    sparse._lse_sparse_shift_kernel[(R,)](
        xr,
        xc.t().contiguous(),
        hc * sparse.LOG2E,
        rowptr,
        cols,
        shift * sparse.LOG2E,
        lse,
        flag,
        xc.shape[0],
        sparse.LOG2E / eps,
        TILE=TILE,
        SUM_MIN=sparse.SHIFT_SUM_MIN,
        SUM_MAX=sparse.SHIFT_SUM_MAX,
    )
    return lse.cpu(), flag.cpu()


@pytest.mark.parametrize("quality", ["exact", "off", "far"])
def test_triton_sparse_shift_kernel(quality, device):
    """``sparse_lse`` with a shift (the previous iterate's LSE) equals the torch block-sparse
    LSE however far the shift is from the result: the shift kernel flags the row tiles whose
    shifted sums left their range and the guarded exact kernel recomputes them; with a good
    shift only the rows without any mass are flagged."""
    from flashsinkhorn.backends.triton.sparse import sparse_lse as tr_lse

    lx, ly, hc, eps, rows, cols, rowptr, cidx = _pattern_case(n=150, m=130, dtype=torch.float32)
    L, _ = sparse_torch.sparse_lse(lx.x[0], ly.x[0], hc[0], rowptr, cidx, eps, None)
    fin = torch.isfinite(L)
    gen = torch.Generator().manual_seed(3)
    shift = torch.where(fin, L, 0.0)
    if quality == "off":
        shift = shift + (torch.rand(L.shape, generator=gen) - 0.5) * 60.0
    elif quality == "far":
        shift = shift.clone()
        shift[5], shift[70], shift[71] = shift[5] + 1000.0, shift[70] - 1000.0, math.nan
        shift[140] = math.inf
    dev = [t.to(device).contiguous() for t in (lx.x[0], ly.x[0], hc[0], rowptr, cidx)]
    Lt, _ = tr_lse(*dev, eps, False, TILE, shift=shift.to(device))
    Lt = Lt.cpu()
    assert torch.equal(fin, torch.isfinite(Lt))
    torch.testing.assert_close(Lt[fin], L[fin], rtol=2e-5, atol=2e-4)
    _, flags = _shift_launch(dev, shift.to(device), eps)
    # a row without mass never passes the range test; a tile without visited tiles is exact
    dead = (~fin).reshape(-1, TILE).any(1) & (rowptr[1:] > rowptr[:-1])
    if quality == "exact":
        assert torch.equal(flags.bool(), dead)
    elif quality == "far":
        expect = dead.clone()
        expect[[0, 1, 2]] = True  # tiles of rows 5, 70/71, 140
        assert torch.equal(flags.bool(), expect)


def test_triton_multiscale_tiny_eps_matches_torch(device):
    """A float32 solve at an eps where the scores reach 1e31 (admitted by the range checks
    without a tolerance) gives the torch block-sparse path's potentials through the kernel."""
    x, y = small_clouds(150, 130, d=3, seed=16, dtype=torch.float32)
    x, y = x.to(device), y.to(device)
    kw = dict(eps=1e-31, path="multiscale", tol=None, n_iters=3)
    ref = fs.sinkhorn(x, y, backend="torch", **kw)
    got = fs.sinkhorn(x, y, backend="triton", **kw)
    assert torch.isfinite(got.f).all() and torch.isfinite(got.g).all()
    torch.testing.assert_close(got.f.cpu(), ref.f.cpu(), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.value.cpu(), ref.value.cpu(), rtol=1e-6, atol=0)
