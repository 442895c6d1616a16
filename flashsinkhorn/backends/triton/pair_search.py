"""The tile-pair search of the multiscale pattern as one Triton kernel (two launches per level).

``flashsinkhorn.multiscale.bounds._search`` evaluates, for every candidate pair of tiles, the
log bound of the plan's mass on the pair, histograms the bounds to find the skipping threshold,
then selects the pairs to keep. In torch operations each candidate costs some forty float64
temporaries (about 0.5 KB): at 1M points a pattern took about 90 ms on an H100, several times
per solve. Here one program evaluates a block of pairs in registers:

* a block is a [BR, BC] grid of (row tile, column tile) pairs of one problem: a kept super
  pair's SUPER × SUPER tiles (``INSIDE``), or a block of the all-pairs grid;
* pass 1 adds each pair's bound to its histogram bin (float64 atomics; the common bin of the
  bounds below the histogram's range is summed in the block first) and raises each row and
  column tile's best pair (float32 atomic maximum of the bound without that tile's mass);
* pass 2 recomputes the same bounds, skips the pairs below the threshold that are no tile's
  best, adds the skipped bounds to the problem's sum and writes a keep flag per pair.

Both passes are one compiled kernel with a runtime pass flag, so that the bounds of pass 2
are bit for bit those of pass 1: the threshold taken from pass 1's histogram then bounds the
sum pass 2 skips (up to the rounding of float64 sums that ``bounds.ROUNDING_MARGIN`` covers).
The arithmetic is that of ``bounds.pair_exponent`` in float64 (the torch oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, launch

#: Super pairs per pass-2 launch (INSIDE): bounds the keep flags held at once to
#: 2^16 · 256 bytes = 16 MiB.
PASS2_PAIRS = 1 << 16
#: Largest float32 magnitude a finite float64 bound is clamped to before the float32 maximum
#: (a finite bound must stay finite there, or its tile could lose its best pair).
F32_BIG = tl.constexpr(3.0e38)
PAIR_CONFIG = {"num_warps": 4, "num_stages": 1}


@triton.jit
def _box_corner(s, lo, hi):
    """max over [lo, hi] of s·y, one axis."""
    return tl.maximum(s * lo, s * hi)


@triton.jit
def _box_quad(u, zlo, zhi):
    """max over [zlo, zhi] of u·z − z², one axis (at u/2 clamped to the box)."""
    z = tl.minimum(tl.maximum(0.5 * u, zlo), zhi)
    return u * z - z * z


@triton.jit
def _stats(LO, HI, U, ALPHA, LOGM, o, m):
    """A side's tile statistics at tile offsets ``o`` (masked by ``m``): box, slope, α, log mass."""
    lo0 = tl.load(LO + o * 3, mask=m, other=0.0)
    lo1 = tl.load(LO + o * 3 + 1, mask=m, other=0.0)
    lo2 = tl.load(LO + o * 3 + 2, mask=m, other=0.0)
    hi0 = tl.load(HI + o * 3, mask=m, other=0.0)
    hi1 = tl.load(HI + o * 3 + 1, mask=m, other=0.0)
    hi2 = tl.load(HI + o * 3 + 2, mask=m, other=0.0)
    u0 = tl.load(U + o * 3, mask=m, other=0.0)
    u1 = tl.load(U + o * 3 + 1, mask=m, other=0.0)
    u2 = tl.load(U + o * 3 + 2, mask=m, other=0.0)
    al = tl.load(ALPHA + o, mask=m, other=float("-inf"))
    lm = tl.load(LOGM + o, mask=m, other=float("-inf"))
    return lo0, lo1, lo2, hi0, hi1, hi2, u0, u1, u2, al, lm


@triton.jit
def _finite_or_ninf(t):
    return tl.where(t != t, float("-inf"), t)


