"""Block-sparse online-LSE kernels of the multiscale path (flashsinkhorn/multiscale/).

One program owns one row tile of TILE sorted points and visits only the column tiles of its
CSR list. Coordinates are taken relative to the row tile's first point o (ξ_i = x_i − o,
η_j = y_j − o), so that the expansion of the squared distance cancels only the digits of the
pair's own extent, and the base-2 score is split as

    h_j − s‖ξ_i − η_j‖² = (h_j − s‖η_j‖²) + 2s ξ_i·η_j − s‖ξ_i‖²,     s = log2(e)/eps:

the first term is formed once per visited column (TILE values per tile pair), the last is
constant along a row and is added after the log-sum-exp, and each score costs three FMAs
(seven operations with the direct difference form). The loads of the next column tile are
issued before the current tile's scores are computed (software pipelining by hand: the CSR
indirection defeats Triton's pipeliner, and with two programs per SM the exposed latency of
the dependent loads cost about a third of the kernel's time).

Two kernels share that layout:

* ``_lse_sparse_fwd_kernel``: a running (max, sum) per score slot; exact for any scores, and
  with BARY it also accumulates the softmax-weighted column offsets η_j (the barycentres of
  the plan's rows, for gradients).
* ``_lse_sparse_shift_kernel``: the row's log-sum-exp is expected near a given shift (the
  previous iterate's), so each score costs one exp2 of (score − shift) and one add, without
  a running maximum: about six instructions instead of eleven, bound by the exp2 unit. A row
  whose sum leaves [2⁻⁶⁰, 2¹⁰⁰] (shift too far from the result, or no mass met) is flagged
  per tile, and ``_lse_sparse_fwd_kernel`` run in GUARDED mode recomputes exactly those tiles
  (the other programs exit after one load), so the result never depends on the shift's
  quality, only the time does.

Memory traffic is O(visited tiles · TILE) per row tile; nothing of size n × m exists. The
torch oracle is ``flashsinkhorn.multiscale.sparse_torch.sparse_lse``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, launch

LOG2E = 1.4426950408889634
#: Initial running maximum of a score slot: the lowest finite float32. No finite score lies
#: below it (the range checks admit scores up to about FLT_MAX/256 in size, so no smaller
#: stand-in is safe), and as it is finite a massless column's −inf score only subtracts to
#: −inf (weight 0), never −inf − −inf.
NEG = -3.4028234663852886e38
#: Accepted range of a row's shifted sum in the shift kernel. Above 2⁻⁶⁰ the terms that the
#: flush-to-zero exp2 drops (each below 2⁻¹²⁶) are a relative 2⁻⁶⁶ per term of the sum; below
#: 2¹⁰⁰ no slot is near overflow.
SHIFT_SUM_MIN = 2.0**-60
SHIFT_SUM_MAX = 2.0**100

#: Launch configurations (warps per program; the loads are pipelined by hand). H100, 1M-point
#: surfaces, 3·10¹⁰ scores per half-step: the exact kernel 1.95·10¹² scores/s with 4 warps,
#: 1.88 with 8; the shift kernel 2.37 with 4 and 2.74 with 8 (16 accumulators per thread
#: instead of 32: two programs per SM).
SPARSE_CONFIG = {"num_warps": 4, "num_stages": 1}
SHIFT_CONFIG = {"num_warps": 8, "num_stages": 1}


@triton.jit
def _column_tile(XC, HC, COLS, k, i_end, n_col, o_t, b_o0, b_o1, b_o2, TILE: tl.constexpr):
    """Offsets η (3 × [TILE]) and bias h of the column tile at CSR position k (tile 0 for a
    k past the row's list: a harmless in-bounds load that is never used)."""
    i_c = tl.load(COLS + k, mask=k < i_end, other=0)
    o_c = i_c.to(tl.int64) * TILE + o_t
    b_e0 = tl.load(XC + o_c) - b_o0
    b_e1 = tl.load(XC + n_col + o_c) - b_o1
    # (n_col added twice, not 2 · n_col: that product is int32 and overflows from 2^30)
    b_e2 = tl.load(XC + n_col + n_col + o_c) - b_o2
    b_h = tl.load(HC + o_c)
    return b_e0, b_e1, b_e2, b_h


@triton.jit
def _first_tile(ROWPTR, XC, HC, COLS, i_r, n_col, o_t, b_o0, b_o1, b_o2, TILE: tl.constexpr):
    """CSR range [i_start, i_end) of row tile i_r and the loads of its first column tile."""
    i_start = tl.load(ROWPTR + i_r)
    i_end = tl.load(ROWPTR + i_r + 1)
    n_e0, n_e1, n_e2, n_h = _column_tile(XC, HC, COLS, i_start, i_end, n_col, o_t,
                                         b_o0, b_o1, b_o2, TILE)  # fmt: skip
    return i_start, i_end, n_e0, n_e1, n_e2, n_h


@triton.jit
def _advance(XC, HC, COLS, k, i_end, n_col, o_t, b_o0, b_o1, b_o2, n_e0, n_e1, n_e2, n_h, scale,
             TILE: tl.constexpr):  # fmt: skip
    """The column tile at CSR position k from its prefetched loads (n_*): offsets η and bias
    h − s‖η‖² (massless columns keep −inf); and the loads of the tile at k + 1."""
    b_h = n_h - (n_e0 * n_e0 + n_e1 * n_e1 + n_e2 * n_e2) * scale
    p_e0, p_e1, p_e2, p_h = _column_tile(XC, HC, COLS, k + 1, i_end, n_col, o_t,
                                         b_o0, b_o1, b_o2, TILE)  # fmt: skip
    return n_e0, n_e1, n_e2, b_h, p_e0, p_e1, p_e2, p_h


@triton.jit
def _row_tile(XR, i_r, o_t, scale, TILE: tl.constexpr):
    """Origin o, scaled offsets 2sξ (3 × [TILE]) and row constant −s‖ξ‖² of row tile i_r."""
    o_r = i_r * TILE + o_t
    p_o = XR + i_r * TILE * 3
    b_o0 = tl.load(p_o)
    b_o1 = tl.load(p_o + 1)
    b_o2 = tl.load(p_o + 2)
    b_x0 = tl.load(XR + o_r * 3) - b_o0
    b_x1 = tl.load(XR + o_r * 3 + 1) - b_o1
    b_x2 = tl.load(XR + o_r * 3 + 2) - b_o2
    b_rc = -(b_x0 * b_x0 + b_x1 * b_x1 + b_x2 * b_x2) * scale
    return (
        o_r,
        b_o0,
        b_o1,
        b_o2,
        b_x0 * (2.0 * scale),
        b_x1 * (2.0 * scale),
        b_x2 * (2.0 * scale),
        b_rc,
    )


# fmt: off
@triton.jit
def _lse_sparse_fwd_kernel(
    XR, XC, HC, ROWPTR, COLS, LSE, BARY, FLAG,
    n_col, scale,
    TILE: tl.constexpr, BARY_OUT: tl.constexpr, GUARDED: tl.constexpr,
    NEG: tl.constexpr = -3.4028234663852886e38,
):
    # XR: (R·TILE, 3) row points; XC: (3, n_col) column coordinates (one row per axis);
    # HC: (n_col,) column bias in base 2 (−inf: no mass); ROWPTR: (R + 1,) int32;
    # COLS: (P,) int32 column tiles; LSE: (R·TILE,) natural log-sum-exp;
    # BARY: (R·TILE, 3) softmax-weighted column points; FLAG: (R,) int32, with GUARDED only
    # the tiles whose flag is non-zero are computed. scale = log2(e) / eps.
    i_r = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, TILE)
    if GUARDED:
        if tl.load(FLAG + i_r) == 0:
            return
    o_r, b_o0, b_o1, b_o2, b_q0, b_q1, b_q2, b_rc = _row_tile(XR, i_r, o_t, scale, TILE)
    i_start, i_end, n_e0, n_e1, n_e2, n_h = _first_tile(ROWPTR, XC, HC, COLS, i_r, n_col, o_t,
                                                        b_o0, b_o1, b_o2, TILE)
    # Running (max, sum) per score slot (i, j mod TILE), not per row: a visited tile updates
    # each slot with one exp2 of −|z − m| (whichever of z and m is larger becomes the new m)
    # and no cross-thread reduction; the TILE slots of a row are merged once at the end.
    # Row-wise online maxima cost two reductions (max, sum) per tile, which took about nine
    # tenths of the kernel's time (H100, 1M points: 4e11 scores/s).
    b_m = tl.full([TILE, TILE], NEG, tl.float32)
    b_l = tl.zeros([TILE, TILE], tl.float32)
    b_a0 = tl.zeros([TILE, TILE], tl.float32)
    b_a1 = tl.zeros([TILE, TILE], tl.float32)
    b_a2 = tl.zeros([TILE, TILE], tl.float32)
    for k in range(i_start, i_end):
        # (massless columns keep their −inf bias: the slot maxima stay finite, NEG at first,
        # so their difference is −inf and the weight 0)
        b_e0, b_e1, b_e2, b_h, n_e0, n_e1, n_e2, n_h = _advance(
            XC, HC, COLS, k, i_end, n_col, o_t, b_o0, b_o1, b_o2, n_e0, n_e1, n_e2, n_h, scale,
            TILE)
        # (TILE, TILE) base-2 scores without the row constant
        b_z = b_h[None, :] + b_q0[:, None] * b_e0[None, :]
        b_z = b_z + b_q1[:, None] * b_e1[None, :]
        b_z = b_z + b_q2[:, None] * b_e2[None, :]
        b_d = b_z - b_m
        b_w = tl.exp2(-tl.abs(b_d))
        up = b_d > 0.0
        b_l = tl.where(up, b_l * b_w + 1.0, b_l + b_w)
        if BARY_OUT:
            b_a0 = tl.where(up, b_a0 * b_w + b_e0[None, :], b_a0 + b_w * b_e0[None, :])
            b_a1 = tl.where(up, b_a1 * b_w + b_e1[None, :], b_a1 + b_w * b_e1[None, :])
            b_a2 = tl.where(up, b_a2 * b_w + b_e2[None, :], b_a2 + b_w * b_e2[None, :])
        b_m = tl.where(up, b_z, b_m)
    # merge the slots of each row
    m_row = tl.max(b_m, 1)
    b_w = tl.exp2(b_m - m_row[:, None])
    l_row = tl.sum(b_l * b_w, 1)
    # a row that met only massless columns (or nothing) has a zero sum: no mass
    live = l_row > 0.0
    b_lse = (m_row + tl.log2(tl.where(live, l_row, 1.0)) + b_rc) * 0.6931471805599453
    tl.store(LSE + o_r, tl.where(live, b_lse, float("-inf")))
    if BARY_OUT:
        b_inv = 1.0 / tl.where(live, l_row, 1.0)
        tl.store(BARY + o_r * 3, b_o0 + tl.sum(b_a0 * b_w, 1) * b_inv)
        tl.store(BARY + o_r * 3 + 1, b_o1 + tl.sum(b_a1 * b_w, 1) * b_inv)
        tl.store(BARY + o_r * 3 + 2, b_o2 + tl.sum(b_a2 * b_w, 1) * b_inv)


