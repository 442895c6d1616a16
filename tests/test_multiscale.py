"""The multiscale path: clustering, truncation bounds, the block-sparse soft-min, solves.

Small float64 clouds on the torch backend (the oracle); the Triton kernel under the
interpreter against the torch block-sparse soft-min.
"""

import itertools
import math

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.multiscale import backend as ms_backend
from flashsinkhorn.multiscale import bounds, sparse_torch
from flashsinkhorn.multiscale import solver as ms_solver
from flashsinkhorn.multiscale.bounds import build_pattern, pair_log_bound, tile_stats
from flashsinkhorn.multiscale.clustering import SUPER, TILE, build_layout, cells
from flashsinkhorn.multiscale.solver import FINE_CHECK_EVERY

from .multiscale_cases import torch_and_kernel_paths

DT = torch.float64


def _clouds(n, m, d=2, B=None, seed=0, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    shape_x = (n, d) if B is None else (B, n, d)
    shape_y = (m, d) if B is None else (B, m, d)
    x = torch.rand(shape_x, generator=g, dtype=dtype)
    # a curved target: points on a noisy arc
    t = torch.rand(shape_y[:-1], generator=g, dtype=dtype) * 3.0
    z = 0.3 * torch.rand(t.shape, generator=g, dtype=dtype)
    y = torch.stack([torch.cos(t), torch.sin(t)] + [z] * (d - 2), -1)
    y = 0.5 + 0.4 * y[..., :d] + 0.02 * torch.randn(shape_y, generator=g, dtype=dtype)
    return x, y


def _weights(n, seed, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g, dtype=dtype) + 0.2
    return w / w.sum()


def _dense_log_plan(x, y, a, b, f, g, eps):
    """log P_ij (−inf where a weight is zero: padding)."""
    C = torch.cdist(x, y) ** 2
    return a.log()[:, None] + b.log()[None, :] + (f[:, None] + g[None, :] - C) / eps


# ----- clustering -----


@pytest.mark.parametrize("d", [1, 2, 3])
def test_layout_permutation_and_padding(d):
    x, _ = _clouds(300, 10, d=d, B=2)
    w = torch.rand(2, 300, dtype=DT)
    lay = build_layout(x, w, DT)
    assert lay.N % (TILE * SUPER) == 0 and lay.N >= 300
    # perm and inv are inverse permutations, and sort/unsort round-trip
    ar = torch.arange(300).expand(2, 300)
    assert torch.equal(lay.perm.gather(1, lay.inv), ar)
    assert torch.equal(lay.unsort(lay.sort(x)), x)
    assert torch.equal(lay.unsort(lay.x[..., :d]), x)
    assert torch.equal(lay.unsort(lay.w), w)
    assert int(lay.real.sum()) == 2 * 300
    assert torch.all(lay.w[~lay.real] == 0) and torch.all(lay.logw[~lay.real] == -math.inf)
    # padding repeats a real point of its own tile: tile boxes are those of the real points
    tiles = lay.x.reshape(2, -1, TILE, 3)
    real = lay.real.reshape(2, -1, TILE, 1)
    inf = torch.tensor(math.inf, dtype=DT)
    has = real.any(2)
    torch.testing.assert_close(
        torch.where(has, tiles.amax(2), 0),
        torch.where(has, torch.where(real, tiles, -inf).amax(2), 0),
    )
    # the sorted slots keep the Morton order, and codes are sorted
    assert torch.all(lay.slot[:, 1:] > lay.slot[:, :-1])
    assert torch.all(lay.codes[:, 1:] >= lay.codes[:, :-1])


def test_tiles_break_at_jumps():
    """Two far-apart blobs: no tile holds points of both."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(1000, 2, generator=g, dtype=DT),
                   10.0 + torch.rand(1000, 2, generator=g, dtype=DT)])  # fmt: skip
    lay = build_layout(x[None], torch.ones(1, 2000, dtype=DT), DT)
    side = (lay.x[0, :, 0] > 5).reshape(-1, TILE)
    real = lay.real[0].reshape(-1, TILE)
    mixed = [bool(s[r].any() and (~s[r]).any()) for s, r in zip(side, real, strict=True)]
    assert not any(mixed)


def test_tiles_are_local():
    """Tiles of the Morton order are much smaller than tiles of a random order."""
    x, _ = _clouds(4096, 10, d=2, seed=3)
    lay = build_layout(x[None], torch.ones(1, 4096, dtype=DT), DT)
    ext = lay.x[0].reshape(-1, TILE, 3).amax(1) - lay.x[0].reshape(-1, TILE, 3).amin(1)
    rnd = x[torch.randperm(4096)].reshape(-1, TILE, 2)
    ext_r = rnd.amax(1) - rnd.amin(1)
    assert ext[:, :2].norm(dim=-1).mean() < 0.35 * ext_r.norm(dim=-1).mean()


def test_cells_centroids_and_weights():
    x, _ = _clouds(500, 10, d=3, B=2, seed=1)
    w = torch.rand(2, 500, dtype=DT)
    lay = build_layout(x, w, DT)
    cl = cells(lay, x, 40)
    assert int(cl.count.max()) <= 40 and cl.x.shape[1] == int(cl.count.max())
    torch.testing.assert_close(cl.w.sum(1), w.sum(1))
    for b in range(2):
        xs, ws = lay.x[b, lay.slot[b]], lay.w[b, lay.slot[b]]
        for k in range(int(cl.count[b])):
            sel = cl.of_point[b] == k
            assert sel.any()
            ref = (ws[sel, None] * xs[sel]).sum(0) / ws[sel].sum()
            torch.testing.assert_close(cl.x[b, k], ref)
        # each cell's points lie in one grid cube of edge cl.side
        for k in range(int(cl.count[b])):
            sel = cl.of_point[b] == k
            assert float((xs[sel].amax(0) - xs[sel].amin(0)).max()) <= cl.side * (1 + 1e-12)


# ----- bounds -----


def _potentials(x, y, a, b, eps, noise=0.0, seed=0):
    res = fs.sinkhorn(x, y, a, b, eps=eps, backend="torch", tol=1e-9, n_iters=5000)
    g = torch.Generator().manual_seed(seed)
    f = res.f + noise * eps * torch.randn(res.f.shape, generator=g, dtype=DT)
    gg = res.g + noise * eps * torch.randn(res.g.shape, generator=g, dtype=DT)
    return f, gg


@pytest.mark.parametrize("noise", [0.0, 3.0])
def test_tile_bound_dominates_block_mass(noise):
    """No tile pair carries more plan mass than its bound, for converged and perturbed
    potentials."""
    n, m, eps = 700, 600, 2e-3
    x, y = _clouds(n, m, d=2, seed=2)
    a, b = _weights(n, 1), _weights(m, 2)
    f, g = _potentials(x, y, a, b, eps, noise)
    lx, ly = build_layout(x[None], a[None], DT), build_layout(y[None], b[None], DT)
    fs_, gs_ = lx.sort(f[None]), ly.sort(g[None])
    for size in (TILE, TILE * SUPER):
        R, C = tile_stats(lx, fs_, size), tile_stats(ly, gs_, size)
        Tr, Tc = lx.N // size, ly.N // size
        bb, i, j = bounds._AllPairs(1, Tr, Tc, "cpu")(0, Tr * Tc)
        lb = pair_log_bound(R, C, bb, i, j, eps).reshape(Tr, Tc)
        logP = _dense_log_plan(lx.x[0], ly.x[0], lx.w[0], ly.w[0], fs_[0], gs_[0], eps)
        mass = torch.logsumexp(logP.reshape(Tr, size, Tc, size), dim=(1, 3))
        live = torch.isfinite(mass)
        assert torch.all(mass[live] <= lb[live] + 1e-9), float((mass - lb)[live].max())
        assert torch.all(torch.isfinite(lb[live]))


def _outside_mass(lx, ly, pat, f, g, eps, n, m, d=2):
    """Dense mass of the plan (f, g) (sorted) outside the pattern's tile pairs, per problem."""
    out = []
    for bi in range(lx.B):
        logP = _dense_log_plan(lx.x[bi], ly.x[bi], lx.w[bi], ly.w[bi], f[bi], g[bi], eps)
        blocks = torch.logsumexp(logP.reshape(lx.tiles, TILE, ly.tiles, TILE), dim=(1, 3))
        kept = torch.zeros_like(blocks, dtype=torch.bool)
        rows, cols = pat.rows - bi * lx.tiles, pat.cols - bi * ly.tiles
        sel = (rows >= 0) & (rows < lx.tiles)
        kept[rows[sel], cols[sel]] = True
        out.append(torch.exp(blocks[~kept]).sum())
    return torch.stack(out)


@pytest.mark.parametrize("n,m", [(700, 600), (1500, 1300)])
def test_pattern_skips_at_most_its_bound(n, m):
    """The true mass outside the pattern is at most the recorded skipped bound, which is
    within the budget; after the potentials move, within ``skipped_bound``."""
    eps = 2e-3
    x, y = _clouds(n, m, d=2, seed=4)
    a, b = _weights(n, 3), _weights(m, 4)
    f, g = _potentials(x, y, a, b, eps)
    lx, ly = build_layout(x[None], a[None], DT), build_layout(y[None], b[None], DT)
    fs_, gs_ = lx.sort(f[None]), ly.sort(g[None])
    budget = 1e-4
    pat = build_pattern(lx, ly, fs_, gs_, eps, budget)
    total = sum(pat.skipped)
    assert float(total) <= budget
    assert pat.pairs < lx.tiles * ly.tiles  # it does skip
    out = _outside_mass(lx, ly, pat, fs_, gs_, eps, n, m)
    assert torch.all(out <= total * (1 + 1e-9))
    # moved potentials (a gauge shift and a perturbation): the drift bound still holds
    gen = torch.Generator().manual_seed(0)
    f2 = fs_ + 0.7 + 0.5 * eps * torch.randn(fs_.shape, generator=gen, dtype=DT)
    g2 = gs_ - 0.7 + 0.5 * eps * torch.randn(gs_.shape, generator=gen, dtype=DT)
    out2 = _outside_mass(lx, ly, pat, f2, g2, eps, n, m)
    assert torch.all(out2 <= pat.skipped_bound(lx, ly, f2, g2, eps) * (1 + 1e-9))
    assert float(out2.max()) > 0
    # potentials moved by 1000 eps: an infinite bound where something was skipped, never NaN
    far = pat.skipped_bound(lx, ly, fs_ + 1e3 * eps, gs_, eps)
    assert not torch.isnan(far).any() and torch.all(far >= out)
    empty = build_pattern(lx, ly, fs_, gs_, eps, 0.0)
    assert float(sum(empty.skipped)) == 0.0
    assert torch.all(empty.skipped_bound(lx, ly, fs_ + 1e3 * eps, gs_, eps) == 0)


def test_batched_pattern_equals_per_problem_patterns():
    """A batch's pattern is the union of its problems' patterns (no problem's bounds leak
    into another's threshold)."""
    B, n, m, eps = 2, 1500, 1300, 2e-3
    x, y = _clouds(n, m, d=2, B=B, seed=17)
    a = torch.full((B, n), 1.0 / n, dtype=DT)
    b = torch.full((B, m), 1.0 / m, dtype=DT)
    res = fs.sinkhorn(x, y, eps=eps, backend="torch", tol=1e-6, n_iters=5000)
    lx, ly = build_layout(x, a, DT), build_layout(y, b, DT)
    pat = build_pattern(lx, ly, lx.sort(res.f), ly.sort(res.g), eps, 1e-4)
    for k in range(B):
        l1, m1 = (
            build_layout(x[k : k + 1], a[k : k + 1], DT),
            build_layout(y[k : k + 1], b[k : k + 1], DT),
        )
        one = build_pattern(l1, m1, l1.sort(res.f[k : k + 1]), m1.sort(res.g[k : k + 1]), eps, 1e-4)
        mine = (pat.rows // lx.tiles) == k
        assert int(mine.sum()) == one.pairs < lx.tiles * ly.tiles
        assert torch.equal(pat.rows[mine] - k * lx.tiles, one.rows)
        assert torch.equal(pat.cols[mine] - k * ly.tiles, one.cols)
        for lv in range(len(pat.skipped)):
            torch.testing.assert_close(pat.skipped[lv][k], one.skipped[lv][0])


def _map_case(n=10000, B=2, eps=3e-3, seed=8):
    """Clouds y ≈ A x + c (an independent sample of the image of x) with the exact potentials
    of the quadratic Brenier map x -> A x + c, per problem: a sharp plan with no solve."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, 2, generator=gen, dtype=DT)
    A = torch.eye(2, dtype=DT) + 0.3 * torch.randn(B, 2, 2, generator=gen, dtype=DT)
    A = A @ A.transpose(1, 2)  # symmetric positive definite
    c = torch.randn(B, 1, 2, generator=gen, dtype=DT)
    y = torch.rand(B, n, 2, generator=gen, dtype=DT) @ A + c
    phi = 0.5 * ((x @ A) * x).sum(-1) + (x * c).sum(-1)
    phis = 0.5 * (((y - c) @ torch.linalg.inv(A)) * (y - c)).sum(-1)
    f, g = (x * x).sum(-1) - 2 * phi, (y * y).sum(-1) - 2 * phis
    # a corner of zero-weight points: tiles without mass, which still keep a pair
    w = torch.where((x < 0.25).all(-1), 0.0, torch.full((B, n), 1.0 / n, dtype=DT))
    lx, ly = build_layout(x, w, DT), build_layout(y, torch.full_like(w, 1.0 / n), DT)
    # a constant shift: plan mass of order one
    return lx, ly, lx.sort(f) + eps * math.log(n / 50.0), ly.sort(g), eps


def _levels(lx, ly, f, g, eps, budget, B):
    """The two searches of :func:`build_pattern`: [(R, C, candidates, results), ...]."""
    Sx, Sy = lx.tiles // SUPER, ly.tiles // SUPER
    R, C = tile_stats(lx, f, TILE * SUPER), tile_stats(ly, g, TILE * SUPER)
    top = bounds._AllPairs(B, Sx, Sy, "cpu")
    got = bounds._search(R, C, top, eps, 0.5 * budget, B)
    fine = bounds._Inside(got[0] // Sx, got[0] % Sx, got[1] % Sy, SUPER)
    Rf, Cf = tile_stats(lx, f, TILE), tile_stats(ly, g, TILE)
    return [(R, C, top, got), (Rf, Cf, fine, bounds._search(Rf, Cf, fine, eps, 0.5 * budget, B))]


@pytest.mark.parametrize("budget", [1e-4, 1e-8])
def test_chunked_search(monkeypatch, budget):
    """Searching in chunks much smaller than the candidates gives the one-chunk pattern; the
    recorded skipped sums are the exact (dense, float64) sums of the skipped pairs' bounds and
    fit the budget; the threshold is the largest bin edge that fits and skips a subset of the
    sort-based rule's pairs; every tile with mass keeps a pair."""
    B = 2
    lx, ly, f, g, eps = _map_case(B=B)
    one = _levels(lx, ly, f, g, eps, budget, B)
    assert one[1][2].count > 10 * 97 and one[0][2].count > 2 * 97
    pat = build_pattern(lx, ly, f, g, eps, budget)
    for chunk in (97, 1001):
        monkeypatch.setattr(bounds, "PAIR_CHUNK", chunk)
        monkeypatch.setattr(bounds, "CACHED_PAIRS", 3 * chunk)  # the rest re-evaluated
        chunked = _levels(lx, ly, f, g, eps, budget, B)
        for (_, _, _, ref), (_, _, _, got) in zip(one, chunked, strict=True):
            for k in (0, 1, 3):  # pairs in the candidates' order, thresholds
                assert torch.equal(ref[k], got[k])
            torch.testing.assert_close(ref[2], got[2], rtol=1e-14, atol=0)  # skipped sums
        small = build_pattern(lx, ly, f, g, eps, budget)
        assert torch.equal(small.rows, pat.rows) and torch.equal(small.cols, pat.cols)
    assert 0 < pat.pairs < lx.tiles * ly.tiles
    lo = math.log(0.5 * budget) - bounds.LOG_BINS * bounds.LOG_BIN
    cap = 0.5 * budget * (1 - bounds.ROUNDING_MARGIN)
    for R, C, cand, (rows, cols, skipped, cut) in one:
        Tr, Tc = R.alpha.shape[1], C.alpha.shape[1]
        b, i, j = cand(0, cand.count)
        lb = pair_log_bound(R, C, b, i, j, eps)
        kept = torch.zeros(B * Tr * Tc, dtype=torch.bool)
        kept[rows * Tc + cols % Tc] = True
        kept = kept[(b * Tr + i) * Tc + j]
        assert int(kept.sum()) == rows.numel()  # no pair twice
        ref = torch.zeros(B, dtype=DT).index_add_(0, b[~kept], torch.exp(lb[~kept]))
        torch.testing.assert_close(skipped, ref, rtol=1e-13, atol=0)
        assert torch.all(skipped <= 0.5 * budget) and torch.all(skipped > 0)
        bins = bounds._bins(lb, lo)
        for k in range(B):
            mine = b == k
            # skipped pairs lie below the threshold; the next bin would not have fit
            assert torch.all(bins[mine & ~kept] < cut[k])
            assert float(torch.exp(lb[mine & (bins <= cut[k])]).sum()) > cap
            # the sort-based rule (largest prefix of smallest bounds within the budget)
            # skips a superset
            order = torch.argsort(lb[mine])
            fits = torch.exp(lb[mine][order]).cumsum(0) <= 0.5 * budget
            sort_skips = torch.zeros_like(fits)
            sort_skips[order] = fits
            assert torch.all(sort_skips[~kept[mine]])
        # every tile with mass keeps a pair
        for T, side, idx in ((Tr, R, rows), (Tc, C, cols)):
            has = torch.zeros(B * T, dtype=torch.bool)
            has[idx] = True
            assert torch.all(has[torch.isfinite(side.logm).reshape(-1)])
    # the pattern's tiles: every tile with points (zero-weight ones included) keeps a pair
    for lay, idx in ((lx, pat.rows), (ly, pat.cols)):
        has = torch.zeros(B * lay.tiles, dtype=torch.bool)
        has[idx] = True
        assert torch.all(has[lay.real.reshape(B * lay.tiles, TILE).any(-1)])


@pytest.mark.parametrize("budget", [1e-4, 1e-8, 0.0])
def test_search_kernel_matches_torch_search(budget):
    """The Triton pair search (interpreter) keeps the torch search's pairs and records its
    skipped sums, on both levels (an all-pairs grid of super tiles whose count is no multiple
    of the kernel's block, and the tiles inside the kept super pairs) of two problems with
    zero-weight tiles."""
    B = 2
    lx, ly, f, g, eps = _map_case(n=4000, B=B)
    ref = build_pattern(lx, ly, f, g, eps, budget)
    got = build_pattern(lx, ly, f, g, eps, budget, kernel=True)
    assert (lx.tiles // SUPER) % 16 != 0 and len(got.skipped) == 2
    assert 0 < got.pairs <= B * lx.tiles * ly.tiles
    pairs = lambda p: sorted(zip(p.rows.tolist(), p.cols.tolist(), strict=True))  # noqa: E731
    assert pairs(got) == pairs(ref)
    for r, k in zip(ref.skipped, got.skipped, strict=True):
        torch.testing.assert_close(k, r, rtol=1e-12, atol=0)
    assert float(sum(got.skipped).max()) <= budget
    for key in ("xy", "yx"):
        for r, k in zip(ref.csr[key], got.csr[key], strict=True):
            assert torch.equal(torch.sort(r).values, torch.sort(k).values)


# ----- block-sparse soft-min -----


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
    x, y = _clouds(n, m, d=2, seed=seed, dtype=dtype)
    a, b = _weights(n, 1, dtype), _weights(m, 2, dtype)
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
    x, y = _clouds(150, 130, d=3, seed=16, dtype=torch.float32)
    x, y = x.to(device), y.to(device)
    kw = dict(eps=1e-31, path="multiscale", tol=None, n_iters=3)
    ref = fs.sinkhorn(x, y, backend="torch", **kw)
    got = fs.sinkhorn(x, y, backend="triton", **kw)
    assert torch.isfinite(got.f).all() and torch.isfinite(got.g).all()
    torch.testing.assert_close(got.f.cpu(), ref.f.cpu(), rtol=0, atol=1e-6)
    torch.testing.assert_close(got.value.cpu(), ref.value.cpu(), rtol=1e-6, atol=0)


# ----- solves -----


#: Rounding allowance of "reported >= dense-measured" (absolute, masses of order 1): the
#: loop's test counts the marginal its last half-step made exact as exact, while its float64
#: evaluation has rounding of about m·u = 1e-13; where nothing is skipped the two errors
#: agree to that level only.
ROUNDING = 1e-12


def _dense_error(res):
    """‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ of the returned potentials, from the dense float64 plan."""
    from flashsinkhorn.backends.torch_ref import TorchBackend
    from flashsinkhorn.solvers.objective import marginals

    s = res.solution
    p = s.problem
    ra, rb = marginals(p, TorchBackend(), s.f, s.g, s.eps)
    tx = p.X.w if p.X.rho is None else p.X.w * torch.exp(-s.f / p.X.rho)
    ty = p.Y.w if p.Y.rho is None else p.Y.w * torch.exp(-s.g / p.Y.rho)
    return (ra - tx).abs().sum(-1) + (rb - ty).abs().sum(-1)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_solve_matches_dense(d, monkeypatch):
    # (the fine loop's frequent tests, for large problems only, are exercised here too)
    monkeypatch.setattr(ms_solver, "FINE_CHECK_MIN_NM", 0)
    n, m = 900, 800
    x, y = _clouds(n, m, d=d, seed=7)
    a, b = _weights(n, 5), _weights(m, 6)
    eps = 1.5e-3
    kw = dict(eps=eps, tol=1e-6, n_iters=4000, backend="torch")
    ms = fs.sinkhorn(x, y, a, b, path="multiscale", **kw)
    ref = fs.sinkhorn(x, y, a, b, **kw)
    assert ms.path == "multiscale" and ms.converged
    torch.testing.assert_close(ms.value, ref.value, rtol=1e-6, atol=0)
    # potentials agree up to the gauge f + c, g − c
    c = (ms.f - ref.f).mean()
    torch.testing.assert_close(ms.f - c, ref.f, rtol=0, atol=2e-4 * eps * 100)
    torch.testing.assert_close(ms.g + c, ref.g, rtol=0, atol=2e-4 * eps * 100)
    # the reported error bounds the untruncated plan's
    assert float(ms.marginal_error) >= float(_dense_error(ms)[0]) - ROUNDING
    assert float(ms.marginal_error) <= 1e-6
    # the fine loop tests at most every FINE_CHECK_EVERY iterations (the default is 10)
    its = [k for k, _ in ms.errors]
    assert len(its) > 2 and max(b - a for a, b in itertools.pairwise(its)) <= FINE_CHECK_EVERY


@pytest.mark.parametrize(
    "tol,schedule,acceleration",
    [(1e-2, "auto", "auto"), (1e-3, "auto", "auto"), (1e-4, "auto", "auto"),
     (1e-3, "alternating", "anderson"), (1e-3, "symmetric", "none")],
)  # fmt: skip
def test_reported_error_bounds_dense_error(tol, schedule, acceleration, monkeypatch):
    """Converged or not, the reported error is an upper bound of the dense-measured one, for
    every schedule and acceleration of the loop; patterns are built to part of the budget
    (room for the potentials to move before a rebuild)."""
    n, m = 700, 650
    x, y = _clouds(n, m, d=2, seed=8)
    kw = dict(eps=1e-3, tol=tol, backend="torch", path="multiscale", schedule=schedule,
              acceleration=acceleration, n_iters=3000)  # fmt: skip
    budgets = []
    build = ms_backend.build_pattern

    def recorded(lx, ly, f, g, eps, budget, *args):
        budgets.append(budget)
        return build(lx, ly, f, g, eps, budget, *args)

    monkeypatch.setattr(ms_backend, "build_pattern", recorded)
    res = fs.sinkhorn(x, y, **kw)
    be = res.solution.backend
    assert budgets and set(budgets) == {ms_backend.BUILD_FRACTION * be.budget}
    assert ms_backend.BUILD_FRACTION < 1
    assert res.converged
    pat = res.solution.backend.pattern
    lay = res.solution.backend.layout(res.solution.problem.X)
    assert pat.pairs < lay.tiles**2  # tile pairs were skipped
    assert float(res.marginal_error) >= float(_dense_error(res)[0]) - ROUNDING
    short = fs.sinkhorn(x, y, eps=1e-3, tol=None, n_iters=3, backend="torch", path="multiscale",
                        scaling=None)  # fmt: skip
    assert not short.converged
    assert float(short.marginal_error) >= float(_dense_error(short)[0]) - ROUNDING


def test_rebuild_when_the_error_drops(monkeypatch):
    """A pattern is rebuilt at a test whose measured error fell REBUILD_DROP times below the
    first test's on it (tighter bounds near convergence), and the solve still converges to the
    same potentials with an honest reported error."""
    x, y = _clouds(700, 650, d=2, seed=8)
    kw = dict(eps=1e-3, tol=1e-6, backend="torch", path="multiscale", n_iters=3000)
    runs = {}
    for drop in (None, 4.0):
        monkeypatch.setattr(ms_backend, "REBUILD_DROP", drop)
        res = fs.sinkhorn(x, y, **kw)
        assert res.converged
        assert float(res.marginal_error) >= float(_dense_error(res)[0]) - ROUNDING
        runs[drop] = res
    # from ~1e-2 to 1e-6 the error drops 4x several times
    assert runs[4.0].solution.backend.rebuilds >= runs[None].solution.backend.rebuilds + 3
    torch.testing.assert_close(runs[4.0].value, runs[None].value, rtol=1e-6, atol=0)


def test_batched_and_unbalanced_match_dense():
    B, n, m = 2, 500, 450
    x, y = _clouds(n, m, d=3, B=B, seed=9)
    a = torch.stack([_weights(n, 10), _weights(n, 11)])
    b = torch.stack([_weights(m, 12), _weights(m, 13)]) * 1.3
    kw = dict(eps=2e-3, tol=1e-6, n_iters=4000, backend="torch", rho_x=0.5, rho_y=0.2)
    ms = fs.sinkhorn(x, y, a, b, path="multiscale", **kw)
    ref = fs.sinkhorn(x, y, a, b, **kw)
    assert ms.value.shape == (B,)
    torch.testing.assert_close(ms.value, ref.value, rtol=2e-6, atol=0)
    torch.testing.assert_close(ms.f, ref.f, rtol=0, atol=1e-4)
    assert torch.all(ms.marginal_error >= _dense_error(ms) - ROUNDING)


def _grads(path, x, y, a, b, **kw):
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    as_, bs = a.clone().requires_grad_(), b.clone().requires_grad_()
    v = fs.ot_cost(xs, ys, as_, bs, path=path, **kw)
    v.sum().backward()
    return v.detach(), xs.grad, ys.grad, as_.grad, bs.grad


@pytest.mark.parametrize("rho", [None, 0.3])
def test_gradients_match_dense(rho):
    n, m = 600, 500
    x, y = _clouds(n, m, d=2, seed=11)
    a, b = _weights(n, 7), _weights(m, 8)
    kw = dict(eps=2e-3, tol=1e-7, n_iters=5000, backend="torch", rho_x=rho, rho_y=rho)
    ms = _grads("multiscale", x, y, a, b, **kw)
    ref = _grads("auto", x, y, a, b, **kw)
    torch.testing.assert_close(ms[0], ref[0], rtol=1e-6, atol=0)
    for gm, gr in zip(ms[1:3], ref[1:3], strict=True):
        torch.testing.assert_close(gm, gr, rtol=0, atol=1e-6 * float(gr.abs().max()) * 100)
    for gm, gr in zip(ms[3:], ref[3:], strict=True):
        # weight gradients: potentials, defined up to a constant when balanced
        c = 0.0 if rho is not None else (gm - gr).mean()
        torch.testing.assert_close(gm - c, gr, rtol=0, atol=2e-4)


def test_gradient_finite_differences():
    """d value / dx along a direction, against central differences of the multiscale value."""
    n, m = 250, 220
    x, y = _clouds(n, m, d=2, seed=12)
    kw = dict(eps=3e-3, tol=1e-10, n_iters=20000, backend="torch", path="multiscale")
    xs = x.clone().requires_grad_()
    fs.ot_cost(xs, y, **kw).backward()
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(x.shape, generator=gen, dtype=DT)
    h = 1e-5
    fd = (fs.ot_cost(x + h * v, y, **kw) - fs.ot_cost(x - h * v, y, **kw)) / (2 * h)
    torch.testing.assert_close((xs.grad * v).sum(), fd, rtol=1e-5, atol=0)


def test_batched_gradients_float32_match_float64():
    B, n, m = 2, 400, 380
    x, y = _clouds(n, m, d=3, B=B, seed=13)
    kw = dict(eps=3e-3, tol=1e-5, n_iters=5000, backend="torch", path="multiscale")
    x32, y32 = x.float().requires_grad_(), y.float().requires_grad_()
    v32 = fs.ot_cost(x32, y32, **kw)
    v32.sum().backward()
    x64, y64 = x.clone().requires_grad_(), y.clone().requires_grad_()
    v64 = fs.ot_cost(x64, y64, **kw)
    v64.sum().backward()
    assert v32.dtype == torch.float32 and x32.grad.shape == (B, n, 3)
    torch.testing.assert_close(v32.double(), v64.detach(), rtol=1e-4, atol=0)
    scale = float(x64.grad.abs().max())
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=0, atol=2e-3 * scale)


def test_divergence_matches_dense():
    n, m = 500, 450
    x, y = _clouds(n, m, d=2, seed=14)
    kw = dict(eps=2e-3, tol=1e-7, n_iters=5000, backend="torch")
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    s_ms = fs.sinkhorn_divergence(xs, y, path="multiscale", **kw)
    s_ref = fs.sinkhorn_divergence(xr, y, **kw)
    s_ms.backward()
    s_ref.backward()
    torch.testing.assert_close(s_ms.detach(), s_ref.detach(), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=1e-4 * float(xr.grad.abs().max()))


def test_inputs_not_modified():
    x, y = _clouds(300, 280, d=2, seed=15)
    a, b = _weights(300, 1), _weights(280, 2)
    copies = [t.clone() for t in (x, y, a, b)]
    fs.sinkhorn(x, y, a, b, eps=3e-3, backend="torch", path="multiscale")
    for t, c in zip((x, y, a, b), copies, strict=True):
        assert torch.equal(t, c)


# ----- refusals and the auto rule -----


def test_refusals():
    x, y = _clouds(50, 40, d=2)
    with pytest.raises(ValueError, match="d <= 3"):
        fs.sinkhorn(torch.rand(30, 4), torch.rand(20, 4), eps=0.01, path="multiscale")
    with pytest.raises(ValueError, match="float32 and float64"):
        fs.sinkhorn(x.half(), y.half(), eps=0.01, path="multiscale")
    with pytest.raises(ValueError, match="squared Euclidean"):
        fs.sinkhorn(x, y, eps=0.01, path="multiscale", cost="euclidean")
    with pytest.raises(ValueError, match="squared Euclidean"):
        fs.ot_cost(x, y, eps=0.01, path="multiscale", feature_map=torch.ones(2, dtype=DT) * 2)
    with pytest.raises(ValueError, match="precision"):
        fs.sinkhorn(x.float(), y.float(), eps=0.01, path="multiscale", precision="tf32")
    with pytest.raises(ValueError, match="small eps"):
        fs.sinkhorn(x, y, eps=100.0, path="multiscale")
    with pytest.raises(ValueError, match="path must be one of"):
        fs.sinkhorn(x, y, eps=0.01, path="sparse")


def test_double_backward_refused():
    x, y = _clouds(200, 180, d=2, seed=2)
    xs = x.clone().requires_grad_()
    v = fs.ot_cost(xs, y, eps=3e-3, backend="torch", path="multiscale")
    (gx,) = torch.autograd.grad(v, xs, create_graph=True)
    with pytest.raises(ValueError, match="multiscale"):
        gx.sum().backward()
    from flashsinkhorn.hessian import HessianOperator

    with pytest.raises(ValueError, match="multiscale"):
        HessianOperator(x, y, eps=3e-3, path="multiscale")


def test_auto_rule():
    from flashsinkhorn.multiscale import multiscale_applies
    from flashsinkhorn.options import SinkhornOptions

    big_x = torch.rand(100_000, 3)
    big_y = torch.rand(100_000, 3)
    diam2 = 3.0
    small = SinkhornOptions.build(big_x, big_y, eps=1e-4 * diam2)
    assert multiscale_applies(big_x, big_y, small)
    assert not multiscale_applies(big_x, big_y, small.replace(eps=0.1))
    assert not multiscale_applies(big_x[:1000], big_y, small)
    assert not multiscale_applies(big_x, big_y, small.replace(tol=None))
    assert not multiscale_applies(torch.rand(100_000, 4), torch.rand(100_000, 4), small)
    # small problems keep their path
    x, y = _clouds(100, 90, d=2)
    assert fs.sinkhorn(x, y, eps=1e-3, backend="torch").path == "dense"


def test_backend_kernel_path_matches_torch_path(device):
    """The backend's soft-min and envelope gradient through ``_lse_sparse_fwd_kernel``
    (interpreter) equal those of the torch block-sparse path, float32."""
    from flashsinkhorn.problem import prepare

    x, y = _clouds(150, 130, d=3, seed=16, dtype=torch.float32)
    x, y = x.to(device), y.to(device)
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="ieee")
    eps = 3e-3
    ref = fs.sinkhorn(x, y, eps=eps, backend="torch", tol=1e-4)
    out = torch_and_kernel_paths(p, ref.solution.f, ref.solution.g, eps, grad_rows="y")
    (T0, G0, m0), (T1, G1, m1) = out
    torch.testing.assert_close(T1, T0, rtol=0, atol=1e-5)
    torch.testing.assert_close(m1, m0, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(G1, G0, rtol=0, atol=1e-4 * float(G0.abs().max()))


@pytest.mark.parametrize("rho", [None, 3e-4])
def test_shift_estimates_cover_padding(device, monkeypatch, rho):
    """At converged potentials the backend's soft-min estimates every row's log-sum-exp well
    enough that the shift kernel flags no tile, padding rows (which repeat a point) included,
    and for a strongly relaxed marginal (damping 1/11: an estimate that did not divide by it
    would put −T/eps off by a factor of 11): the exact kernel then recomputes nothing."""
    from flashsinkhorn.backends.torch_ref import TorchBackend
    from flashsinkhorn.backends.triton import sparse
    from flashsinkhorn.multiscale.backend import MultiscaleBackend
    from flashsinkhorn.problem import prepare

    x, y = _clouds(150, 130, d=3, seed=16, dtype=torch.float32)
    x, y = x.to(device), y.to(device)
    p = prepare(x, y, None, None, rho_x=rho, rho_y=rho, precision="ieee")
    eps = 3e-3
    ref = fs.sinkhorn(x, y, eps=eps, backend="torch", tol=1e-5, rho_x=rho, rho_y=rho)
    f, g = ref.solution.f, ref.solution.g
    lam = p.X.damping(eps)
    assert (lam < 1.0) == (rho is not None)
    be = MultiscaleBackend(TorchBackend(), p, 1e-3)
    be.kernel = True
    assert not be.layout(p.X).real.all()  # the case has padding rows
    flags = []

    def recording(kernel, grid, *args, **kw):
        sparse.launch.__wrapped__(kernel, grid, *args, **kw)
        if kernel is sparse._lse_sparse_shift_kernel:
            flags.append(args[7].cpu())

    recording.__wrapped__ = sparse.launch
    monkeypatch.setattr(sparse, "launch", recording)
    out, T = be.softmin(p.X, p.Y, g, eps, f, 0.0, lam, True, "ieee")
    assert len(flags) == 1 and int(flags[0].sum()) == 0
    torch.testing.assert_close(out, f, rtol=0, atol=1e-4)


def test_zero_weights_and_tiny_clouds():
    """Zero-weight points get the potential of the final plan; 1- and 2-point clouds work."""
    x, y = _clouds(400, 300, d=2, seed=3)
    a = _weights(400, 1)
    a[::7] = 0
    a = a / a.sum()
    kw = dict(eps=2e-3, tol=1e-7, n_iters=5000, backend="torch")
    ms = fs.sinkhorn(x, y, a, path="multiscale", **kw)
    ref = fs.sinkhorn(x, y, a, **kw)
    torch.testing.assert_close(ms.value, ref.value, rtol=1e-9, atol=0)
    c = (ms.f - ref.f)[a > 0].mean()
    torch.testing.assert_close(ms.f - c, ref.f, rtol=0, atol=1e-6)
    for n, m in [(1, 1), (5, 2)]:
        xs, ys = x[:n], y[:m]
        got = fs.sinkhorn(xs, ys, path="multiscale", **kw)
        want = fs.sinkhorn(xs, ys, **kw)
        torch.testing.assert_close(got.value, want.value, rtol=1e-9, atol=1e-12)


def test_gradient_reuses_the_solve_pattern(monkeypatch):
    """After a converged solve the envelope gradient reads the solve's pattern (its skipped
    bound at the final potentials is within the budget): no rebuild, and the same gradient
    as on a fresh pattern of every pair, to the budget's share of the plan's mass."""
    x, y = _clouds(700, 600, d=3, seed=21)
    res = fs.sinkhorn(x, y, eps=2e-3, tol=1e-7, n_iters=5000, backend="torch", path="multiscale")
    sol = res.solution
    be, p = sol.backend, sol.problem
    built = be.rebuilds
    assert 0 < be.pattern.pairs < be.layout(p.X).tiles * be.layout(p.Y).tiles
    for rows, cols, f, g in ((p.X, p.Y, sol.f, sol.g), (p.Y, p.X, sol.g, sol.f)):
        G, marg = be.transport_grad(rows, cols, f, g, sol.eps, p.precision)
        assert be.rebuilds == built
        # a budget no pattern's bound can meet: a fresh pattern keeping every pair
        monkeypatch.setattr(be, "budget", -1.0)
        G_all, marg_all = be.transport_grad(rows, cols, f, g, sol.eps, p.precision)
        monkeypatch.undo()
        assert be.rebuilds == built + 1
        built = be.rebuilds
        scale = float(G_all.abs().max())
        torch.testing.assert_close(G, G_all, rtol=0, atol=1e-6 * scale)
        torch.testing.assert_close(marg, marg_all, rtol=0, atol=1e-7)
