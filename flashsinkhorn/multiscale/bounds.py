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

The pattern skips the largest set of pairs of smallest bounds whose bounds sum to at most a
budget (a fraction of ``tol``; one sort of the candidates): the mass of the true plan outside
the pattern is then provably below that budget, and its exact sum of bounds is recorded.
The search runs on super tiles first (``SUPER`` tiles), whose bounds dominate the
sums of their tiles' bounds, then on the tiles of the super pairs it keeps.

When the potentials move, each skipped pair's bound moves by (Δα_I + Δβ_J)/eps with the slopes
kept fixed: :meth:`Pattern.skipped_bound` re-evaluates the total from the tiles' new α and β in
O(n), without visiting the skipped pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .clustering import SUPER, TILE, Layout

#: Pair bounds evaluated at once (memory ~ 40 float64 values per pair).
PAIR_CHUNK = 1 << 22


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
        rows, cols: (P,) int64 global tile indices (problem · tiles + tile) of the kept pairs
            (x tiles and y tiles of the problem the pattern was built for).
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


def _keep_best(lb: torch.Tensor, key: torch.Tensor, n_keys: int) -> torch.Tensor:
    """(P,) True for each key's pairs of the largest finite bound (so that every tile with
    mass visits at least one tile and its soft-min stays finite)."""
    best = torch.full((n_keys,), -math.inf, dtype=lb.dtype, device=lb.device)
    best.scatter_reduce_(0, key, lb, "amax")
    return (lb == best[key]) & torch.isfinite(lb)


def _smallest_within(lb: torch.Tensor, b: torch.Tensor, B: int, budget: float) -> torch.Tensor:
    """(P,) True for the pairs of smallest bound whose bounds sum to at most ``budget`` in
    each problem: the skippable set of largest size (sorted by bound, a running sum per
    problem)."""
    order = torch.argsort(lb)
    order = order[torch.argsort(b[order], stable=True)]  # by problem, then by bound
    # Bounds above the budget are never skipped: capping them keeps the running sums (one
    # cumsum over all problems, differenced per problem) free of the cancellation that huge
    # kept bounds of one problem would cause in the next.
    run = torch.exp(lb[order]).clamp_max(max(2.0 * budget, 1e-300)).cumsum(0)
    counts = torch.bincount(b, minlength=B)
    ends = counts.cumsum(0)
    before = torch.cat([run.new_zeros(1), run])[ends - counts]  # running sum before each
    within = run - before[b[order]] <= budget
    out = torch.zeros_like(within)
    out[order] = within
    return out


def _search(R: TileStats, C: TileStats, b, i, j, eps, budget, B, Tr, Tc):
    """Evaluates the candidate pairs in chunks; returns the kept (b, i, j) and the (B,) sums
    of the skipped bounds (<= ``budget`` per problem)."""
    skipped = torch.zeros(B, dtype=torch.float64, device=b.device)
    es = [pair_exponent(R, C, b[s : s + PAIR_CHUNK], i[s : s + PAIR_CHUNK], j[s : s + PAIR_CHUNK])
          for s in range(0, b.numel(), PAIR_CHUNK)]  # fmt: skip
    e = torch.cat(es) / eps if es else torch.zeros(0, dtype=torch.float64, device=b.device)
    lmr, lmc = R.logm[b, i], C.logm[b, j]
    lb = _finite_or_ninf(lmr + lmc + e)
    # the best pair of each row tile and of each column tile, by the bound without the row
    # (column) mass: tiles of zero-weight points still get a finite soft-min
    lr = _finite_or_ninf(lmc + e)
    lc = _finite_or_ninf(lmr + e)
    keep = ~_smallest_within(lb, b, B, budget)
    keep |= _keep_best(lr, b * Tr + i, B * Tr) | _keep_best(lc, b * Tc + j, B * Tc)
    skipped.index_add_(0, b[~keep], torch.exp(lb[~keep]))
    return b[keep], i[keep], j[keep], skipped


def build_pattern(
    lx: Layout, ly: Layout, f: torch.Tensor, g: torch.Tensor, eps: float, budget: float,
    self_problem: bool = False,
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
        b, i, j = _all_pairs(B, Sx, Sy, dev)
        b, i, j, sk1 = _search(sup_x, sup_y, b, i, j, eps, 0.5 * budget, B, Sx, Sy)
        levels.append(((sup_x, sup_y), sk1))
        # every tile pair inside the kept super pairs
        a = torch.arange(SUPER, device=dev)
        i = (i[:, None, None] * SUPER + a[None, :, None]).expand(-1, SUPER, SUPER).reshape(-1)
        j = (j[:, None, None] * SUPER + a[None, None, :]).expand(-1, SUPER, SUPER).reshape(-1)
        b = b[:, None].expand(-1, SUPER * SUPER).reshape(-1)
        fine_budget = 0.5 * budget
    else:
        b, i, j = _all_pairs(B, Tx, Ty, dev)
        fine_budget = budget
    b, i, j, sk2 = _search(fine_x, fine_y, b, i, j, eps, fine_budget, B, Tx, Ty)
    levels.append(((fine_x, fine_y), sk2))
    rows, cols = b * Tx + i, b * Ty + j
    csr = {"xy": _csr(rows, cols, B * Tx), "yx": _csr(cols, rows, B * Ty)}
    stats = [lv[0] for lv in levels]
    skipped = [lv[1] for lv in levels]
    return Pattern(rows, cols, csr, eps, stats, skipped)


def _all_pairs(B: int, Tr: int, Tc: int, dev):
    b = torch.arange(B, device=dev).repeat_interleave(Tr * Tc)
    i = torch.arange(Tr, device=dev).repeat_interleave(Tc).repeat(B)
    j = torch.arange(Tc, device=dev).repeat(B * Tr)
    return b, i, j


def _csr(keys: torch.Tensor, vals: torch.Tensor, n_keys: int):
    """(rowptr (n_keys + 1,), vals sorted by key) as int32."""
    order = torch.argsort(keys, stable=True)
    counts = torch.bincount(keys, minlength=n_keys)
    rowptr = torch.zeros(n_keys + 1, dtype=torch.int64, device=keys.device)
    rowptr[1:] = counts.cumsum(0)
    return rowptr.to(torch.int32), vals[order].to(torch.int32).contiguous()
