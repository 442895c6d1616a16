"""The multiscale path's clustering (layouts, tiles, cells) and truncation bounds (tile
bounds, pattern search in torch chunks and as the Triton kernel under the interpreter), on
small float64 clouds."""

import math

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.multiscale import bounds
from flashsinkhorn.multiscale.bounds import build_pattern, pair_log_bound, tile_stats
from flashsinkhorn.multiscale.clustering import SUPER, TILE, build_layout, cells

from .multiscale_cases import DT, dense_log_plan, small_clouds, small_weights


@pytest.mark.parametrize("d", [1, 2, 3])
def test_layout_permutation_and_padding(d):
    x, _ = small_clouds(300, 10, d=d, B=2)
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
    x, _ = small_clouds(4096, 10, d=2, seed=3)
    lay = build_layout(x[None], torch.ones(1, 4096, dtype=DT), DT)
    ext = lay.x[0].reshape(-1, TILE, 3).amax(1) - lay.x[0].reshape(-1, TILE, 3).amin(1)
    rnd = x[torch.randperm(4096)].reshape(-1, TILE, 2)
    ext_r = rnd.amax(1) - rnd.amin(1)
    assert ext[:, :2].norm(dim=-1).mean() < 0.35 * ext_r.norm(dim=-1).mean()


def test_cells_centroids_and_weights():
    x, _ = small_clouds(500, 10, d=3, B=2, seed=1)
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
    x, y = small_clouds(n, m, d=2, seed=2)
    a, b = small_weights(n, 1), small_weights(m, 2)
    f, g = _potentials(x, y, a, b, eps, noise)
    lx, ly = build_layout(x[None], a[None], DT), build_layout(y[None], b[None], DT)
    fs_, gs_ = lx.sort(f[None]), ly.sort(g[None])
    for size in (TILE, TILE * SUPER):
        R, C = tile_stats(lx, fs_, size), tile_stats(ly, gs_, size)
        Tr, Tc = lx.N // size, ly.N // size
        bb, i, j = bounds._AllPairs(1, Tr, Tc, "cpu")(0, Tr * Tc)
        lb = pair_log_bound(R, C, bb, i, j, eps).reshape(Tr, Tc)
        logP = dense_log_plan(lx.x[0], ly.x[0], lx.w[0], ly.w[0], fs_[0], gs_[0], eps)
        mass = torch.logsumexp(logP.reshape(Tr, size, Tc, size), dim=(1, 3))
        live = torch.isfinite(mass)
        assert torch.all(mass[live] <= lb[live] + 1e-9), float((mass - lb)[live].max())
        assert torch.all(torch.isfinite(lb[live]))


def _outside_mass(lx, ly, pat, f, g, eps, n, m, d=2):
    """Dense mass of the plan (f, g) (sorted) outside the pattern's tile pairs, per problem."""
    out = []
    for bi in range(lx.B):
        logP = dense_log_plan(lx.x[bi], ly.x[bi], lx.w[bi], ly.w[bi], f[bi], g[bi], eps)
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
    x, y = small_clouds(n, m, d=2, seed=4)
    a, b = small_weights(n, 3), small_weights(m, 4)
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
    x, y = small_clouds(n, m, d=2, B=B, seed=17)
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
