"""Streaming argmax of the plan's rows, and draws j ~ P_i· by the Gumbel-max trick.

One program owns BLOCK_M draws (rows of the plan, gathered through an index vector, or every
row) and sweeps the columns once. Per column tile it forms the score tile of the soft-min
(tiles.score_tile, col_bias, cost_scores: z_ij = log2 of P_ij up to a row constant), adds,
when sampling, the counter-based Gumbel noise of backends/gumbel.py computed from (seed,
draw, column) in uint32 arithmetic, and keeps a running (max, index) per row: the tile's
maximum replaces it only when strictly larger, so ties go to the smallest column, as in
``torch.argmax``. Nothing of size k × m is stored: the noise is recomputed, not read.

When the row blocks cannot fill the GPU the columns are split into chunks (split.plan_split);
each chunk writes its (max, index) and the chunks are merged by a (tiny) torch reduction that
keeps the first chunk among equal maxima. Derivation and floors: docs/couplings.md.

``dense_plan_argmax`` is the same sweep over a stored Gram matrix K = X Yᵀ (the dense path):
a draw reads its row of K (4·m bytes) instead of forming x_i·Yᵀ (2·m·d products), as the
dense soft-mins do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, launch
from ...problem import Side
from .configs import DENSE_SOFTMIN_STAGES, DENSE_SOFTMIN_TILES, sample_config
from .dense_grad import k_scores
from .operands import cost_args, even_d, is_half, operands
from .split import plan_split
from .tiles import (
    SQEUCLIDEAN,
    batch_base,
    col_bias,
    cost_scores,
    label_rows,
    label_tile,
    load_parts,
    score_tile,
)

_DYNAMIC = ["n_draw", "n_cols", "d", "n_lab", "cols_per_split", "s_rb", "s_cb", "s_vrb",
            "s_vcb", "s_ib", "s_os"]  # fmt: skip


@triton.jit
def mix32(x):
    # The 32-bit finaliser of backends/gumbel.py on uint32 values (wrapping products).
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def gumbel2(b_key, o_n, s1):
    # Base-2 Gumbel noise of a tile: b_key (BLOCK_M,) draw keys h_t, o_n (BLOCK_N,) columns.
    b_v = b_key[:, None] + o_n.to(tl.uint32)[None, :] * 0x9E3779B9
    b_v = mix32(b_v ^ s1)
    b_u = ((b_v >> 9) * 2 + 1).to(tl.float32) * 5.960464477539063e-08
    return -tl.log2(-tl.log2(b_u))


@triton.jit
def draw_rows(Idx, Seed, n_draw, s_ib, BLOCK_M: tl.constexpr, NOISE: tl.constexpr,
              GATHER: tl.constexpr):  # fmt: skip
    # The program's draws (grid: draw blocks, problems, column chunks): (problem, chunk, draws
    # o_m, their mask, their rows, keys h_t, seed word s1). The row of draw r is idx[b, r]
    # when gathering, else r; the draw counter is t = b·k + r, modulo 2^32.
    i_b64 = tl.program_id(1).to(tl.int64)
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < n_draw
    o_r = o_m
    if GATHER:
        o_r = tl.load(Idx + i_b64 * s_ib + o_m, mask=m_m, other=0).to(tl.int32)
    b_key = o_m.to(tl.uint32)
    s1 = tl.zeros([], tl.uint32)
    if NOISE:
        s0 = tl.load(Seed).to(tl.uint32)
        s1 = tl.load(Seed + 1).to(tl.uint32)
        b_key = mix32(mix32((i_b64 * n_draw + o_m).to(tl.uint32)) ^ s0)
    return i_b64, tl.program_id(2), o_m, m_m, o_r, b_key, s1


@triton.jit
def keep_best(b_z, b_best, b_arg, start_n, o_n, b_key, s1, NOISE: tl.constexpr):
    # The running (max, column) per draw after one column tile of scores (plus the noise):
    # a tile's maximum replaces it only when strictly larger (ties: the smallest column).
    if NOISE:
        b_z = b_z + gumbel2(b_key, o_n, s1)
    b_tmax, b_targ = tl.max(b_z, 1, return_indices=True, return_indices_tie_break_left=True)
    b_up = b_tmax > b_best
    return tl.where(b_up, b_tmax, b_best), tl.where(b_up, start_n + b_targ, b_arg)


# Argument lists grouped by role (tensors, sizes, strides, scalars, constexprs), one group per
# line; the formatter would put one argument per line.
# fmt: off
@triton.jit(do_not_specialize=_DYNAMIC)
def _plan_argmax_kernel(
    R, C, Rsq, Csq, Clogw, Cpot, Idx, Seed, Rlab, Clab, Lcost, Vals, Cols,
    n_draw, n_cols, d, n_lab, cols_per_split,
    s_rb, s_rn, s_cb, s_cn, s_vrb, s_vcb, s_ib, s_os,
    eps, sq_floor, lscale, dot_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D_TILES: tl.constexpr,
    SCORE_PRECISION: tl.constexpr, COST: tl.constexpr, LABELS: tl.constexpr,
    NOISE: tl.constexpr, GATHER: tl.constexpr, EVEN_D: tl.constexpr,
):
    # Base-2 scores z_ij = 2 r_i·c_j log2e / eps + h_j, h_j = (p_j − ‖c_j‖²) log2e / eps +
    # log2 w_j (other costs: cost_scores forms h_j − C_ij log2e / eps): log2 P_ij minus a row
    # constant, which does not move the row's argmax.
    scale2 = 2.0 * 1.4426950408889634 * dot_scale / eps
    inv_eps2 = 1.4426950408889634 / eps
    i_b64, i_s, o_m, m_m, o_r, b_key, s1 = draw_rows(Idx, Seed, n_draw, s_ib, BLOCK_M, NOISE, GATHER)
    o_r64 = o_r.to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    # EVEN_D (d == BLOCK_D, aligned rows: operands.even_d): no feature mask, vector loads
    m_dd = (o_d < BLOCK_D) if EVEN_D else (o_d < d)
    p_r = batch_base(R, i_b64, s_rb, EVEN_D) + o_r64[:, None] * s_rn + o_d[None, :]
    p_c0 = batch_base(C, i_b64, s_cb, EVEN_D)
    b_r = tl.zeros([BLOCK_M, BLOCK_D], R.dtype.element_ty)
    b_rl = b_r
    if D_TILES == 1:
        b_r, b_rl = load_parts(p_r, m_m[:, None] & m_dd[None, :], d, SCORE_PRECISION)
    o_vr = i_b64 * s_vrb + o_r
    b_rsq = tl.zeros([BLOCK_M], tl.float32)
    if COST != SQEUCLIDEAN:
        b_rsq = tl.load(Rsq + o_vr, mask=m_m, other=0.0)
    if LABELS:
        b_lr, b_w0, b_w1 = label_rows(Rlab, Lcost, o_vr, m_m, n_lab, LABELS)

    b_best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_arg = tl.zeros([BLOCK_M], tl.int32)
    col_start = i_s * cols_per_split
    col_stop = tl.minimum(col_start + cols_per_split, n_cols)
    for start_n in range(col_start, col_stop, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_cols
        p_c = p_c0 + o_n.to(tl.int64)[:, None] * s_cn + o_d[None, :]
        b_s, b_c = score_tile(
            p_r, p_c, m_m, m_n, m_dd, b_r, b_rl, o_d, d, BLOCK_M, BLOCK_N, BLOCK_D, D_TILES,
            SCORE_PRECISION,
        )
        o_vc = i_b64 * s_vcb + o_n
        # masked columns have log2 w = -inf (col_bias): they never win
        b_h, b_csq = col_bias(Cpot, Csq, Clogw, o_vc, m_n, inv_eps2, COST)
        b_lab = b_s
        if LABELS:
            b_lab = label_tile(Lcost, b_lr, b_w0, b_w1, Clab, o_vc, m_m, m_n, n_lab, lscale, LABELS)
        b_z, _ = cost_scores(b_s, b_h, b_rsq, b_csq, b_lab, scale2, inv_eps2, dot_scale, sq_floor, COST, LABELS)
        b_best, b_arg = keep_best(b_z, b_best, b_arg, start_n, o_n, b_key, s1, NOISE)

    o_out = i_s * s_os + i_b64 * n_draw + o_m
    tl.store(Vals + o_out, b_best, mask=m_m)
    tl.store(Cols + o_out, b_arg, mask=m_m)
# fmt: on


def plan_argmax(
    rows: Side,
    cols: Side,
    col_pot: torch.Tensor,
    eps: float,
    precision: str,
    idx: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :meth:`flashsinkhorn.backends.base.Backend.plan_argmax`."""
    B, n, d = rows.x.shape
    m = cols.x.shape[1]
    dev = rows.x.device
    # score operands as the soft-min reads them (float16 grid copies at "tf32")
    xr, xc, dot_scale, score_prec = operands(rows, cols, precision)
    cfg = sample_config(d, is_half(xr, score_prec))
    k = n if idx is None else idx.shape[1]
    col_pot = col_pot.to(torch.float32).contiguous()
    gather = idx is not None
    index = idx.contiguous() if gather else rows.sq  # placeholder pointer when not gathering
    noise = seed is not None
    seed_t = seed.contiguous() if noise else rows.sq
    cost, labels, rlab, clab, lcost, n_lab, lscale = cost_args(rows, cols)
    n_blocks = cdiv(k, cfg.block_m)
    split, cps = plan_split(n_blocks * B, m, cfg.block_n, dev)
    vals = torch.empty((split, B, k), dtype=torch.float32, device=dev)
    out = torch.empty((split, B, k), dtype=torch.int32, device=dev)
    launch(_plan_argmax_kernel, (n_blocks, B, split),
        xr, xc, rows.sq, cols.sq, cols.logw, col_pot, index, seed_t, rlab, clab, lcost, vals, out,
        k, m, d, n_lab, cps,
        xr.stride(0), xr.stride(1), xc.stride(0), xc.stride(1), rows.sq.stride(0),
        cols.sq.stride(0), index.stride(0), B * k,
        float(eps), float(cols.sq_floor), lscale, float(dot_scale),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        SCORE_PRECISION=score_prec, COST=cost, LABELS=labels, NOISE=noise, GATHER=gather,
        EVEN_D=even_d(cfg, d, xr, xc),
        **cfg.launch_options(), **FP_FUSION,
    )  # fmt: skip
    return merge_chunks(vals, out)


