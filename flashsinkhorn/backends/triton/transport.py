"""Streaming transport kernels from potentials (paper Algorithms 2, 4 and 5).

One kernel covers P V, Pᵀ U (the same launch with the two sides exchanged), the
Hadamard-weighted (P ∘ A Bᵀ) V, the row marginal P 1 and the fused envelope gradient
2 (diag(â) x − P y). Each program owns BLOCK_M rows and sweeps the columns once: per column
tile it forms the score tile x·yᵀ a single time, updates the running base-2 (max, sum) of the
online LSE and accumulates exp2(z − max) · V_tile *unnormalised*, rescaling the accumulator
when the running max grows. The epilogue scales each row once by â_i / s_i. Math and
derivation: docs/transport.md.

V of any width p: up to BLOCK_P columns the accumulator lives in registers; wider V is
accumulated in the fp32 output buffer itself, chunk by chunk, so the score tile is still
computed once per column tile (never once per feature chunk). One value column is a row sum,
not a dot. Score operands are the soft-min's (``operands.operands``: float16 grid copies at
"tf32").
When the row blocks cannot fill the GPU the column sweep is split as in the soft-min; the
partials (max, sum, accumulator rows) are merged by ``_apply_combine_kernel``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, launch, precompile_once, resident_blocks
from ...problem import Side
from ...tuning import TUNING
from .. import kernel_costs
from .configs import (
    COMBINE_ROWS,
    TC_MIN_RANK_BLOCK,
    TransportConfig,
    grad_tiles,
    interpreting,
    transport_config,
)
from .operands import cost_args, even_d, operands, whole_tile
from .split import transport_split
from .tiles import (
    SQEUCLIDEAN,
    batch_base,
    col_bias,
    cost_scores,
    grad_weight,
    label_rows,
    label_tile,
    load_parts,
    online_lse,
    score_tile,
)

_DYNAMIC = [
    "n_rows",
    "s_xb",
    "n_cols",
    "p",
    "s_rb",
    "s_cb",
    "s_vrb",
    "s_vcb",
    "s_Vb",
    "s_ob",
    "s_ab",
    "s_bb",
    "n_lab",
    "cols_per_split",
    "n_split",
    "s_ps",
    "s_pa",
]


# Kernel argument lists are grouped by role (tensors, sizes, strides, constexprs), one
# group per line; the formatter would put one argument per line.
# fmt: off
@triton.jit
def _transport_epilogue(
    b_max, b_sum, b_wsum, b_acc, Rx, Rsq, Rlogw, Rpot, Out, Marg,
    i_b64, o_m, m_m, o_vr, p, s_xb, s_xn, s_ob, s_on, inv_eps2, rscale,
    BLOCK_P: tl.constexpr, P_TILES: tl.constexpr,
    HAS_V: tl.constexpr, GRAD: tl.constexpr, COST: tl.constexpr,
):
    # â_i = 2^(ha_i + max_i) s_i, and out_i = (â_i / s_i) acc_i = 2^(ha_i + max_i) acc_i. With
    # P_TILES > 1 the accumulator is the program's rows of Out (b_acc unused). For GRAD the row
    # points are read from Rx (the float16 grid copy at "tf32") times rscale (a power of two:
    # exact).
    o_m64 = o_m.to(tl.int64)
    o_p = tl.arange(0, BLOCK_P)
    p_o = Out + i_b64 * s_ob + o_m64[:, None] * s_on + o_p[None, :]
    p_x = Rx + i_b64 * s_xb + o_m64[:, None] * s_xn + o_p[None, :]
    # the row prefactor ha_i: the column bias formula on the row side
    b_ha, _ = col_bias(Rpot, Rsq, Rlogw, o_vr, m_m, inv_eps2, COST)
    b_scale = tl.where(b_max == float("-inf"), 0.0, tl.exp2(b_ha + b_max))
    b_scale = tl.where(b_scale == b_scale, b_scale, 0.0)  # zero weight and -inf max: no mass
    b_marg = b_scale * b_sum
    tl.store(Marg + o_vr, b_marg, mask=m_m)
    if HAS_V:
        for i_p in range(P_TILES):
            m_p = (i_p * BLOCK_P + o_p) < p
            m_o = m_m[:, None] & m_p[None, :]
            if P_TILES == 1:
                b_out = b_acc * b_scale[:, None]
            else:
                b_out = tl.load(p_o + i_p * BLOCK_P, mask=m_o, other=0.0) * b_scale[:, None]
            if GRAD:
                b_x = tl.load(p_x + i_p * BLOCK_P, mask=m_o, other=0.0).to(tl.float32) * rscale
                if COST != SQEUCLIDEAN:
                    # Σ_j P_ij w_ij (x_i − y_j), w from tiles.grad_weight
                    b_out = (b_scale * b_wsum)[:, None] * b_x - b_out
                else:
                    b_out = 2.0 * (b_marg[:, None] * b_x - b_out)
            tl.store(p_o + i_p * BLOCK_P, b_out, mask=m_o)


@triton.jit(do_not_specialize=_DYNAMIC)
def _apply_fwd_kernel(
    R, C, Rx, Rsq, Csq, Rlogw, Clogw, Rpot, Cpot, V, A, Bw, Out, Marg, Rlab, Clab, Lcost,
    Pmax, Psum, Pwsum, Pacc, Ticket,
    n_rows, n_cols, d, p, r, n_lab, cols_per_split, n_split,
    s_rb, s_rn, s_cb, s_cn, s_xb, s_xn, s_vrb, s_vcb,
    s_Vb, s_Vn, s_ob, s_on, s_ab, s_an, s_bb, s_bn, s_ps, s_pa,
    eps, sq_floor, lscale, dot_scale, rscale, vscale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, BLOCK_P: tl.constexpr, P_TILES: tl.constexpr,
    BLOCK_R: tl.constexpr, R_TILES: tl.constexpr,
    HAS_V: tl.constexpr, HADAMARD: tl.constexpr, GRAD: tl.constexpr, VEC: tl.constexpr,
    P16: tl.constexpr, V16: tl.constexpr, PRECISION: tl.constexpr, HAD_PRECISION: tl.constexpr, SCORE_PRECISION: tl.constexpr,
    COST: tl.constexpr, LABELS: tl.constexpr, MERGE: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_P: tl.constexpr,
):
    # Other costs (docs/costs.md): the score tile comes from tiles.cost_scores; their gradient
    # Σ_j P_ij w_ij (x_i − y_j) is this kernel with the Hadamard weights w_ij of
    # tiles.grad_weight (euclidean: 1 / D_ij, 0 where D_ij is at the floor: the subgradient)
    # and their own running row sum.
    # Base-2 scores z_ij = x_i·y_j (2 log2e / eps) + h_j with the column bias
    # h_j = (p_j − ‖y_j‖²) log2e / eps + log2 w_j; log2 P_ij = ha_i + z_ij with the row
    # prefactor ha_i = (p_i − ‖x_i‖²) log2e / eps + log2 w_i, applied once in the epilogue.
    # R, C are the score operands: possibly float16 points divided by a power of two, whose
    # product dot_scale restores (operands.operands); rscale / vscale restore the row points and the
    # gradient's values (the column points) exactly.
    scale2 = 2.0 * 1.4426950408889634 * dot_scale / eps
    inv_eps2 = 1.4426950408889634 / eps
    n_mb = tl.num_programs(0)
    if MERGE and n_split > 1:
        # Work items in the order programs start (an atomic counter after the tickets), the
        # column chunk slowest: the chunk a program waits for at its merge is held by a
        # program that started before it, whatever order the hardware dispatches blocks in.
        i_t = tl.atomic_add(Ticket + n_mb * tl.num_programs(1), 1)
        i_m = i_t % n_mb
        i_b64 = ((i_t // n_mb) % tl.num_programs(1)).to(tl.int64)
        i_s = i_t // (n_mb * tl.num_programs(1))
    else:
        i_m = tl.program_id(0)
        i_b64 = tl.program_id(1).to(tl.int64)
        i_s = tl.program_id(2)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    o_m64 = o_m.to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    o_p = tl.arange(0, BLOCK_P)
    o_r = tl.arange(0, BLOCK_R)
    # EVEN_D / EVEN_P (operands.even_d, operands.whole_tile): one feature / value tile exactly
    # d / p wide, rows and batches at multiples of 16 elements: no mask along the tile's rows
    # and aligned bases, so that the score operand tiles load as 16-byte vectors and pipeline
    # (without them: 2-byte scalar loads, not pipelined) and the value tile's addresses are
    # compile-time offsets from one base.
    m_dd = (o_d < BLOCK_D) if EVEN_D else (o_d < d)
    m_pp = (o_p < BLOCK_P) if EVEN_P else (o_p < p)
    p_r = batch_base(R, i_b64, s_rb, EVEN_D) + o_m64[:, None] * s_rn + o_d[None, :]
    p_c0 = batch_base(C, i_b64, s_cb, EVEN_D)
    p_v0 = batch_base(V, i_b64, s_Vb, EVEN_P)
    p_o = Out + i_b64 * s_ob + o_m64[:, None] * s_on + o_p[None, :]
    b_r = tl.zeros([BLOCK_M, BLOCK_D], R.dtype.element_ty)
    b_rl = b_r
    if D_TILES == 1:
        b_r, b_rl = load_parts(p_r, m_m[:, None] & m_dd[None, :], d, SCORE_PRECISION)
    o_vr = i_b64 * s_vrb + o_m
    b_rsq = tl.zeros([BLOCK_M], tl.float32)
    if COST != SQEUCLIDEAN:
        b_rsq = tl.load(Rsq + o_vr, mask=m_m, other=0.0)
    if LABELS:
        b_lr, b_w0, b_w1 = label_rows(Rlab, Lcost, o_vr, m_m, n_lab, LABELS)

    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    b_wsum = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    # With n_split > 1 this program sweeps one chunk of the columns (a multiple of BLOCK_N) and
    # leaves its unnormalised partials for _apply_combine_kernel (docs/transport.md).
    col_start = i_s * cols_per_split
    col_stop = tl.minimum(col_start + cols_per_split, n_cols)
    for start_n in range(col_start, col_stop, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_cols
        o_n64 = o_n.to(tl.int64)
        p_c = p_c0 + o_n64[:, None] * s_cn + o_d[None, :]
        b_s, b_c = score_tile(
            p_r, p_c, m_m, m_n, m_dd, b_r, b_rl, o_d, d, BLOCK_M, BLOCK_N, BLOCK_D, D_TILES,
            SCORE_PRECISION,
        )
        o_vc = i_b64 * s_vcb + o_n
        b_h, b_csq = col_bias(Cpot, Csq, Clogw, o_vc, m_n, inv_eps2, COST)
        b_lab = b_s
        if LABELS:
            b_lab = label_tile(Lcost, b_lr, b_w0, b_w1, Clab, o_vc, m_m, m_n, n_lab, lscale, LABELS)
        b_z, b_cost = cost_scores(b_s, b_h, b_rsq, b_csq, b_lab, scale2, inv_eps2, dot_scale, sq_floor, COST, LABELS)
        # Rows that have only met -inf scores keep max = -inf: shift by 0 so exp2 gives 0.
        b_new, b_alpha, b_ref = online_lse(b_max, b_sum, b_z)
        b_e = tl.exp2(b_z - b_ref[:, None])
        b_sum = b_sum * b_alpha + tl.sum(b_e, 1)
        b_max = b_new
        if GRAD and COST != SQEUCLIDEAN:
            b_e = grad_weight(COST, b_e, b_cost, sq_floor)
            b_wsum = b_wsum * b_alpha + tl.sum(b_e, 1)
        if HAS_V:
            if HADAMARD:
                # W_IJ = A_I B_Jᵀ, formed on chip like the score tile.
                b_w = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for i_r in range(R_TILES):
                    m_r = (i_r * BLOCK_R + o_r) < r
                    b_a = tl.load(
                        A + i_b64 * s_ab + o_m64[:, None] * s_an + (i_r * BLOCK_R + o_r)[None, :],
                        mask=m_m[:, None] & m_r[None, :], other=0.0,
                    ).to(tl.float32)
                    b_bw = tl.load(
                        Bw + i_b64 * s_bb + o_n64[:, None] * s_bn + (i_r * BLOCK_R + o_r)[None, :],
                        mask=m_n[:, None] & m_r[None, :], other=0.0,
                    ).to(tl.float32)
                    b_w = tl.dot(b_a, tl.trans(b_bw), b_w, input_precision=HAD_PRECISION)
                b_e = b_e * b_w
            if EVEN_P and V16:
                # rows of exactly 2 BLOCK_P float16 values (hi then lo)
                p_v = p_v0 + o_n64[:, None] * (2 * BLOCK_P) + o_p[None, :]
            elif EVEN_P:
                # contiguous rows of exactly BLOCK_P values: compile-time offsets from one base
                p_v = p_v0 + o_n64[:, None] * BLOCK_P + o_p[None, :]
            else:
                p_v = p_v0 + o_n64[:, None] * s_Vn + o_p[None, :]
            if VEC:
                # One value column: a row reduction in fp32 (no dot padded to 16 columns, no
                # layout change of the probability tile); every accumulator column holds it.
                b_v1 = tl.load(V + i_b64 * s_Vb + o_n64 * s_Vn, mask=m_n, other=0.0).to(tl.float32)
                b_acc = b_acc * b_alpha[:, None] + tl.sum(b_e * b_v1[None, :], 1)[:, None]
            elif P16:
                # The gradient at "tf32": P rounded to float16 (10 bits, as the TF32 dot would
                # keep) times 2^15, so that terms down to 2^-39 of the row's largest stay
                # nonzero, against the float16 column tile already on chip; the scale and
                # vscale come off after the sweep (both powers of two).
                b_acc = b_acc * b_alpha[:, None]
                b_acc = tl.dot((b_e * 32768.0).to(tl.float16), b_c, b_acc)
            elif V16:
                # P·V with P as float16 times 2^15 (the gradient's P16 scheme) and V as two
                # float16 parts, hi and lo, of V scaled by a power of two per column (host):
                # the probability tile feeds both dots from registers, with no layout change
                # through shared memory, and hi + lo keep about 22 bits of V.
                tl.static_assert(EVEN_P, "V16: whole value tiles only")
                b_p16 = (b_e * 32768.0).to(tl.float16)
                m_v = m_n[:, None] & m_pp[None, :]
                b_vh = tl.load(p_v, mask=m_v, other=0.0)
                b_vl = tl.load(p_v + BLOCK_P, mask=m_v, other=0.0)
                b_acc = b_acc * b_alpha[:, None]
                b_acc = tl.dot(b_p16, b_vh, b_acc)
                b_acc = tl.dot(b_p16, b_vl, b_acc)
            elif P_TILES == 1:
                if GRAD and D_TILES == 1 and SCORE_PRECISION != "f16x3":
                    # The values are the column points: reuse the tile already on chip (with
                    # split parts the values are the float32 points instead, read from V).
                    b_v = b_c.to(tl.float32) * vscale
                else:
                    b_v = tl.load(p_v, mask=m_n[:, None] & m_pp[None, :], other=0.0).to(tl.float32)
                b_acc = b_acc * b_alpha[:, None]
                b_acc = tl.dot(b_e, b_v, b_acc, input_precision=PRECISION)
            else:
                # Wide V: the accumulator lives in this program's own rows of Out (fp32).
                for i_p in range(P_TILES):
                    m_p = (i_p * BLOCK_P + o_p) < p
                    m_o = m_m[:, None] & m_p[None, :]
                    b_v = tl.load(p_v + i_p * BLOCK_P, mask=m_n[:, None] & m_p[None, :], other=0.0).to(tl.float32) * vscale
                    b_o = tl.load(p_o + i_p * BLOCK_P, mask=m_o, other=0.0) * b_alpha[:, None]
                    b_o = tl.dot(b_e, b_v, b_o, input_precision=PRECISION)
                    tl.store(p_o + i_p * BLOCK_P, b_o, mask=m_o)
                # Stores and the next tile's loads of the same rows may run on different
                # threads of the program: order them.
                tl.debug_barrier()

    if P16:
        b_acc = b_acc * (vscale * (1.0 / 32768.0))
    elif V16:
        b_acc = b_acc * (1.0 / 32768.0)  # the column scales come off on the host
    elif HAS_V and P_TILES == 1 and not VEC:
        if not (GRAD and D_TILES == 1 and SCORE_PRECISION != "f16x3"):
            # The values' scale (a power of two: exact) comes off after the sweep: a product
            # between the load and the dot would send the tile through registers into a
            # second, unswizzled shared buffer (32-way bank conflicts on every column tile).
            b_acc = b_acc * vscale
    # A run-time branch, not a constexpr: one compiled kernel serves every n and m. The host
    # never splits the wide (P_TILES > 1) case, whose accumulator is Out itself.
    if MERGE and n_split > 1:
        # In-place merge (docs/transport.md): the chunks of a row block add their partials
        # into Out and one (max, sum) row state in chunk order, each waiting for its ticket;
        # the last applies the epilogue. No per-chunk accumulators (split x B x n x p floats)
        # and no combine launch; the order is fixed, so the result does not depend on
        # scheduling.
        p_t = Ticket + i_b64 * n_mb + i_m
        while tl.atomic_add(p_t, 0, sem="acquire", scope="gpu") != i_s:
            pass
        o_pr = i_b64 * n_rows + o_m64
        m_a = m_m[:, None] & (o_p[None, :] < p)
        if i_s > 0:
            # .cg: read past L1, which may hold lines of another SM's era
            b_pm = tl.load(Pmax + o_pr, mask=m_m, other=float("-inf"), cache_modifier=".cg")
            b_new = tl.maximum(b_pm, b_max)
            b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
            b_fo = tl.exp2(b_pm - b_ref)
            b_fm = tl.exp2(b_max - b_ref)
            b_ps = tl.load(Psum + o_pr, mask=m_m, other=0.0, cache_modifier=".cg")
            b_sum = b_ps * b_fo + b_sum * b_fm
            if GRAD and COST != SQEUCLIDEAN:
                b_pw = tl.load(Pwsum + o_pr, mask=m_m, other=0.0, cache_modifier=".cg")
                b_wsum = b_pw * b_fo + b_wsum * b_fm
            if HAS_V:
                b_pa = tl.load(p_o, mask=m_a, other=0.0, cache_modifier=".cg")
                b_acc = b_pa * b_fo[:, None] + b_acc * b_fm[:, None]
            b_max = b_new
        if i_s == n_split - 1:
            _transport_epilogue(
                b_max, b_sum, b_wsum, b_acc, Rx, Rsq, Rlogw, Rpot, Out, Marg,
                i_b64, o_m, m_m, o_vr, p, s_xb, s_xn, s_ob, s_on, inv_eps2, rscale,
                BLOCK_P, P_TILES, HAS_V, GRAD, COST,
            )
        else:
            tl.store(Pmax + o_pr, b_max, mask=m_m)
            tl.store(Psum + o_pr, b_sum, mask=m_m)
            if GRAD and COST != SQEUCLIDEAN:
                tl.store(Pwsum + o_pr, b_wsum, mask=m_m)
            if HAS_V:
                tl.store(p_o, b_acc, mask=m_a)
            # every thread's stores before the release of the next chunk's ticket
            tl.debug_barrier()
            tl.atomic_xchg(p_t, i_s + 1, sem="release", scope="gpu")
    elif n_split > 1:
        o_pr = i_b64 * n_rows + o_m64
        tl.store(Pmax + i_s * s_ps + o_pr, b_max, mask=m_m)
        tl.store(Psum + i_s * s_ps + o_pr, b_sum, mask=m_m)
        if GRAD and COST != SQEUCLIDEAN:
            tl.store(Pwsum + i_s * s_ps + o_pr, b_wsum, mask=m_m)
        if HAS_V and P_TILES == 1:
            p_pa = Pacc + i_s * s_pa + o_pr[:, None] * p + o_p[None, :]
            tl.store(p_pa, b_acc, mask=m_m[:, None] & (o_p[None, :] < p))
    else:
        _transport_epilogue(
            b_max, b_sum, b_wsum, b_acc, Rx, Rsq, Rlogw, Rpot, Out, Marg,
            i_b64, o_m, m_m, o_vr, p, s_xb, s_xn, s_ob, s_on, inv_eps2, rscale,
            BLOCK_P, P_TILES, HAS_V, GRAD, COST,
        )


@triton.jit(do_not_specialize=_DYNAMIC)
def _apply_combine_kernel(
    Pmax, Psum, Pwsum, Pacc, Rx, Rsq, Rlogw, Rpot, Out, Marg,
    n_rows, p, n_split,
    s_xb, s_xn, s_vrb, s_ob, s_on, s_ps, s_pa,
    eps, rscale,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_V: tl.constexpr, GRAD: tl.constexpr, COST: tl.constexpr,
):
    # Merges the partials of a split sweep: max = max_k max_k, and every other partial
    # (sum, weighted sum, accumulator rows) scaled by 2^(max_k − max) and added; then the
    # epilogue of the unsplit kernel.
    inv_eps2 = 1.4426950408889634 / eps
    i_m = tl.program_id(0)
    i_b64 = tl.program_id(1).to(tl.int64)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    o_pr = i_b64 * n_rows + o_m.to(tl.int64)
    o_p = tl.arange(0, BLOCK_P)
    m_a = m_m[:, None] & (o_p[None, :] < p)
    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for i_s in range(n_split):
        b_max = tl.maximum(b_max, tl.load(Pmax + i_s * s_ps + o_pr, mask=m_m, other=float("-inf")))
    b_ref = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    b_wsum = tl.zeros([BLOCK_M], tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    for i_s in range(n_split):
        b_f = tl.exp2(tl.load(Pmax + i_s * s_ps + o_pr, mask=m_m, other=float("-inf")) - b_ref)
        b_sum += tl.load(Psum + i_s * s_ps + o_pr, mask=m_m, other=0.0) * b_f
        if GRAD and COST != SQEUCLIDEAN:
            b_wsum += tl.load(Pwsum + i_s * s_ps + o_pr, mask=m_m, other=0.0) * b_f
        if HAS_V:
            p_pa = Pacc + i_s * s_pa + o_pr[:, None] * p + o_p[None, :]
            b_acc += tl.load(p_pa, mask=m_a, other=0.0) * b_f[:, None]
    o_vr = i_b64 * s_vrb + o_m
    _transport_epilogue(
        b_max, b_sum, b_wsum, b_acc, Rx, Rsq, Rlogw, Rpot, Out, Marg,
        i_b64, o_m, m_m, o_vr, p, s_xb, s_xn, s_ob, s_on, inv_eps2, rscale,
        BLOCK_P, 1, HAS_V, GRAD, COST,
    )


def _launch(rows: Side, cols: Side, row_pot, col_pot, eps, V, A, Bw, precision, grad):
    # The first launch of a kind compiles its kernels (sweep and merge) in parallel.
    width = lambda t: None if t is None else t.shape[-1]  # noqa: E731
    key = ("transport", rows.x.device, rows.x.shape[-1], rows.x.dtype, width(V), width(A),
           precision, grad, rows.cost, rows.labels is not None)  # fmt: skip
    args = (rows, cols, row_pot, col_pot, eps, V, A, Bw, precision, grad)
    precompile_once(key, _launch_kernels, *args)
    return _launch_kernels(*args)


def _launch_kernels(rows: Side, cols: Side, row_pot, col_pot, eps, V, A, Bw, precision, grad):
    B, n, d = rows.x.shape
    m = cols.x.shape[1]
    dtype = rows.sq.dtype
    # Score operands as the soft-min reads them: with precision "tf32" the float16 copies on the
    # TF32 grid (dot_scale = kscale² restores the product), half points as they are (fp32
    # accumulation; "ieee" is only valid for fp32 operands, so the flag is "tf32" there).
    xr, xc, dot_scale, score_prec = operands(rows, cols, precision)
    # Points as the gradient reads them (rows in the epilogue, columns as values): the grid
    # copies at "tf32" (exact), the float32 points when the operands are split parts.
    split_ops = score_prec == "f16x3"
    xpts_r = rows.x if split_ops else xr
    xpts_c = cols.x if split_ops else xc
    rscale = float(rows.kscale) if xpts_r is rows.xk else 1.0
    cscale = float(cols.kscale) if xpts_c is cols.xk else 1.0
    row_pot = row_pot.to(dtype).contiguous()
    col_pot = col_pot.to(dtype).contiguous()
    marg = torch.empty_like(rows.sq)
    vscale = 1.0
    if grad:
        # The values are the column points: read through the score operand, times its scale.
        V, vscale = xpts_c, cscale
    has_v = V is not None
    p = V.shape[2] if has_v else 1
    r = A.shape[2] if A is not None else 0
    cfg = transport_config(d, p, r, precision)
    if grad:
        # The gradient reads V = the column points through the d tiling.
        cfg = TransportConfig(
            cfg.block_m, cfg.block_n, cfg.block_d, cfg.d_tiles, cfg.block_d, cfg.d_tiles,
            cfg.block_r, cfg.r_tiles, cfg.num_warps, cfg.num_stages,
        )
        half = xr.element_size() == 2 and not split_ops
        tiles = grad_tiles(d) if cfg.d_tiles == 1 and half and not interpreting() else None
        if tiles is not None:
            bm, bn, warps, stages = tiles
            cfg = replace(cfg, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
    if has_v:
        V = V.contiguous()
        # The wide path accumulates in Out: start it at zero.
        alloc = torch.zeros if cfg.p_tiles > 1 else torch.empty
        out = alloc((B, n, p), dtype=dtype, device=rows.x.device)
    else:
        V = out = marg
    if A is not None:
        A = A.contiguous()
        Bw = Bw.contiguous()
    else:
        A = Bw = marg
    s3 = lambda t: (t.stride(0), t.stride(1)) if t.dim() == 3 else (0, 0)  # noqa: E731
    n_blocks = cdiv(n, cfg.block_m)
    cost, labels, rlab, clab, lcost, n_lab, lscale = cost_args(rows, cols)
    vec = has_v and p == 1 and not grad
    # The gradient's P y at "tf32" on the float16 grid copies: a float16 dot (TUNING.fp16_grad):
    # both it and the TF32 dot keep 10 bits of P. Only for the squared Euclidean cost: the
    # weighted tile of the others (e.g. divided by the distances) can exceed 1.
    p16 = (TUNING.fp16_grad and grad and precision == "tf32" and cfg.d_tiles == 1
           and cost == kernel_costs.SQEUCLIDEAN and xc.dtype == torch.float16
           and score_prec == "tf32")  # fmt: skip
    merge = cfg.p_tiles == 1 and TUNING.inplace_merge
    # Whole value tiles only (p = BLOCK_P, aligned rows): on an H200 the masked tiles of
    # p = 6 (d = 17) gave wrong sums and an illegal address, which the interpreter does not show.
    v16 = (TUNING.pv16 and has_v and not grad and not vec and r == 0 and precision == "tf32"
           and score_prec == "tf32" and whole_tile(p, cfg.block_p, cfg.p_tiles, V))  # fmt: skip
    col_scale = None
    if v16:
        V, col_scale = split_values(V)
    # V's rows are contiguous (V.contiguous() above): exactly p apart (V16: 2p, unmasked)
    even_p = has_v and whole_tile(p, cfg.block_p, cfg.p_tiles, V)
    kw = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        BLOCK_P=cfg.block_p, P_TILES=cfg.p_tiles, BLOCK_R=cfg.block_r, R_TILES=cfg.r_tiles,
        HAS_V=has_v, HADAMARD=r > 0, GRAD=grad, VEC=vec, P16=p16, V16=v16, PRECISION=precision,
        HAD_PRECISION=precision if cfg.block_r >= TC_MIN_RANK_BLOCK else "ieee",
        SCORE_PRECISION=score_prec, COST=cost, LABELS=labels, MERGE=merge,
        EVEN_D=even_d(cfg, d, xr, xc), EVEN_P=even_p,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION,
    )

    def args(pmax, psum, pwsum, pacc, cps, split, ticket):
        return (
            xr, xc, xpts_r, rows.sq, cols.sq, rows.logw, cols.logw, row_pot, col_pot,
            V, A, Bw, out, marg, rlab, clab, lcost,
            pmax, psum, pwsum, pacc, ticket,
            n, m, d, p, r, n_lab, cps, split,
            xr.stride(0), xr.stride(1), xc.stride(0), xc.stride(1), xpts_r.stride(0), xpts_r.stride(1),
            rows.sq.stride(0), cols.sq.stride(0),
            *s3(V), *s3(out), *s3(A), *s3(Bw), B * n, B * n * p,
            float(eps), float(cols.sq_floor), lscale, float(dot_scale), rscale, vscale,
        )

    splittable = cfg.p_tiles == 1
    # An unsplit sweep never touches the tickets: an int32 placeholder (the pointer type is
    # part of the compiled kernel's signature), no memset launch.
    ticket = torch.empty(1, dtype=torch.int32, device=rows.x.device)
    per_sm = None
    if splittable and rows.x.is_cuda:
        key = ("apply", tuple(kw.items()), xr.dtype, xc.dtype, xpts_r.dtype, V.dtype, A.dtype)
        per_sm = resident_blocks(
            key, _apply_fwd_kernel, (n_blocks, B, 1),
            *args(marg, marg, marg, marg, m, 1, ticket), **kw,
        )  # fmt: skip
    split, cps = transport_split(n_blocks * B, m, cfg.block_n, rows.x.device, splittable, per_sm)
    if merge and split > 1:
        # one ticket per row block, then the work-item counter
        ticket = torch.zeros(B * n_blocks + 1, dtype=torch.int32, device=rows.x.device)
    pmax = psum = pwsum = pacc = marg  # placeholders when not split
    f32 = dict(dtype=torch.float32, device=rows.x.device)
    if split > 1:
        rows_of = 1 if merge else split  # merge: one (max, sum) row state, no accumulators
        pmax = torch.empty((rows_of, B, n), **f32)
        psum = torch.empty((rows_of, B, n), **f32)
        if grad and cost != kernel_costs.SQEUCLIDEAN:
            pwsum = torch.empty((rows_of, B, n), **f32)
        if has_v and not merge:
            pacc = torch.empty((split, B, n, p), **f32)
    launch(_apply_fwd_kernel, (n_blocks, B, split),
           *args(pmax, psum, pwsum, pacc, cps, split, ticket), **kw)  # fmt: skip
    if split > 1 and not merge:
        launch(_apply_combine_kernel, (cdiv(n, COMBINE_ROWS), B),
            pmax, psum, pwsum, pacc, xpts_r, rows.sq, rows.logw, row_pot, out, marg,
            n, p, split,
            xpts_r.stride(0), xpts_r.stride(1), rows.sq.stride(0), *s3(out), B * n, B * n * p,
            float(eps), rscale,
            BLOCK_M=COMBINE_ROWS, BLOCK_P=cfg.block_p,
            HAS_V=has_v, GRAD=grad, COST=cost,
            num_warps=4, **FP_FUSION,
        )
    if col_scale is not None:
        out = out / col_scale
    return (out if has_v else None), marg


# fmt: on
def split_values(V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V (B, m, p) float32 as float16 hi and lo parts of V·s, (B, m, 2p), and the column
    scales s (B, 1, p): powers of two that bring each column's largest magnitude to [2^13, 2^14),
    well inside float16's range, so that hi + lo keep about 22 bits of every entry within
    2^-8 of its column's largest (smaller ones keep fewer, down to float16's subnormals)."""
    amax = V.abs().amax(1, keepdim=True)
    _, e = torch.frexp(amax)
    e = torch.where(amax > 0, e, torch.zeros_like(e)).clamp(-100, 100)
    s = torch.ldexp(torch.ones_like(amax), 14 - e)
    Vs = V * s
    hi = Vs.to(torch.float16)
    lo = (Vs - hi.to(V.dtype)).to(torch.float16)
    return torch.cat([hi, lo], -1).contiguous(), s


def transport(rows, cols, row_pot, col_pot, eps, V, A, Bw, precision):
    """See :meth:`flashsinkhorn.backends.base.Backend.transport`."""
    return _launch(rows, cols, row_pot, col_pot, eps, V, A, Bw, precision, grad=False)


def transport_grad(rows, cols, row_pot, col_pot, eps, precision):
    """See :meth:`flashsinkhorn.backends.base.Backend.transport_grad`."""
    return _launch(rows, cols, row_pot, col_pot, eps, None, None, None, precision, grad=True)
