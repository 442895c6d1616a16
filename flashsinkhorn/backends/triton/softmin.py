"""Streaming online-LSE soft-min kernels (paper Algorithms 1 and 3) and their launchers.

Each program owns BLOCK_M rows, sweeps all columns in BLOCK_N tiles, forms the biased
dot-product scores on chip and keeps a running (max, sum) in base 2, so the n × m score matrix
never reaches HBM. The epilogue fuses the schedule's averaging and the unbalanced damping:
out = alpha · old + beta · T. When the row blocks cannot fill the GPU the column sweep is split
(split.py) and ``_lse_combine_kernel`` merges the partial (max, sum). Derivation:
docs/kernels.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, launch, resident_blocks
from ...problem import Side
from .. import kernel_costs
from .configs import COMBINE_BLOCK, lse_config
from .operands import aligned_cols, cost_args, even_d, is_half, operands
from .split import pair_split, plan_split
from .tiles import (
    SQEUCLIDEAN,
    batch_base,
    col_bias,
    cost_scores,
    expm1,
    label_rows,
    label_tile,
    load_parts,
    log1p,
    online_lse,
    score_tile,
    softmin_epilogue,
)

#: Arguments not specialised on their value: n, m and every stride that depends on them change
#: between calls, and specialising on their divisibility would recompile for a new n or m at a
#: known d.
SOFTMIN_DYNAMIC = [
    "n_rows", "n_cols", "n_x", "n_y", "n_blocks_x", "s_rb", "s_cb", "s_vrb", "s_vcb", "s_xb",
    "s_yb", "s_fb", "s_gb", "s_ps", "s_pfs", "s_pgs", "cols_per_split", "cols_per_split_x",
    "cols_per_split_y", "n_split", "n_lab",
]  # fmt: skip


# Kernel argument lists are grouped by role (tensors, sizes, strides, scalars, constexprs), one
# group per line; the formatter would put one argument per line.
# fmt: off
@triton.jit
def _large_epilogue(
    b_max, b_sum, b_s1, b_tm, b_c1, Rsq, Rold, Out, Raw, Clogm, i_b64, o_vr, m_m,
    eps, alpha, beta, WRITE_RAW: tl.constexpr, COST: tl.constexpr,
):
    # Large eps (docs/precision.md): T_i = row term − c_i − eps (ln M + log1p(Σ w̄_j
    # expm1(t_ij))) where the row's scores spread by |t| <= 1; the online LSE elsewhere.
    b_row = tl.zeros_like(b_c1)
    if COST == SQEUCLIDEAN:
        b_row = tl.load(Rsq + o_vr, mask=m_m, other=0.0)
    b_plain = b_row - (eps * 0.6931471805599453) * (b_max + tl.log2(b_sum))
    b_exp = b_row - b_c1 - eps * (tl.load(Clogm + i_b64) + log1p(b_s1))
    b_t = tl.where(b_tm <= 1.0, b_exp, b_plain)
    b_out = beta * b_t + alpha * tl.load(Rold + o_vr, mask=m_m, other=0.0)
    tl.store(Out + o_vr, b_out, mask=m_m)
    if WRITE_RAW:
        tl.store(Raw + o_vr, b_t, mask=m_m)


@triton.jit
def _softmin_rows(
    R, C, Rsq, Csq, Clogw, Cpot, Rold, Out, Raw, Pmax, Psum, Rlab, Clab, Lcost, Rc1, Cwn, Clogm,
    i_b, i_m, i_s,
    n_rows, n_cols, d, cols_per_split, n_split, n_lab,
    s_rb, s_rn, s_cb, s_cn, s_vrb, s_vcb, s_ps,
    eps, alpha, beta, dot_scale, sq_floor, lscale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, WRITE_RAW: tl.constexpr,
    COST: tl.constexpr, LABELS: tl.constexpr, EVEN_D: tl.constexpr, LARGE: tl.constexpr,
    ALIGNED_V: tl.constexpr,
):
    # LARGE (eps >= Side.large_eps, never split): besides the online LSE, the sum
    # Σ_j w̄_j expm1(t_ij) of the scores in cost units about the row shift c_i (Rc1), t =
    # (v − c)/eps, with the normalised column weights w̄ (Cwn) and the largest |t|; the
    # epilogue uses it where the row's |t| <= 1 (docs/precision.md). Never compiled in
    # otherwise: the plain kernel's tile loop is unchanged.
    # Operands may be float16 points divided by a power of two: dot_scale = scale² restores
    # the dot product inside the score FMA.
    # Scores in base 2: z_ij = x_i·y_j · (2 log2e / eps) + h_j, with the column bias
    # h_j = (p_j − ‖y_j‖²) · log2e / eps + log2 w_j computed per tile from O(m) vectors.
    scale2 = 2.0 * 1.4426950408889634 * dot_scale / eps
    inv_eps2 = 1.4426950408889634 / eps
    i_b64 = i_b.to(tl.int64)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    o_d = tl.arange(0, BLOCK_D)
    # EVEN_D (d == BLOCK_D, one feature tile): no feature mask, so the tile loads vectorise.
    m_dd = (o_d < BLOCK_D) if EVEN_D else (o_d < d)
    # [BLOCK_M, BLOCK_D] row tile pointers; the column base of this problem
    p_r = batch_base(R, i_b64, s_rb, EVEN_D) + o_m.to(tl.int64)[:, None] * s_rn + o_d[None, :]
    p_c0 = batch_base(C, i_b64, s_cb, EVEN_D)
    b_r = tl.zeros([BLOCK_M, BLOCK_D], R.dtype.element_ty)  # placeholder when D_TILES > 1
    b_rl = b_r
    if D_TILES == 1:
        b_r, b_rl = load_parts(p_r, m_m[:, None] & m_dd[None, :], d, PRECISION)
    o_vr = i_b64 * s_vrb + o_m
    # Row-side operands of the cost tile, fixed over the column sweep.
    b_rsq = tl.zeros([BLOCK_M], tl.float32)
    if COST != SQEUCLIDEAN:
        b_rsq = tl.load(Rsq + o_vr, mask=m_m, other=0.0)
    if LABELS:
        b_lr, b_w0, b_w1 = label_rows(Rlab, Lcost, o_vr, m_m, n_lab, LABELS)

    # [BLOCK_M] running base-2 max and sum
    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    b_s1 = tl.zeros([BLOCK_M], tl.float32)
    b_tm = tl.zeros([BLOCK_M], tl.float32)
    b_c1 = b_s1
    if LARGE:
        b_c1 = tl.load(Rc1 + o_vr, mask=m_m, other=0.0)
    # With n_split > 1, this program sweeps one chunk of the columns (a multiple of BLOCK_N
    # wide) and leaves its partial (max, sum) for _lse_combine_kernel: more programs than row
    # blocks when n is too small to fill the GPU.
    # Chunks start at multiples of BLOCK_N (split.chunk). ALIGNED_V (operands.aligned_cols):
    # n_cols and the column vectors' batch stride are multiples of 16, written so that the
    # compiler sees it; the three column-vector loads of a tile then vectorise under a mask
    # that is uniform over each vector (sm_90, 256 x 64 tiles: 851 -> 793 instructions a tile).
    col_start = tl.multiple_of(i_s * cols_per_split, 16)
    col_stop = tl.minimum(col_start + cols_per_split, n_cols)
    s_v = s_vcb
    n_v = n_cols
    if ALIGNED_V:
        s_v = (s_vcb // 16) * 16
        n_v = (n_cols // 16) * 16
    for start_n in range(col_start, col_stop, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_v
        p_c = p_c0 + o_n.to(tl.int64)[:, None] * s_cn + o_d[None, :]
        # [BLOCK_M, BLOCK_N] dot tile
        b_s, _ = score_tile(
            p_r, p_c, m_m, m_n, m_dd, b_r, b_rl, o_d, d,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION,
        )
        o_vc = i_b64 * s_v + o_n
        b_h, b_csq = col_bias(Cpot, Csq, Clogw, o_vc, m_n, inv_eps2, COST)
        b_lab = b_s
        if LABELS:
            b_lab = label_tile(Lcost, b_lr, b_w0, b_w1, Clab, o_vc, m_m, m_n, n_lab, lscale,
                               LABELS)
        b_z, b_d = cost_scores(
            b_s, b_h, b_rsq, b_csq, b_lab, scale2, inv_eps2, dot_scale, sq_floor, COST, LABELS
        )
        b_new, b_alpha, b_ref = online_lse(b_max, b_sum, b_z)
        b_sum = b_sum * b_alpha + tl.sum(tl.exp2(b_z - b_ref[:, None]), 1)
        b_max = b_new
        if LARGE:
            # scores in cost units: 2 r·c + p − ‖c‖² (shifted), p − C otherwise, − labels
            b_p = tl.load(Cpot + o_vc, mask=m_n, other=0.0)
            if COST == SQEUCLIDEAN:
                b_v = b_s * (2.0 * dot_scale) + (b_p - b_csq)[None, :]
            else:
                b_v = b_p[None, :] - b_d
            if LABELS:
                b_v = b_v - b_lab
            b_t = (b_v - b_c1[:, None]) * (1.0 / eps)
            b_wn = tl.load(Cwn + o_vc, mask=m_n, other=0.0)
            b_live = b_wn[None, :] > 0.0
            b_s1 += tl.sum(tl.where(b_live, b_wn[None, :] * expm1(b_t), 0.0), 1)
            b_tm = tl.maximum(b_tm, tl.max(tl.where(b_live, tl.abs(b_t), 0.0), 1))

    # A run-time branch, not a constexpr: one compiled kernel serves every n and m.
    if n_split > 1:
        tl.store(Pmax + i_s * s_ps + o_vr, b_max, mask=m_m)
        tl.store(Psum + i_s * s_ps + o_vr, b_sum, mask=m_m)
    elif LARGE:
        _large_epilogue(
            b_max, b_sum, b_s1, b_tm, b_c1, Rsq, Rold, Out, Raw, Clogm, i_b64, o_vr, m_m,
            eps, alpha, beta, WRITE_RAW, COST,
        )
    else:
        softmin_epilogue(
            b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW, COST
        )


@triton.jit(do_not_specialize=SOFTMIN_DYNAMIC)
def _softmin_fwd_kernel(
    R, C, Rsq, Csq, Clogw, Cpot, Rold, Out, Raw, Pmax, Psum, Rlab, Clab, Lcost, Rc1, Cwn, Clogm,
    n_rows, n_cols, d, cols_per_split, n_split, n_lab,
    s_rb, s_rn, s_cb, s_cn, s_vrb, s_vcb, s_ps,
    eps, alpha, beta, dot_scale, sq_floor, lscale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, WRITE_RAW: tl.constexpr,
    COST: tl.constexpr, LABELS: tl.constexpr, EVEN_D: tl.constexpr, LARGE: tl.constexpr,
    ALIGNED_V: tl.constexpr,
):
    # grid (row blocks, B, column chunks)
    _softmin_rows(
        R, C, Rsq, Csq, Clogw, Cpot, Rold, Out, Raw, Pmax, Psum, Rlab, Clab, Lcost, Rc1, Cwn, Clogm,
        tl.program_id(1), tl.program_id(0), tl.program_id(2),
        n_rows, n_cols, d, cols_per_split, n_split, n_lab,
        s_rb, s_rn, s_cb, s_cn, s_vrb, s_vcb, s_ps,
        eps, alpha, beta, dot_scale, sq_floor, lscale,
        BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, WRITE_RAW, COST, LABELS, EVEN_D, LARGE,
        ALIGNED_V,
    )


@triton.jit(do_not_specialize=SOFTMIN_DYNAMIC + ["guarded"])
def _softmin_sym_kernel(
    X, Y, Xsq, Ysq, Xlogw, Ylogw, F, G, Fout, Gout, Fraw, Graw, PFmax, PFsum, PGmax, PGsum,
    Xlab, Ylab, XLc, YLc, Xc1, Yc1, Xwn, Ywn, Xlogm, Ylogm, Guard, guarded,
    n_x, n_y, d, n_blocks_x, cols_per_split_x, cols_per_split_y, n_split, n_lab,
    s_xb, s_xn, s_yb, s_yn, s_fb, s_gb, s_pfs, s_pgs,
    eps, alpha, beta_x, beta_y, dot_scale, sq_floor, lscale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, WRITE_RAW: tl.constexpr,
    COST: tl.constexpr, LABELS: tl.constexpr, EVEN_D: tl.constexpr, LARGE: tl.constexpr,
    ALIGNED_V: tl.constexpr,
):
    # One launch for both half-steps of a symmetric iteration: the first n_blocks_x programs
    # update f from the old g, the rest update g from the old f. guarded != 0: the fallback of
    # the plan step (plan.py), which does nothing unless the float flag at Guard is non-zero (a
    # run-time argument, so that the fallback reuses the compiled two-sweep kernel).
    i_m = tl.program_id(0)
    i_b = tl.program_id(1)
    i_s = tl.program_id(2)
    run = True
    if guarded != 0:
        run = tl.load(Guard) != 0.0
    if not run:
        pass
    elif i_m < n_blocks_x:
        _softmin_rows(
            X, Y, Xsq, Ysq, Ylogw, G, F, Fout, Fraw, PFmax, PFsum, Xlab, Ylab, XLc,
            Xc1, Ywn, Ylogm,
            i_b, i_m, i_s,
            n_x, n_y, d, cols_per_split_x, n_split, n_lab,
            s_xb, s_xn, s_yb, s_yn, s_fb, s_gb, s_pfs,
            eps, alpha, beta_x, dot_scale, sq_floor, lscale,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, WRITE_RAW, COST, LABELS, EVEN_D, LARGE,
            ALIGNED_V,
        )
    else:
        _softmin_rows(
            Y, X, Ysq, Xsq, Xlogw, F, G, Gout, Graw, PGmax, PGsum, Ylab, Xlab, YLc,
            Yc1, Xwn, Xlogm,
            i_b, i_m - n_blocks_x, i_s,
            n_y, n_x, d, cols_per_split_y, n_split, n_lab,
            s_yb, s_yn, s_xb, s_xn, s_gb, s_fb, s_pgs,
            eps, alpha, beta_y, dot_scale, sq_floor, lscale,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, WRITE_RAW, COST, LABELS, EVEN_D, LARGE,
            ALIGNED_V,
        )


@triton.jit
def _combine_rows(
    Pmax, Psum, Rsq, Rold, Out, Raw,
    i_b, i_m, n_rows, n_split, s_vrb, s_ps,
    eps, alpha, beta,
    BLOCK: tl.constexpr, WRITE_RAW: tl.constexpr, COST: tl.constexpr,
):
    o_m = i_m * BLOCK + tl.arange(0, BLOCK)
    m_m = o_m < n_rows
    o_vr = i_b.to(tl.int64) * s_vrb + o_m
    b_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for i_s in range(n_split):
        b_max = tl.maximum(b_max, tl.load(Pmax + i_s * s_ps + o_vr, mask=m_m, other=0.0))
    b_ref = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.zeros([BLOCK], tl.float32)
    for i_s in range(n_split):
        b_pm = tl.load(Pmax + i_s * s_ps + o_vr, mask=m_m, other=0.0)
        b_sum += tl.load(Psum + i_s * s_ps + o_vr, mask=m_m, other=0.0) * tl.exp2(b_pm - b_ref)
    softmin_epilogue(
        b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW, COST
    )


@triton.jit(do_not_specialize=SOFTMIN_DYNAMIC + ["guarded"])
def _lse_combine_kernel(
    PFmax, PFsum, Xsq, F, Fout, Fraw, PGmax, PGsum, Ysq, G, Gout, Graw, Guard, guarded,
    n_x, n_y, n_blocks_x, n_split,
    s_fb, s_gb, s_pfs, s_pgs,
    eps, alpha, beta_x, beta_y,
    BLOCK: tl.constexpr, WRITE_RAW: tl.constexpr, COST: tl.constexpr,
):
    # Merges the per-chunk (max, sum) of a split sweep; one launch serves both sides.
    # guarded: as in _softmin_sym_kernel.
    i_m = tl.program_id(0)
    i_b = tl.program_id(1)
    run = True
    if guarded != 0:
        run = tl.load(Guard) != 0.0
    if not run:
        pass
    elif i_m < n_blocks_x:
        _combine_rows(
            PFmax, PFsum, Xsq, F, Fout, Fraw, i_b, i_m, n_x, n_split, s_fb, s_pfs,
            eps, alpha, beta_x, BLOCK, WRITE_RAW, COST,
        )
    else:
        _combine_rows(
            PGmax, PGsum, Ysq, G, Gout, Graw, i_b, i_m - n_blocks_x, n_y, n_split, s_gb, s_pgs,
            eps, alpha, beta_y, BLOCK, WRITE_RAW, COST,
        )


# fmt: on
def combine_sides(
    first, second, split, eps, alpha, beta_1, beta_2, want_raw, cost=kernel_costs.SQEUCLIDEAN,
    guard=None, first_only=False,
):  # fmt: skip
    """Merges the partial (max, sum) of the two sides of a split sweep and applies the
    epilogue. ``first``, ``second``: ``(pmax, psum, sq, old, out, raw)`` of each side;
    ``guard``: a float32 device flag (the launch does nothing unless it is non-zero);
    ``first_only``: merge the first side only (the second's slots are not read)."""
    sq1, sq2 = first[2], second[2]
    B, n1 = sq1.shape
    n2 = sq2.shape[1]
    nb1 = cdiv(n1, COMBINE_BLOCK)
    nb = nb1 if first_only else nb1 + cdiv(n2, COMBINE_BLOCK)
    launch(_lse_combine_kernel, (nb, B),
        *first, *second, sq1 if guard is None else guard, 0 if guard is None else 1,
        n1, n2, nb1, split, sq1.stride(0), sq2.stride(0), B * n1, B * n2,
        float(eps), float(alpha), float(beta_1), float(beta_2),
        BLOCK=COMBINE_BLOCK, WRITE_RAW=want_raw, COST=cost, **FP_FUSION,
    )  # fmt: skip


def combine_one_side(
    pmax, psum, sq, old, out, raw, split, eps, alpha, beta, want_raw, cost=kernel_costs.SQEUCLIDEAN
):  # fmt: skip
    """Merges the partial (max, sum) of a split single-side sweep and applies the epilogue."""
    side = (pmax, psum, sq, old, out, raw)
    combine_sides(side, side, split, eps, alpha, beta, beta, want_raw, cost, first_only=True)


def pair_chunks(large: bool, n_programs: int, m1: int, m2: int, block_n: int, device):
    """(number of column chunks, columns per chunk of each side) of one grid of two sweeps
    over m1 and m2 columns; one chunk at large eps, whose sums are not merged across chunks
    (:func:`softmin`)."""
    if large:
        return 1, m1, m2
    return pair_split(n_programs, m1, m2, block_n, device)


def partials(split: int, like: torch.Tensor):
    """(max, sum) partial buffers (split, *like.shape) of a split sweep; ``like`` itself twice
    (unused placeholders) when not split."""
    if split == 1:
        return like, like
    shape = (split,) + tuple(like.shape)
    return torch.empty(shape, dtype=torch.float32, device=like.device), torch.empty(
        shape, dtype=torch.float32, device=like.device
    )


def expansion_args(rows: Side, cols: Side, col_pot: torch.Tensor):
    """``(c, w̄, ln M)`` of the large-eps soft-min (``_softmin_rows`` with LARGE): (B, n) row
    shifts c_i near the weighted mean of the row's scores in cost units, (B, m) normalised
    column weights and (B,) the log of the columns' nominal mass (``Side.nominal_mass``).

    Any shift gives the same soft-min; this one keeps |t| = |v − c|/eps within the scores'
    spread: 2 r_i·ȳ + mean(p − ‖c‖²) for the squared Euclidean cost (the mean itself), mean(p)
    − ‖r_i − ȳ‖ for the others, the label term left out.
    """
    w = cols.w.float()
    live = w > 0
    wn = w / w.sum(-1, keepdim=True)
    pot = torch.where(live, col_pot.float(), 0.0)
    ybar = torch.einsum("bm,bmd->bd", wn, cols.x.float())
    xr = rows.x.float()
    if kernel_costs.shifted(rows.cost):
        col = (wn * (pot - cols.sq.float())).sum(-1)
        c = 2.0 * torch.einsum("bnd,bd->bn", xr, ybar) + col[:, None]
    else:
        c = (wn * pot).sum(-1)[:, None] - (xr - ybar[:, None, :]).norm(dim=-1)
    logm = torch.log(cols.nominal_mass.float())
    return c.contiguous(), wn.contiguous(), logm.contiguous()


def softmin(
    rows: Side,
    cols: Side,
    col_pot: torch.Tensor,
    eps: float,
    old: torch.Tensor,
    alpha: float,
    beta: float,
    want_raw: bool,
    precision: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launches one streaming half-step; see :meth:`Backend.softmin`."""
    B, n, d = rows.x.shape
    m = cols.x.shape[1]
    xr, xc, dot_scale, precision = operands(rows, cols, precision)
    cfg = lse_config(d, is_half(xr, precision))
    out = torch.empty_like(rows.sq)
    raw = torch.empty_like(rows.sq) if want_raw else out
    n_blocks = cdiv(n, cfg.block_m)
    large = eps >= rows.large_eps
    cost, labels, rlab, clab, lcost, n_lab, lscale = cost_args(rows, cols)
    c1, wn, logm = expansion_args(rows, cols, col_pot) if large else (out, out, out)
    kw = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        PRECISION=precision, WRITE_RAW=want_raw, COST=cost, LABELS=labels,
        EVEN_D=even_d(cfg, d, xr, xc), LARGE=large,
        ALIGNED_V=aligned_cols((m, cols.sq), (m, cols.logw), (m, col_pot)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION,
    )  # fmt: skip

    def args(pmax, psum, cps, split):
        return (
            xr, xc, rows.sq, cols.sq, cols.logw, col_pot, old, out, raw, pmax, psum,
            rlab, clab, lcost, c1, wn, logm,
            n, m, d, cps, split, n_lab,
            xr.stride(0), xr.stride(1), xc.stride(0), xc.stride(1),
            rows.sq.stride(0), cols.sq.stride(0), B * n,
            float(eps), float(alpha), float(beta), float(dot_scale), float(cols.sq_floor), lscale,
        )  # fmt: skip

    # The large-eps sums are not merged across column chunks: one sweep per row block.
    split, cps = 1, m
    if not large:
        per_sm = None
        if rows.x.is_cuda:
            key = ("softmin", tuple(kw.items()), xr.dtype, xc.dtype, rows.sq.dtype)
            per_sm = resident_blocks(key, _softmin_fwd_kernel, (n_blocks, B, 1),
                                     *args(out, out, m, 1), **kw)  # fmt: skip
        split, cps = plan_split(n_blocks * B, m, cfg.block_n, rows.x.device, per_sm)
    pmax, psum = partials(split, rows.sq)
    _softmin_fwd_kernel[(n_blocks, B, split)](*args(pmax, psum, cps, split), **kw)
    if split > 1:
        combine_one_side(
            pmax, psum, rows.sq, old, out, raw, split, eps, alpha, beta, want_raw, cost
        )
    return out, (raw if want_raw else None)


def step_outputs(f, g, want_raw):
    """(f_new, g_new, f_raw, g_raw) of a symmetric step; the raw ones alias the new ones when
    not wanted."""
    f_new = torch.empty_like(f)
    g_new = torch.empty_like(g)
    f_raw = torch.empty_like(f) if want_raw else f_new
    g_raw = torch.empty_like(g) if want_raw else g_new
    return f_new, g_new, f_raw, g_raw


def symmetric_step(
    X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, out=None, guard=None,
    x_only=False,
):  # fmt: skip
    """Launches both half-steps of a symmetric iteration in one grid (plus one merge launch
    when the columns are split).

    ``out``: the four output tensors of :func:`step_outputs` to write (default: new ones).
    ``guard``: a float32 device flag; the launches then do nothing unless it is non-zero (the
    fallback of the plan step, plan.py).
    ``x_only``: launch the x side's programs only: for a self problem (Y is X, g is f) the y
    side would repeat them (the fallback of the triangular self step, plan_self.py).
    """
    B, n, d = X.x.shape
    m = Y.x.shape[1]
    xx, xy, dot_scale, precision = operands(X, Y, precision)
    cfg = lse_config(d, is_half(xx, precision))
    f_new, g_new, f_raw, g_raw = step_outputs(f, g, want_raw) if out is None else out
    guarded = 0 if guard is None else 1
    guard = f if guard is None else guard
    n_blocks_x = cdiv(n, cfg.block_m)
    n_blocks = n_blocks_x if x_only else n_blocks_x + cdiv(m, cfg.block_m)
    large = eps >= X.large_eps
    split, cps_x, cps_y = pair_chunks(large, n_blocks * B, m, n, cfg.block_n, X.x.device)
    pfmax, pfsum = partials(split, f)
    pgmax, pgsum = (pfmax, pfsum) if x_only else partials(split, g)
    cost, labels, xlab, ylab, xlc, n_lab, lscale = cost_args(X, Y)
    ylc = cost_args(Y, X)[4] if labels else xlc
    if large:
        xc1, ywn, ylogm = expansion_args(X, Y, g)
        yc1, xwn, xlogm = expansion_args(Y, X, f)
    else:
        xc1 = yc1 = xwn = ywn = xlogm = ylogm = f
    launch(_softmin_sym_kernel, (n_blocks, B, split),
        xx, xy, X.sq, Y.sq, X.logw, Y.logw, f, g, f_new, g_new, f_raw, g_raw,
        pfmax, pfsum, pgmax, pgsum, xlab, ylab, xlc, ylc,
        xc1, yc1, xwn, ywn, xlogm, ylogm, guard, guarded,
        n, m, d, n_blocks_x, cps_x, cps_y, split, n_lab,
        xx.stride(0), xx.stride(1), xy.stride(0), xy.stride(1), f.stride(0), g.stride(0),
        B * n, B * m,
        float(eps), float(alpha), float(beta_x), float(beta_y), float(dot_scale),
        float(X.sq_floor), lscale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        PRECISION=precision, WRITE_RAW=want_raw, COST=cost, LABELS=labels,
        EVEN_D=even_d(cfg, d, xx, xy), LARGE=large,
        ALIGNED_V=aligned_cols((m, Y.sq), (m, Y.logw), (m, g), (n, X.sq), (n, X.logw), (n, f)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION,
    )  # fmt: skip
    if split > 1:
        combine_sides(
            (pfmax, pfsum, X.sq, f, f_new, f_raw), (pgmax, pgsum, Y.sq, g, g_new, g_raw),
            split, eps, alpha, beta_x, beta_y, want_raw, cost,
            guard=guard if guarded else None, first_only=x_only,
        )  # fmt: skip
    if want_raw:
        return f_new, g_new, f_raw, g_raw
    return f_new, g_new, None, None