# fmt: off
# one binary for both passes (a pass flag or offset of 1 or a multiple of 16 would otherwise
# compile a specialised copy, whose bounds could round differently)
@triton.jit(do_not_specialize=["p0", "pass_two"])
def _pair_search_kernel(
    R_LO, R_HI, R_U, R_ALPHA, R_LOGM,  # row side: (B·Tr, 3) float64 boxes, slopes; (B·Tr,) α, log mass
    C_LO, C_HI, C_U, C_ALPHA, C_LOGM,  # column side, (B·Tc, ...)
    SB, SI, SJ,                        # INSIDE: (P,) int64 problem, super row, super column
    HIST,                              # (B·NB,) float64 bin sums (pass 1)
    BEST_R, BEST_C,                    # (B·Tr,), (B·Tc,) float32 best bounds (pass 1 raises)
    CUT, SKIPPED, KEEP,                # pass 2: (B,) int64 first kept bin, (B,) float64, int8 flags
    PARAMS,                            # (2,) float64: eps, lowest histogram edge
    p0, Tr, Tc, pass_two,
    NB: tl.constexpr, LOG_BINS: tl.constexpr, INV_BIN: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, INSIDE: tl.constexpr,
):
    # float64 scalars through memory: a Python float argument is passed as float32
    eps = tl.load(PARAMS)
    lo = tl.load(PARAMS + 1)
    i_p = tl.program_id(0)
    o_r = tl.arange(0, BR)
    o_c = tl.arange(0, BC)
    if INSIDE:
        p = p0 + i_p
        i_b = tl.load(SB + p)
        i_r = tl.load(SI + p) * BR + o_r
        i_c = tl.load(SJ + p) * BC + o_c
        # flags of this launch's pairs, pair-major
        o_keep = i_p.to(tl.int64) * (BR * BC) + o_r[:, None] * BC + o_c[None, :]
    else:
        i_b = tl.program_id(2).to(tl.int64)
        i_r = tl.program_id(0) * BR + o_r
        i_c = tl.program_id(1) * BC + o_c
        o_keep = (i_b * Tr + i_r[:, None]) * Tc + i_c[None, :]
    m_r = i_r < Tr
    m_c = i_c < Tc
    m = m_r[:, None] & m_c[None, :]
    g_r = i_b * Tr + i_r
    g_c = i_b * Tc + i_c
    rlo0, rlo1, rlo2, rhi0, rhi1, rhi2, u0, u1, u2, r_al, r_lm = _stats(
        R_LO, R_HI, R_U, R_ALPHA, R_LOGM, g_r, m_r)
    clo0, clo1, clo2, chi0, chi1, chi2, v0, v1, v2, c_al, c_lm = _stats(
        C_LO, C_HI, C_U, C_ALPHA, C_LOGM, g_c, m_c)
    # E = α + β + min(e1, e2) as bounds.pair_exponent, rows along axis 0
    s0 = u0[:, None] + v0[None, :]
    s1 = u1[:, None] + v1[None, :]
    s2 = u2[:, None] + v2[None, :]
    zl0 = rlo0[:, None] - chi0[None, :]
    zl1 = rlo1[:, None] - chi1[None, :]
    zl2 = rlo2[:, None] - chi2[None, :]
    zh0 = rhi0[:, None] - clo0[None, :]
    zh1 = rhi1[:, None] - clo1[None, :]
    zh2 = rhi2[:, None] - clo2[None, :]
    e1 = (_box_corner(s0, clo0[None, :], chi0[None, :])
          + _box_corner(s1, clo1[None, :], chi1[None, :])
          + _box_corner(s2, clo2[None, :], chi2[None, :]))
    e1 += (_box_quad(u0[:, None], zl0, zh0) + _box_quad(u1[:, None], zl1, zh1)
           + _box_quad(u2[:, None], zl2, zh2))
    e2 = (_box_corner(s0, rlo0[:, None], rhi0[:, None])
          + _box_corner(s1, rlo1[:, None], rhi1[:, None])
          + _box_corner(s2, rlo2[:, None], rhi2[:, None]))
    e2 += (_box_quad(-v0[None, :], zl0, zh0) + _box_quad(-v1[None, :], zl1, zh1)
           + _box_quad(-v2[None, :], zl2, zh2))
    e = (r_al[:, None] + c_al[None, :] + tl.minimum(e1, e2)) / eps
    b_lb = _finite_or_ninf(r_lm[:, None] + c_lm[None, :] + e)
    b_lb = tl.where(m, b_lb, float("-inf"))
    # histogram bin: 0 for a zero bound, 1 below lo, 2 + k in range, LOG_BINS + 2 from the budget
    q = tl.minimum(tl.maximum(tl.floor((b_lb - lo) * INV_BIN), -1.0), LOG_BINS * 1.0) + 2.0
    b_bin = tl.where(b_lb == float("-inf"), 0, tl.where(q != q, 0, q.to(tl.int32)))
    b_w = tl.exp(b_lb)
    # each tile's best pair, ranked by the bound without the tile's own mass (tiles of
    # zero-weight points), in float32 with finite bounds kept finite
    b_lr = tl.where(m, _finite_or_ninf(c_lm[None, :] + e), float("-inf"))
    b_lc = tl.where(m, _finite_or_ninf(r_lm[:, None] + e), float("-inf"))
    f_lr = tl.where(b_lr == float("-inf"), b_lr, tl.maximum(b_lr, -F32_BIG)).to(tl.float32)
    f_lc = tl.where(b_lc == float("-inf"), b_lc, tl.maximum(b_lc, -F32_BIG)).to(tl.float32)
    if pass_two == 0:
        tl.atomic_max(BEST_R + g_r, tl.max(f_lr, 1), mask=m_r)
        tl.atomic_max(BEST_C + g_c, tl.max(f_lc, 0), mask=m_c)
        # most candidates fall below the histogram's range: one atomic for the block's sum
        below = tl.sum(tl.sum(tl.where(b_bin == 1, b_w, 0.0), 1), 0)
        tl.atomic_add(HIST + i_b * NB + 1, below)
        # bounds above the budget (last bin) never enter the threshold: not added
        m_in = (b_bin >= 2) & (b_bin < NB - 1)
        tl.atomic_add(HIST + i_b * NB + b_bin, b_w, mask=m_in)
    else:
        best_r = tl.load(BEST_R + g_r, mask=m_r, other=float("inf"))
        best_c = tl.load(BEST_C + g_c, mask=m_c, other=float("inf"))
        best = ((f_lr == best_r[:, None]) & (b_lr > float("-inf"))) | (
            (f_lc == best_c[None, :]) & (b_lc > float("-inf")))
        cut = tl.load(CUT + i_b).to(tl.int32)
        skip = m & (b_bin < cut) & (best == 0)
        tl.atomic_add(SKIPPED + i_b, tl.sum(tl.sum(tl.where(skip, b_w, 0.0), 1), 0))
        tl.store(KEEP + o_keep, (m & (skip == 0)).to(tl.int8), mask=m)