@triton.jit
def _lse_sparse_shift_kernel(
    XR, XC, HC, ROWPTR, COLS, SHIFT, LSE, FLAG,
    n_col, scale,
    TILE: tl.constexpr, SUM_MIN: tl.constexpr, SUM_MAX: tl.constexpr,
):
    # As _lse_sparse_fwd_kernel, with SHIFT: (R·TILE,) the expected base-2 log-sum-exp of
    # each row (row constant included); FLAG: (R,) int32, set to 1 for a tile that visits
    # columns and has a row whose shifted sum left [SUM_MIN, SUM_MAX] (its LSE is then
    # recomputed by the guarded kernel).
    i_r = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, TILE)
    o_r, b_o0, b_o1, b_o2, b_q0, b_q1, b_q2, b_rc = _row_tile(XR, i_r, o_t, scale, TILE)
    i_start, i_end, n_e0, n_e1, n_e2, n_h = _first_tile(ROWPTR, XC, HC, COLS, i_r, n_col, o_t,
                                                        b_o0, b_o1, b_o2, TILE)
    # shift of the scores without the row constant; a non-finite shift is caught by the
    # range test of the sum
    b_u = tl.load(SHIFT + o_r) - b_rc
    b_l = tl.zeros([TILE, TILE], tl.float32)
    for k in range(i_start, i_end):
        b_e0, b_e1, b_e2, b_h, n_e0, n_e1, n_e2, n_h = _advance(
            XC, HC, COLS, k, i_end, n_col, o_t, b_o0, b_o1, b_o2, n_e0, n_e1, n_e2, n_h, scale,
            TILE)
        b_z = b_h[None, :] - b_u[:, None]
        b_z = b_z + b_q0[:, None] * b_e0[None, :]
        b_z = b_z + b_q1[:, None] * b_e1[None, :]
        b_z = b_z + b_q2[:, None] * b_e2[None, :]
        b_l += tl.exp2(b_z)
    l_row = tl.sum(b_l, 1)
    # (NaN fails both comparisons)
    ok = (l_row >= SUM_MIN) & (l_row <= SUM_MAX)
    b_lse = (b_u + tl.log2(tl.where(ok, l_row, 1.0)) + b_rc) * 0.6931471805599453
    # a row tile without visited tiles has no mass (−inf), like the exact kernel's, unflagged
    tl.store(LSE + o_r, tl.where(ok, b_lse, float("-inf")))
    n_bad = tl.sum(tl.where(ok, 0, 1), 0)
    tl.store(FLAG + i_r, ((n_bad > 0) & (i_end > i_start)).to(tl.int32))
