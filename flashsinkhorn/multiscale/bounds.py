"""Upper bounds of the plan's mass on pairs of tiles, and the block-sparse pattern they select.

For a row tile I (points x_i, weights a_i, potential f) and a column tile J (y_j, b_j, g) the
plan P_ij = a_i b_j exp((f_i + g_j − ‖x_i − y_j‖²)/eps) carries a mass

    M_IJ = Σ_{i∈I, j∈J} P_ij <= A_I B_J exp(E_IJ / eps),

with A_I, B_J the tiles' masses and E_IJ an upper bound of f_i + g_j − ‖x_i − y_j‖² over the
tiles. A constant bound (largest f of the tile) is useless at small eps: potentials of a
transport vary by |∇f| · (tile size), many eps across a tile. Each tile instead gets an
*affine* upper bound of its potential, f_i <= α_I + u_I·x_i (u_I fitted by least squares,
α_I the exact largest residual, so the bound holds whatever u_I is), and

    f_i + g_j − ‖x_i − y_j‖² <= α_I + β_J + (u_I + v_J)·y_j + u_I·z − ‖z‖²,   z = x_i − y_j,

is maximised over y_j in J's bounding box (a linear function: one corner) and z in the box
difference I − J (a concave quadratic: u_I/2 clamped to the box). The same with the roles of
x and y exchanged gives a second bound; E_IJ is the smaller. Derivation: docs/multiscale.md.

The pattern skips the pairs whose bounds lie below a threshold, per problem: the largest edge
of a histogram of the log bounds (bins of ``LOG_BIN`` nats) whose bins below it sum to at most
a budget (a fraction of ``tol``). The mass of the true plan outside the pattern is then
provably below that budget, and the exact sum of the skipped bounds is recorded. Beyond the
largest set of smallest bounds that fits (what a sort of the bounds would skip), it keeps only
pairs of the bin the threshold falls in. The search runs on super tiles first (``SUPER``
tiles), whose bounds dominate the sums of their tiles' bounds, then on the tiles of the super
pairs it keeps. Candidates are generated and evaluated ``PAIR_CHUNK`` at a time, twice (the
histogram and each tile's best pair, then the selection), so that no level ever holds all of
them.

Memory: about 500 bytes per pair of a chunk (float64 boxes, slopes and bounds of its two
tiles; 2 GB at 2²² pairs), 56 bytes per pair of the first chunks that pass 1 keeps for
pass 2 (``CACHED_PAIRS``, 0.9 GB), 16 bytes per kept pair (32 while the chunks' pairs are
concatenated, about 64 while the CSR orders are sorted), and O(tiles). Two 3-D clouds of 4M
points (62,500 tiles, about 3,900 super tiles a side): 15M super pairs, then about 1.2·10⁹
tile-pair candidates in some 300 chunks; the peak is about 3 GB + 64 B per kept tile pair
(16 GB at 5 % of the 3.9·10⁹ pairs kept), where evaluating the candidates at once would take
well over 100 GB. On the Triton backend both passes are one kernel
(``backends/triton/pair_search.py``) that evaluates blocks of pairs in registers and keeps
only a flag per candidate of a pass-2 launch: the chunks and the cache are the torch path's.

When the potentials move, each skipped pair's bound moves by (Δα_I + Δβ_J)/eps with the slopes
kept fixed: :meth:`Pattern.skipped_bound` re-evaluates the total from the tiles' new α and β in
O(n), without visiting the skipped pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .clustering import SUPER, TILE, Layout

#: Candidate pairs evaluated at once by the pattern search (about 0.5 KB of temporaries per
#: pair: 2 GB a chunk).
PAIR_CHUNK = 1 << 22
#: Pairs whose evaluated bounds pass 1 of the search keeps for pass 2 (the first chunks; 56
#: bytes a pair, 0.9 GB), which then evaluates only the chunks beyond.
CACHED_PAIRS = 1 << 24
#: Width (nats) of the bins of the log bounds' histogram that sets the skipping threshold.
LOG_BIN = 1.0 / 64.0
#: Bins of LOG_BIN below log(budget), 60 nats: smaller bounds share one bin (each weighs less
#: than e⁻⁶⁰ of the budget, so it is skipped whole), larger ones another (never skipped).
LOG_BINS = 60 * 64
#: Fraction of the budget left to the rounding of float64 sums, so that the skipped pairs'
#: recorded sum cannot exceed the budget (see :func:`_search`).
ROUNDING_MARGIN = 2.0**-16


@dataclass(frozen=True)
class TileStats:
    """Affine bounds of one side's potential over its tiles (one tiling size).

    Attributes:
        lo, hi: (B, T, 3) bounding boxes of the tiles' points.
        u: (B, T, 3) slopes of the affine bounds.
        alpha: (B, T) α_T = max over the tile's points with mass of pot − u·x.
        logm: (B, T) log of the tile's mass (−inf for a tile without mass).
        size: points per tile.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    u: torch.Tensor
    alpha: torch.Tensor
    logm: torch.Tensor
    size: int