# fmt: on


def _stat_args(S) -> list[torch.Tensor]:
    return [S.lo.contiguous(), S.hi.contiguous(), S.u.contiguous(), S.alpha.contiguous(),
            S.logm.contiguous()]  # fmt: skip


def search(R, C, inside, eps: float, budget: float, B: int, lo: float, log_bins: int,
           log_bin: float, rounding_margin: float, idx_dtype):  # fmt: skip
    """The kernel version of ``bounds._search`` (same arguments and returns).

    Args:
        R, C: ``bounds.TileStats`` of the rows and columns (float64, on a CUDA device or under
            the interpreter).
        inside: None for all (problem, row tile, column tile) triples, else the kept super
            pairs (b, i, j) and their size (``SUPER``), whose tiles are the candidates.
        eps, budget, B: as ``bounds._search``.
        lo: the histogram's lowest edge (log(budget) − log_bins · log_bin).
        log_bins, log_bin, rounding_margin: ``bounds.LOG_BINS``, ``LOG_BIN``,
            ``ROUNDING_MARGIN``.
        idx_dtype: dtype of the returned tile indices.

    Returns:
        (rows, cols, skipped, cut) as ``bounds._search``.
    """
    dev = R.alpha.device
    Tr, Tc = R.alpha.shape[1], C.alpha.shape[1]
    nb = log_bins + 3
    hist = torch.zeros(B * nb, dtype=torch.float64, device=dev)
    best_r = torch.full((B * Tr,), -torch.inf, dtype=torch.float32, device=dev)
    best_c = torch.full((B * Tc,), -torch.inf, dtype=torch.float32, device=dev)
    skipped = torch.zeros(B, dtype=torch.float64, device=dev)
    stats = _stat_args(R) + _stat_args(C)
    params = torch.tensor([eps, lo], dtype=torch.float64, device=dev)
    consts = dict(NB=nb, LOG_BINS=log_bins, INV_BIN=1.0 / log_bin, **PAIR_CONFIG, **FP_FUSION)
    if inside is None:
        BR = BC = 16
        grid = (cdiv(Tr, BR), cdiv(Tc, BC), B)
        dummy = torch.zeros(1, dtype=torch.int64, device=dev)
        sb = si = sj = dummy
    else:
        sb, si, sj, size = inside
        BR = BC = size
        sb, si, sj = sb.long().contiguous(), si.long().contiguous(), sj.long().contiguous()

    def run(grid, keep, p0, cut, pass_two):
        launch(_pair_search_kernel, grid, *stats, sb, si, sj, hist, best_r, best_c, cut,
               skipped, keep, params, p0, Tr, Tc, pass_two,
               BR=BR, BC=BC, INSIDE=inside is not None, **consts)  # fmt: skip

    no_keep = torch.zeros(1, dtype=torch.int8, device=dev)
    no_cut = torch.zeros(B, dtype=torch.int64, device=dev)
    P = 0 if inside is None else sb.numel()
    if inside is None:
        run(grid, no_keep, 0, no_cut, 0)
    elif P > 0:
        run((P,), no_keep, 0, no_cut, 0)
    cap = budget * (1.0 - rounding_margin)
    below = hist.view(B, nb).cumsum(1)[:, :-1] <= cap
    cut = below.long().cumprod(1).sum(1).contiguous()
    if inside is None:
        keep = torch.empty(B * Tr * Tc, dtype=torch.int8, device=dev)
        run(grid, keep, 0, cut, 1)
        k = keep.nonzero().squeeze(1)
        b, r = k // (Tr * Tc), k % (Tr * Tc)
        rows, cols = b * Tr + r // Tc, b * Tc + r % Tc
    else:
        rows, cols = [], []
        for p0 in range(0, P, PASS2_PAIRS):
            n = min(PASS2_PAIRS, P - p0)
            keep = torch.empty(n * BR * BC, dtype=torch.int8, device=dev)
            run((n,), keep, p0, cut, 1)
            k = keep.nonzero().squeeze(1)
            p, r = k // (BR * BC) + p0, k % (BR * BC)
            b = sb[p]
            rows.append(b * Tr + si[p] * BR + r // BC)
            cols.append(b * Tc + sj[p] * BC + r % BC)
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        rows, cols = torch.cat([empty, *rows]), torch.cat([empty, *cols])
    return rows.to(idx_dtype), cols.to(idx_dtype), skipped, cut
