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

from ..._triton_launch import FP_FUSION, cdiv, launch
from ...problem import Side
from .. import kernel_costs
from .configs import COMBINE_BLOCK, lse_config
from .operands import cost_args, is_half, operands
from .split import chunk, plan_split, split_count
from .tiles import (
    SQEUCLIDEAN,
    col_bias,
    cost_scores,
    label_rows,
    label_tile,
    load_parts,
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
def _softmin_rows(
    R, C, Rsq, Csq, Clogw, Cpot, Rold, Out, Raw, Pmax, Psum, Rlab, Clab, Lcost,
    i_b, i_m, i_s,
    n_rows, n_cols, d, cols_per_split, n_split, n_lab,
    s_rb, s_rn, s_cb, s_cn, s_vrb, s_vcb, s_ps,
    eps, alpha, beta, dot_scale, sq_floor, lscale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, WRITE_RAW: tl.constexpr,
    COST: tl.constexpr, LABELS: tl.constexpr, EVEN_D: tl.constexpr,
):
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
    p_r = R + i_b64 * s_rb + o_m.to(tl.int64)[:, None] * s_rn + o_d[None, :]
    p_c0 = C + i_b64 * s_cb
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
    # With n_split > 1, this program sweeps one chunk of the columns (a multiple of BLOCK_N
    # wide) and leaves its partial (max, sum) for _lse_combine_kernel: more programs than row
    # blocks when n is too small to fill the GPU.
    col_start = i_s * cols_per_split
    col_stop = tl.minimum(col_start + cols_per_split, n_cols)
    for start_n in range(col_start, col_stop, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_cols
        p_c = p_c0 + o_n.to(tl.int64)[:, None] * s_cn + o_d[None, :]
        # [BLOCK_M, BLOCK_N] dot tile
        b_s, _ = score_tile(
            p_r, p_c, m_m, m_n, m_dd, b_r, b_rl, o_d, d,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION,
        )
        o_vc = i_b64 * s_vcb + o_n
        b_h, b_csq = col_bias(Cpot, Csq, Clogw, o_vc, m_n, inv_eps2, COST)
        b_lab = b_s
        if LABELS:
            b_lab = label_tile(Lcost, b_lr, b_w0, b_w1, Clab, o_vc, m_m, m_n, n_lab, lscale,
                               LABELS)
        b_z, _ = cost_scores(
            b_s, b_h, b_rsq, b_csq, b_lab, scale2, inv_eps2, dot_scale, sq_floor, COST, LABELS
        )
        b_new, b_alpha, b_ref = online_lse(b_max, b_sum, b_z)
        b_sum = b_sum * b_alpha + tl.sum(tl.exp2(b_z - b_ref[:, None]), 1)
        b_max = b_new

    # A run-time branch, not a constexpr: one compiled kernel serves every n and m.
    if n_split > 1:
        tl.store(Pmax + i_s * s_ps + o_vr, b_max, mask=m_m)
        tl.store(Psum + i_s * s_ps + o_vr, b_sum, mask=m_m)
    else:
        softmin_epilogue(
            b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW, COST
        )


@triton.jit(do_not_specialize=SOFTMIN_DYNAMIC)
def _softmin_fwd_kernel(
    R, C, Rsq, Csq, Clogw, Cpot, Rold, Out, Raw, Pmax, Psum, Rlab, Clab, Lcost,
    n_rows, n_cols, d, cols_per_split, n_split, n_lab,
    s_rb, s_rn, s_cb, s_cn, s_vrb, s_vcb, s_ps,
    eps, alpha, beta, dot_scale, sq_floor, lscale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, WRITE_RAW: tl.constexpr,
    COST: tl.constexpr, LABELS: tl.constexpr, EVEN_D: tl.constexpr,
):
    # grid (row blocks, B, column chunks)
    _softmin_rows(
        R, C, Rsq, Csq, Clogw, Cpot, Rold, Out, Raw, Pmax, Psum, Rlab, Clab, Lcost,
        tl.program_id(1), tl.program_id(0), tl.program_id(2),
        n_rows, n_cols, d, cols_per_split, n_split, n_lab,
        s_rb, s_rn, s_cb, s_cn, s_vrb, s_vcb, s_ps,
        eps, alpha, beta, dot_scale, sq_floor, lscale,
        BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, WRITE_RAW, COST, LABELS, EVEN_D,
    )


@triton.jit(do_not_specialize=SOFTMIN_DYNAMIC + ["guarded"])
def _softmin_sym_kernel(
    X, Y, Xsq, Ysq, Xlogw, Ylogw, F, G, Fout, Gout, Fraw, Graw, PFmax, PFsum, PGmax, PGsum,
    Xlab, Ylab, XLc, YLc, Guard, guarded,
    n_x, n_y, d, n_blocks_x, cols_per_split_x, cols_per_split_y, n_split, n_lab,
    s_xb, s_xn, s_yb, s_yn, s_fb, s_gb, s_pfs, s_pgs,
    eps, alpha, beta_x, beta_y, dot_scale, sq_floor, lscale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, WRITE_RAW: tl.constexpr,
    COST: tl.constexpr, LABELS: tl.constexpr, EVEN_D: tl.constexpr,
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
            i_b, i_m, i_s,
            n_x, n_y, d, cols_per_split_x, n_split, n_lab,
            s_xb, s_xn, s_yb, s_yn, s_fb, s_gb, s_pfs,
            eps, alpha, beta_x, dot_scale, sq_floor, lscale,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, WRITE_RAW, COST, LABELS, EVEN_D,
        )
    else:
        _softmin_rows(
            Y, X, Ysq, Xsq, Xlogw, F, G, Gout, Graw, PGmax, PGsum, Ylab, Xlab, YLc,
            i_b, i_m - n_blocks_x, i_s,
            n_y, n_x, d, cols_per_split_y, n_split, n_lab,
            s_yb, s_yn, s_xb, s_xn, s_gb, s_fb, s_pgs,
            eps, alpha, beta_y, dot_scale, sq_floor, lscale,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, WRITE_RAW, COST, LABELS, EVEN_D,
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
def combine_one_side(
    pmax, psum, sq, old, out, raw, split, eps, alpha, beta, want_raw, cost=kernel_costs.SQEUCLIDEAN
):  # fmt: skip
    """Merges the partial (max, sum) of a split single-side sweep and applies the epilogue."""
    B, n = sq.shape
    nb = cdiv(n, COMBINE_BLOCK)
    # The y-side slots repeat the x side; n_blocks_x = nb routes every program to it.
    args = (pmax, psum, sq, old, out, raw)
    launch(_lse_combine_kernel, (nb, B),
        *args, *args, sq, 0, n, n, nb, split, sq.stride(0), sq.stride(0), B * n, B * n,
        float(eps), float(alpha), float(beta), float(beta),
        BLOCK=COMBINE_BLOCK, WRITE_RAW=want_raw, COST=cost, **FP_FUSION,
    )  # fmt: skip


def partials(split: int, like: torch.Tensor):
    """(max, sum) partial buffers (split, *like.shape) of a split sweep; ``like`` itself twice
    (unused placeholders) when not split."""
    if split == 1:
        return like, like
    shape = (split,) + tuple(like.shape)
    return torch.empty(shape, dtype=torch.float32, device=like.device), torch.empty(
        shape, dtype=torch.float32, device=like.device
    )


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
    split, cps = plan_split(n_blocks * B, m, cfg.block_n, rows.x.device)
    pmax, psum = partials(split, rows.sq)
    cost, labels, rlab, clab, lcost, n_lab, lscale = cost_args(rows, cols)
    _softmin_fwd_kernel[(n_blocks, B, split)](
        xr, xc, rows.sq, cols.sq, cols.logw, col_pot, old, out, raw, pmax, psum,
        rlab, clab, lcost,
        n, m, d, cps, split, n_lab,
        xr.stride(0), xr.stride(1), xc.stride(0), xc.stride(1),
        rows.sq.stride(0), cols.sq.stride(0), B * n,
        float(eps), float(alpha), float(beta), float(dot_scale), float(cols.sq_floor), lscale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        PRECISION=precision, WRITE_RAW=want_raw, COST=cost, LABELS=labels,
        EVEN_D=d == cfg.block_d and cfg.d_tiles == 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION,
    )  # fmt: skip
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
    X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, out=None, guard=None
):  # fmt: skip
    """Launches both half-steps of a symmetric iteration in one grid (plus one merge launch
    when the columns are split).

    ``out``: the four output tensors of :func:`step_outputs` to write (default: new ones).
    ``guard``: a float32 device flag; the launches then do nothing unless it is non-zero (the
    fallback of the plan step, plan.py).
    """
    B, n, d = X.x.shape
    m = Y.x.shape[1]
    xx, xy, dot_scale, precision = operands(X, Y, precision)
    cfg = lse_config(d, is_half(xx, precision))
    f_new, g_new, f_raw, g_raw = step_outputs(f, g, want_raw) if out is None else out
    guarded = 0 if guard is None else 1
    guard = f if guard is None else guard
    n_blocks_x = cdiv(n, cfg.block_m)
    n_blocks = n_blocks_x + cdiv(m, cfg.block_m)
    split = split_count(n_blocks * B, min(n, m), cfg.block_n, X.x.device)
    cps_x, cps_y = chunk(m, split, cfg.block_n), chunk(n, split, cfg.block_n)
    split = max(cdiv(m, cps_x), cdiv(n, cps_y))
    pfmax, pfsum = partials(split, f)
    pgmax, pgsum = partials(split, g)
    cost, labels, xlab, ylab, xlc, n_lab, lscale = cost_args(X, Y)
    ylc = cost_args(Y, X)[4] if labels else xlc
    launch(_softmin_sym_kernel, (n_blocks, B, split),
        xx, xy, X.sq, Y.sq, X.logw, Y.logw, f, g, f_new, g_new, f_raw, g_raw,
        pfmax, pfsum, pgmax, pgsum, xlab, ylab, xlc, ylc, guard, guarded,
        n, m, d, n_blocks_x, cps_x, cps_y, split, n_lab,
        xx.stride(0), xx.stride(1), xy.stride(0), xy.stride(1), f.stride(0), g.stride(0),
        B * n, B * m,
        float(eps), float(alpha), float(beta_x), float(beta_y), float(dot_scale),
        float(X.sq_floor), lscale,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        PRECISION=precision, WRITE_RAW=want_raw, COST=cost, LABELS=labels,
        EVEN_D=d == cfg.block_d and cfg.d_tiles == 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION,
    )  # fmt: skip
    if split > 1:
        nbx = cdiv(n, COMBINE_BLOCK)
        nb = nbx + cdiv(m, COMBINE_BLOCK)
        launch(_lse_combine_kernel, (nb, B),
            pfmax, pfsum, X.sq, f, f_new, f_raw, pgmax, pgsum, Y.sq, g, g_new, g_raw,
            guard, guarded,
            n, m, nbx, split, f.stride(0), g.stride(0), B * n, B * m,
            float(eps), float(alpha), float(beta_x), float(beta_y),
            BLOCK=COMBINE_BLOCK, WRITE_RAW=want_raw, COST=cost, **FP_FUSION,
        )  # fmt: skip
    if want_raw:
        return f_new, g_new, f_raw, g_raw
    return f_new, g_new, None, None