def _tiled(t: torch.Tensor, size: int) -> torch.Tensor:
    B, N = t.shape[:2]
    return t.reshape(B, N // size, size, *t.shape[2:])


def _counted(layout: Layout, size: int) -> torch.Tensor:
    """(B, T, size) points that the affine bound must cover: those with mass, or every real
    point of a tile without mass (zero-weight points still need a finite soft-min)."""
    live = _tiled(layout.w, size) > 0
    real = _tiled(layout.real, size)
    return torch.where(live.any(-1, keepdim=True), live, real)


def tile_alpha(layout: Layout, pot: torch.Tensor, u: torch.Tensor, size: int) -> torch.Tensor:
    """(B, T) α = max over each tile's points (:func:`_counted`) of (pot − u·x), float64;
    −inf for a tile of padding only. ``pot``: (B, N) sorted, padded potential."""
    x = _tiled(layout.x.double(), size)
    r = _tiled(pot.double(), size) - (x * u[:, :, None, :]).sum(-1)
    return torch.where(_counted(layout, size), r, -math.inf).amax(-1)


def tile_stats(layout: Layout, pot: torch.Tensor, size: int) -> TileStats:
    """Boxes and affine bounds of the potential ``pot`` (B, N) (sorted, padded) over tiles of
    ``size`` points, in float64."""
    x = _tiled(layout.x.double(), size)  # (B, T, s, 3)
    w = _tiled(layout.w.double(), size)
    p = _tiled(pot.double(), size)
    lo, hi = x.amin(2), x.amax(2)
    live = _counted(layout, size).double()
    cnt = live.sum(-1, keepdim=True).clamp_min(1.0)
    xm = (live[..., None] * x).sum(2, keepdim=True) / cnt[..., None]
    pm = (live * p).sum(-1, keepdim=True) / cnt
    p = torch.where(live > 0, p, pm)  # padding: no influence on the fit
    xc = live[..., None] * (x - xm)
    cov = xc.transpose(-1, -2) @ xc  # (B, T, 3, 3)
    rhs = (xc * (p - pm)[..., None]).sum(2)
    # Ridge of 1e-9 of the box's scale: degenerate tiles (one point, collinear or planar
    # points, padded coordinates) keep a solvable system; any slope gives a valid bound.
    scale = ((hi - lo) ** 2).sum(-1) + 1e-30
    eye = torch.eye(3, dtype=cov.dtype, device=cov.device)
    u = torch.linalg.solve(cov + (1e-9 * scale)[..., None, None] * eye, rhs)
    u = torch.nan_to_num(u, nan=0.0, posinf=0.0, neginf=0.0)
    alpha = tile_alpha(layout, pot, u, size)
    mass = w.sum(-1)
    logm = torch.where(mass > 0, mass.clamp_min(1e-300).log(), -math.inf)
    return TileStats(lo, hi, u, alpha, logm, size)


def _corner(s: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """max over the box [lo, hi] of s·y."""
    return torch.maximum(s * lo, s * hi).sum(-1)


def _quad(u: torch.Tensor, zlo: torch.Tensor, zhi: torch.Tensor) -> torch.Tensor:
    """max over the box [zlo, zhi] of u·z − ‖z‖² (attained at u/2 clamped to the box)."""
    z = torch.minimum(torch.maximum(0.5 * u, zlo), zhi)
    return (u * z - z * z).sum(-1)


def pair_exponent(R: TileStats, C: TileStats, b, i, j) -> torch.Tensor:
    """(P,) E_ij: upper bound of f + g − ‖x − y‖² over row tile i and column tile j of
    problem b (index tensors of one length), float64; −inf where a tile has no mass."""
    u, v = R.u[b, i], C.u[b, j]
    rlo, rhi, clo, chi = R.lo[b, i], R.hi[b, i], C.lo[b, j], C.hi[b, j]
    s = u + v
    zlo, zhi = rlo - chi, rhi - clo
    # x = y + z (maximise over y in C's box) or y = x − z (over x in R's box)
    e1 = _corner(s, clo, chi) + _quad(u, zlo, zhi)
    e2 = _corner(s, rlo, rhi) + _quad(-v, zlo, zhi)
    return R.alpha[b, i] + C.alpha[b, j] + torch.minimum(e1, e2)


def pair_log_bound(R: TileStats, C: TileStats, b, i, j, eps: float) -> torch.Tensor:
    """(P,) log of the bound A_i B_j exp(E_ij / eps) of the plan's mass on the pair."""
    e = pair_exponent(R, C, b, i, j)
    return _finite_or_ninf(R.logm[b, i] + C.logm[b, j] + e / eps)


def _finite_or_ninf(t: torch.Tensor) -> torch.Tensor:
    """NaN (−inf + inf of a tile without points) to −inf; ±inf kept."""
    return torch.where(torch.isnan(t), -math.inf, t)


@dataclass
class Pattern:
    """The tile pairs a soft-min visits, and the bound of the mass it skips.

    Attributes:
        rows, cols: (P,) global tile indices (problem · tiles + tile) of the kept pairs (x tiles
            and y tiles of the problem the pattern was built for); int32 where they fit.
        csr: {"xy": (rowptr, cols), "yx": (rowptr, rows)}: the kept pairs grouped by x tile
            and by y tile (int32, the kernels' format; the torch path reads them too).
        eps: the eps the pattern was built for.
        stats: per level (super tiles, tiles): (x-side TileStats, y-side TileStats) at build.
        skipped: per level, (B,) float64 sum of the skipped pairs' bounds at build.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    csr: dict
    eps: float
    stats: list
    skipped: list

    @property
    def pairs(self) -> int:
        return int(self.rows.numel())

    def skipped_bound(self, lx: Layout, ly: Layout, f: torch.Tensor, g: torch.Tensor, eps):
        """(B,) float64 upper bound of the plan's mass outside the pattern at potentials f, g
        (sorted, padded) and ``eps``: each level's total at build, scaled by the largest
        change of the tiles' α and β (same slopes), exp((max Δα + max Δβ)/eps)."""
        total = torch.zeros_like(self.skipped[0])
        for (sx, sy), s0 in zip(self.stats, self.skipped, strict=True):
            ax = tile_alpha(lx, f, sx.u, sx.size)
            ay = tile_alpha(ly, g, sy.u, sy.size)
            dx = _max_shift(ax, sx.alpha)
            dy = _max_shift(ay, sy.alpha)
            # at another eps the bound's exponent scales: E/eps' = E/eps · eps/eps'
            grown = _rescale(s0, self.eps, eps) * torch.exp((dx + dy) / eps)
            # nothing skipped stays nothing (not 0 · inf = NaN when the potentials moved far)
            total = total + torch.where(s0 > 0, grown, 0.0)
        return total


def _max_shift(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """(B,) largest increase of α over the tiles with mass (−inf entries: no mass)."""
    d = torch.where(torch.isfinite(old), new - old, -math.inf)
    return d.amax(-1).clamp_min(-1e300)


def _rescale(s0: torch.Tensor, eps0: float, eps: float) -> torch.Tensor:
    if eps == eps0:
        return s0
    # only used with eps == eps0 by the backend (a new eps rebuilds); kept exact otherwise:
    # no cheap bound, so refuse to claim one
    return torch.full_like(s0, math.inf)


class _AllPairs:
    """Every (problem, row tile, column tile) triple, enumerated problem-major by a linear
    index (nothing materialised beyond one chunk)."""

    def __init__(self, B: int, Tr: int, Tc: int, device):
        self.count, self.Tr, self.Tc, self.device = B * Tr * Tc, Tr, Tc, device

    def __call__(self, start: int, stop: int):
        k = torch.arange(start, stop, device=self.device)
        b, r = k // (self.Tr * self.Tc), k % (self.Tr * self.Tc)
        return b, r // self.Tc, r % self.Tc


class _Inside:
    """The ``size``² tile pairs inside each kept super pair (b, i, j), pair-major."""

    def __init__(self, b: torch.Tensor, i: torch.Tensor, j: torch.Tensor, size: int):
        # int64: the tile indices below are formed (and scattered on) in this dtype
        self.b, self.i, self.j, self.size = b.long(), i.long(), j.long(), size
        self.count = b.numel() * size * size

    def __call__(self, start: int, stop: int):
        s = self.size
        k = torch.arange(start, stop, device=self.b.device)
        p, r = k // (s * s), k % (s * s)
        return self.b[p], self.i[p] * s + r // s, self.j[p] * s + r % s


@dataclass
class _Chunk:
    b: torch.Tensor
    i: torch.Tensor
    j: torch.Tensor
    lb: torch.Tensor  # log bound of the pair's mass
    lr: torch.Tensor  # without the row tile's mass (ranks a row tile's pairs)
    lc: torch.Tensor  # without the column tile's mass
    bin: torch.Tensor  # histogram bin of lb (:func:`_bins`)


def _bins(lb: torch.Tensor, lo: float) -> torch.Tensor:
    """(P,) int64 bin of each log bound: 0 for −inf (a bound of 0), 1 for finite bounds below
    ``lo``, 2 + k for [lo + k·LOG_BIN, lo + (k + 1)·LOG_BIN), and LOG_BINS + 2 from
    lo + LOG_BINS·LOG_BIN = log(budget) up (a bound above the budget is never skipped)."""
    # NaN only for lb = lo = −inf (a zero budget), set to bin 0 below
    q = (torch.floor((lb - lo) * (1.0 / LOG_BIN)).clamp(-1, LOG_BINS) + 2).nan_to_num(0.0)
    return torch.where(lb == -math.inf, 0, q.long())


def _evaluate(R: TileStats, C: TileStats, b, i, j, eps: float, lo: float) -> _Chunk:
    e = pair_exponent(R, C, b, i, j) / eps
    lmr, lmc = R.logm[b, i], C.logm[b, j]
    lb = _finite_or_ninf(lmr + lmc + e)
    lr, lc = _finite_or_ninf(lmc + e), _finite_or_ninf(lmr + e)
    return _Chunk(b, i, j, lb, lr, lc, _bins(lb, lo))


def _search(R: TileStats, C: TileStats, cand, eps: float, budget: float, B: int, kernel=False):
    """The pairs of ``cand`` to keep, in two passes over chunks of :data:`PAIR_CHUNK`.

    Pass 1 accumulates, per problem, the sum of exp(bound) in each log bin (:func:`_bins`) and
    each row and column tile's largest bound. The threshold is the largest bin edge whose bins
    below sum to at most ``budget`` (less :data:`ROUNDING_MARGIN`). Pass 2 re-evaluates the
    chunks beyond :data:`CACHED_PAIRS` (bit for bit the same values) and skips the pairs
    below the threshold, except each tile's best pair (so that every tile with mass visits
    one tile and its soft-min stays finite; ranked by the bound without that tile's mass,
    for tiles of zero-weight points).

    Args:
        R, C: tile statistics of the rows and of the columns.
        cand: the candidate pairs: ``cand.count`` and ``cand(start, stop)`` -> (b, i, j).
        eps: entropic regularisation.
        budget: largest sum of the skipped pairs' bounds, per problem.
        B: number of problems.
        kernel: run both passes as the Triton kernel of
            ``flashsinkhorn.backends.triton.pair_search`` (no chunks: it holds no candidate
            in memory; the same threshold, a best pair per tile found in float32).

    Returns:
        (rows, cols, skipped, cut): the kept pairs' global row and column tile indices
        (b · tiles + i), int32 where they fit (else int64); the (B,) float64 exact sums of
        the skipped pairs' bounds (<= ``budget``); the (B,) int64 first bin kept (pairs of
        smaller bins were skipped).
    """
    dev = R.alpha.device
    Tr, Tc = R.alpha.shape[1], C.alpha.shape[1]
    nb = LOG_BINS + 3
    lo = (math.log(budget) if budget > 0 else -math.inf) - LOG_BINS * LOG_BIN
    # kept pairs as int32 where the tile indices fit: at 4M points 10⁸–10⁹ pairs are kept, and
    # their index lists (here, in the pattern and its CSR copies) are most of its memory
    idx = torch.int32 if B * max(Tr, Tc) < 2**31 else torch.int64
    if kernel:
        from ..backends.triton import pair_search

        inside = None if isinstance(cand, _AllPairs) else (cand.b, cand.i, cand.j, cand.size)
        return pair_search.search(
            R, C, inside, eps, budget, B, lo, LOG_BINS, LOG_BIN, ROUNDING_MARGIN, idx
        )
    starts = range(0, cand.count, PAIR_CHUNK)
    chunk = lambda s: _evaluate(R, C, *cand(s, min(s + PAIR_CHUNK, cand.count)), eps, lo)
    hist = torch.zeros(B * nb, dtype=torch.float64, device=dev)
    best_r = torch.full((B * Tr,), -math.inf, dtype=torch.float64, device=dev)
    best_c = torch.full((B * Tc,), -math.inf, dtype=torch.float64, device=dev)
    cache = []
    for n, s in enumerate(starts):
        c = chunk(s)
        # bincount, not index_add_: most candidates fall in the one bin below the range, and
        # bincount's per-block shared-memory histogram spares the global atomics on it
        hist += torch.bincount(c.b * nb + c.bin, torch.exp(c.lb), minlength=B * nb)
        best_r.scatter_reduce_(0, c.b * Tr + c.i, c.lr, "amax")
        best_c.scatter_reduce_(0, c.b * Tc + c.j, c.lc, "amax")
        if n == 0 or (n + 1) * PAIR_CHUNK <= CACHED_PAIRS:
            cache.append(c)
    # A float64 sum of n nonnegative terms, in any order, is within n·2⁻⁵³ of exact (relative).
    # The skipped pairs are a subset of the bins below the cut, with the same bounds (their
    # exp within its last bit): the bins' sums, their scan and the skipped sum round by less than
    # 3·n·2⁻⁵³ < ROUNDING_MARGIN together for n < 2³⁴ pairs per problem, so the recorded
    # skipped sum cannot exceed the budget.
    cap = budget * (1.0 - ROUNDING_MARGIN)
    below = hist.view(B, nb).cumsum(1)[:, :-1] <= cap  # column k: bins 0..k fit, cut k + 1
    cut = below.long().cumprod(1).sum(1)  # a prefix, whatever the scan's rounding
    skipped = torch.zeros(B, dtype=torch.float64, device=dev)
    rows, cols = [], []
    for n, s in enumerate(starts):
        if n < len(cache):
            c, cache[n] = cache[n], None
        else:
            c = chunk(s)
        best = (c.lr == best_r[c.b * Tr + c.i]) & torch.isfinite(c.lr)
        best |= (c.lc == best_c[c.b * Tc + c.j]) & torch.isfinite(c.lc)
        skip = (c.bin < cut[c.b]) & ~best
        skipped += torch.bincount(c.b[skip], torch.exp(c.lb[skip]), minlength=B)
        keep = ~skip
        rows.append((c.b[keep] * Tr + c.i[keep]).to(idx))
        cols.append((c.b[keep] * Tc + c.j[keep]).to(idx))
    empty = torch.zeros(0, dtype=idx, device=dev)
    return torch.cat([empty, *rows]), torch.cat([empty, *cols]), skipped, cut


def build_pattern(
    lx: Layout, ly: Layout, f: torch.Tensor, g: torch.Tensor, eps: float, budget: float,
    self_problem: bool = False, kernel: bool = False,
) -> Pattern:  # fmt: skip
    """The block-sparse pattern of the plan (f, g) at ``eps``.

    Args:
        lx, ly: layouts of the x and y sides (the same object for a self problem).
        f: (B, N_x) sorted, padded potential of x (float32 or float64).
        g: (B, N_y) sorted, padded potential of y.
        eps: entropic regularisation.
        budget: largest total bound of the skipped pairs (mass units): half of it for the
            super-tile level, half for the tile level.
        self_problem: x and y are one cloud (the pattern is still stored in both orientations).
        kernel: search the pairs with the Triton kernel (CUDA tensors, or the interpreter).

    Returns:
        The pattern; ``sum(pattern.skipped)`` <= budget.
    """
    B = lx.B
    dev = lx.x.device
    Tx, Ty = lx.tiles, ly.tiles
    levels = []
    fine_x = tile_stats(lx, f, TILE)
    fine_y = fine_x if self_problem else tile_stats(ly, g, TILE)
    if Tx * Ty > SUPER * SUPER:
        sup_x = tile_stats(lx, f, TILE * SUPER)
        sup_y = sup_x if self_problem else tile_stats(ly, g, TILE * SUPER)
        Sx, Sy = Tx // SUPER, Ty // SUPER
        top = _AllPairs(B, Sx, Sy, dev)
        sr, sc, sk1, _ = _search(sup_x, sup_y, top, eps, 0.5 * budget, B, kernel)
        levels.append(((sup_x, sup_y), sk1))
        cand = _Inside(sr // Sx, sr % Sx, sc % Sy, SUPER)
        fine_budget = 0.5 * budget
    else:
        cand = _AllPairs(B, Tx, Ty, dev)
        fine_budget = budget
    rows, cols, sk2, _ = _search(fine_x, fine_y, cand, eps, fine_budget, B, kernel)
    levels.append(((fine_x, fine_y), sk2))
    csr = {"xy": _csr(rows, cols, B * Tx), "yx": _csr(cols, rows, B * Ty)}
    stats = [lv[0] for lv in levels]
    skipped = [lv[1] for lv in levels]
    return Pattern(rows, cols, csr, eps, stats, skipped)


def _csr(keys: torch.Tensor, vals: torch.Tensor, n_keys: int):
    """(rowptr (n_keys + 1,), vals sorted by key) as int32."""
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=n_keys)
    rowptr = torch.zeros(n_keys + 1, dtype=torch.int64, device=keys.device)
    rowptr[1:] = counts.cumsum(0)
    return rowptr.to(torch.int32), vals[order].to(torch.int32).contiguous()