# fmt: on


def sparse_lse(
    xr: torch.Tensor,
    xc: torch.Tensor,
    hc: torch.Tensor,
    rowptr: torch.Tensor,
    cols: torch.Tensor,
    eps: float,
    bary: bool = False,
    tile: int = 64,
    xc_axes: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launches the block-sparse LSE kernels (float32).

    Args:
        xr: (R·tile, 3) float32 row points.
        xc: (Cn·tile, 3) float32 column points.
        hc: (Cn·tile,) float32 column bias (potential / eps + log-weight, natural log).
        rowptr: (R + 1,) int32 CSR offsets.
        cols: (P,) int32 visited column tiles.
        eps: entropic regularisation.
        bary: also return the softmax-weighted column points.
        tile: points per tile (a power of two).
        xc_axes: ``xc.t().contiguous()`` if the caller keeps it (the kernels read the column
            coordinates one axis at a time, in coalesced rows); built here when None.
        shift: (R·tile,) an estimate of the result L (natural log; the previous iterate's, for
            instance), or None. With it the rows run through the shift kernel (about twice
            as fast) and the tiles whose estimate was too far off are recomputed exactly; not
            used with ``bary``.

    Returns:
        ``(L (R·tile,), barycentres (R·tile, 3) or None)`` as ``sparse_torch.sparse_lse``
        with the column points as values.
    """
    R = xr.shape[0] // tile
    lse = torch.empty(xr.shape[0], dtype=torch.float32, device=xr.device)
    out = torch.empty_like(xr) if bary else lse
    h2 = (hc * LOG2E).contiguous()
    axes = xc.t().contiguous() if xc_axes is None else xc_axes
    if R == 0:
        return lse, (out if bary else None)
    n_col, scale = xc.shape[0], LOG2E / eps
    if shift is None or bary:
        launch(_lse_sparse_fwd_kernel, (R,),
               xr, axes, h2, rowptr, cols, lse, out, rowptr, n_col, scale,
               TILE=tile, BARY_OUT=bary, GUARDED=False, **SPARSE_CONFIG, **FP_FUSION)  # fmt: skip
        return lse, (out if bary else None)
    flag = torch.empty(R, dtype=torch.int32, device=xr.device)
    s2 = (shift.to(torch.float32) * LOG2E).contiguous()
    launch(_lse_sparse_shift_kernel, (R,),
           xr, axes, h2, rowptr, cols, s2, lse, flag, n_col, scale,
           TILE=tile, SUM_MIN=SHIFT_SUM_MIN, SUM_MAX=SHIFT_SUM_MAX,
           **SHIFT_CONFIG, **FP_FUSION)  # fmt: skip
    launch(_lse_sparse_fwd_kernel, (R,),
           xr, axes, h2, rowptr, cols, lse, lse, flag, n_col, scale,
           TILE=tile, BARY_OUT=False, GUARDED=True, **SPARSE_CONFIG, **FP_FUSION)  # fmt: skip
    return lse, None