def merge_chunks(vals: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(B, k) int64 columns from the (split, B, k) running maxima and their columns of the
    column chunks: the first chunk among equal maxima, the smallest column, as in the
    unsplit sweep."""
    if vals.shape[0] == 1:
        return cols[0].long()
    best = vals.argmax(0, keepdim=True)
    return torch.gather(cols, 0, best)[0].long()


# fmt: off
@triton.jit(do_not_specialize=["n_draw", "n_rows", "n_cols", "cols_per_split", "s_kb",
                               "s_vcb", "s_ib", "s_os"])
def _dense_argmax_kernel(
    K, Csq, Clogw, Cpot, Idx, Seed, Vals, Cols,
    n_draw, n_rows, n_cols, cols_per_split, s_kb, s_k, s_vcb, s_ib, s_os,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr,
    NOISE: tl.constexpr, GATHER: tl.constexpr,
):
    # The scores of _plan_argmax_kernel with the dot products read from K (dense_grad.k_scores:
    # K[r, c], or K[c, r] when the rows are the y side).
    scale2 = 2.0 * 1.4426950408889634 / eps
    inv_eps2 = 1.4426950408889634 / eps
    i_b64, i_s, o_m, m_m, o_r, b_key, s1 = draw_rows(Idx, Seed, n_draw, s_ib, BLOCK_M, NOISE, GATHER)
    m_r = m_m & (o_r < n_rows)
    b_best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_arg = tl.zeros([BLOCK_M], tl.int32)
    col_start = tl.multiple_of(i_s * cols_per_split, BLOCK_N)
    col_stop = tl.minimum(col_start + cols_per_split, n_cols)
    for start_n in range(col_start, col_stop, BLOCK_N):
        # masked columns have log2 w = -inf: they never win
        b_z, _m_n, o_n = k_scores(
            K, Csq, Clogw, Cpot, i_b64, o_r, o_r.to(tl.int64), m_r, start_n, n_cols, s_kb, s_k,
            s_vcb, scale2, inv_eps2, BLOCK_N, TRANSPOSED,
        )
        b_best, b_arg = keep_best(b_z, b_best, b_arg, start_n, o_n, b_key, s1, NOISE)
    o_out = i_s * s_os + i_b64 * n_draw + o_m
    tl.store(Vals + o_out, b_best, mask=m_m)
    tl.store(Cols + o_out, b_arg, mask=m_m)
# fmt: on


def dense_plan_argmax(
    gram: torch.Tensor,
    transposed: bool,
    rows: Side,
    cols: Side,
    col_pot: torch.Tensor,
    eps: float,
    idx: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
) -> torch.Tensor:
    """:meth:`~flashsinkhorn.backends.base.Backend.plan_argmax` for the squared Euclidean cost
    with the dot products read from ``gram`` ((B, n_x, m_pad) fp32 X Yᵀ, rows padded to 16
    floats; ``transposed``: the rows are its y side)."""
    B, n = rows.sq.shape
    m = cols.sq.shape[1]
    dev = rows.sq.device
    k = n if idx is None else idx.shape[1]
    # row tiles of the dense soft-min along K's stored rows; a column sweep reads K's columns
    block_m, block_n, warps = DENSE_SOFTMIN_TILES[transposed]
    col_pot = col_pot.to(torch.float32).contiguous()
    gather = idx is not None
    index = idx.contiguous() if gather else rows.sq  # placeholder pointer when not gathering
    noise = seed is not None
    seed_t = seed.contiguous() if noise else rows.sq
    n_blocks = cdiv(k, block_m)
    split, cps = plan_split(n_blocks * B, m, block_n, dev)
    vals = torch.empty((split, B, k), dtype=torch.float32, device=dev)
    out = torch.empty((split, B, k), dtype=torch.int32, device=dev)
    launch(_dense_argmax_kernel, (n_blocks, B, split),
        gram, cols.sq, cols.logw, col_pot, index, seed_t, vals, out,
        k, n, m, cps, gram.stride(0), gram.stride(1), cols.sq.stride(0), index.stride(0), B * k,
        float(eps),
        BLOCK_M=block_m, BLOCK_N=block_n, TRANSPOSED=transposed, NOISE=noise, GATHER=gather,
        num_warps=warps, num_stages=DENSE_SOFTMIN_STAGES, **FP_FUSION,
    )  # fmt: skip
    return merge_chunks(vals, out)
