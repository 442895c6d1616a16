"""Streaming online-LSE soft-min kernels (paper Algorithms 1 and 3).

Each program owns BLOCK_M rows, sweeps all columns in BLOCK_N tiles, forms the biased
dot-product scores on chip and keeps a running (max, sum) in base 2, so the n × m score matrix
never reaches HBM. The epilogue fuses the schedule's averaging and the unbalanced damping:
out = alpha · old + beta · T. Derivation: docs/kernels.md.
"""

from __future__ import annotations

import math
import threading

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, cuda_sm_count, launch, next_pow2
from ...problem import Side
from .configs import interpreter_operand, lse_config

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# n, m and every stride that depends on them change between calls: specialising on their
# divisibility would recompile for a new n or m at a known d.
_DYNAMIC = [
    "n_rows",
    "n_cols",
    "n_x",
    "n_y",
    "n_blocks_x",
    "s_rb",
    "s_cb",
    "s_vrb",
    "s_vcb",
    "s_xb",
    "s_yb",
    "s_fb",
    "s_gb",
    "s_ps",
    "s_pfs",
    "s_pgs",
    "cols_per_split",
    "cols_per_split_x",
    "cols_per_split_y",
    "n_split",
    "n_lab",
]


# ----- cost helpers shared by the soft-min (here) and transport (transport.py) kernels -----
# docs/costs.md. EUCLID and LABELS are constexpr: with both False the kernels compile to the
# plain squared-Euclidean code.


@triton.jit
def _load_parts(p_t, m_t, d, PRECISION: tl.constexpr):
    # A tile of score operands and, for PRECISION "f16x3", its low float16 part (stored d
    # columns to the right, problem.split_half); otherwise the tile twice (no second load).
    b_t = tl.load(p_t, mask=m_t, other=0.0)
    b_tl = b_t
    if PRECISION == "f16x3":
        b_tl = tl.load(p_t + d, mask=m_t, other=0.0)
    return b_t, b_tl


@triton.jit
def _score_dot(b_r, b_rl, b_c, b_cl, b_acc, PRECISION: tl.constexpr):
    # b_acc + r·cᵀ for one tile. "f16x3": hi·hi + hi·lo + lo·hi of the split parts, the small
    # products first; the float16 products are exact and accumulate in fp32 (docs/kernels.md).
    if PRECISION == "f16x3":
        b_acc = tl.dot(b_rl, tl.trans(b_c), b_acc)
        b_acc = tl.dot(b_r, tl.trans(b_cl), b_acc)
        b_acc = tl.dot(b_r, tl.trans(b_c), b_acc)
    else:
        b_acc = tl.dot(b_r, tl.trans(b_c), b_acc, input_precision=PRECISION)
    return b_acc


@triton.jit
def _score_tile(
    p_r, p_c, m_m, m_n, m_dd, b_r, b_rl, o_d, d,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # x_I · y_Jᵀ for one tile, shared by the soft-min, plan and transport sweeps. D_TILES == 1:
    # the row tile (b_r, and its low part b_rl for "f16x3") is already on chip and m_dd is the
    # feature mask of the column tile; otherwise the features come in BLOCK_D chunks. Also
    # returns the column tile (a placeholder with D_TILES > 1).
    b_s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if D_TILES == 1:
        b_c, b_cl = _load_parts(p_c, m_n[:, None] & m_dd[None, :], d, PRECISION)
        b_s = _score_dot(b_r, b_rl, b_c, b_cl, b_s, PRECISION)
    else:
        b_c = tl.zeros([BLOCK_N, BLOCK_D], p_c.dtype.element_ty)
        for i_d in range(D_TILES):
            m_d = (i_d * BLOCK_D + o_d) < d
            b_rd, b_rdl = _load_parts(
                p_r + i_d * BLOCK_D, m_m[:, None] & m_d[None, :], d, PRECISION
            )
            b_cd, b_cdl = _load_parts(
                p_c + i_d * BLOCK_D, m_n[:, None] & m_d[None, :], d, PRECISION
            )
            b_s = _score_dot(b_rd, b_rdl, b_cd, b_cdl, b_s, PRECISION)
    return b_s, b_c


@triton.jit
def _col_bias(Cpot, Csq, Clogw, o_vc, m_n, inv_eps2, EUCLID: tl.constexpr):
    # Base-2 column bias h_j and the column squared norms. Squared Euclidean (shifted form):
    # h_j = (p_j − ‖c_j‖²) log2e / eps + log2 w_j; euclidean: h_j = p_j log2e / eps + log2 w_j.
    b_csq = tl.load(Csq + o_vc, mask=m_n, other=0.0)
    if EUCLID:
        b_h = tl.load(Cpot + o_vc, mask=m_n, other=0.0) * inv_eps2
    else:
        b_h = (tl.load(Cpot + o_vc, mask=m_n, other=0.0) - b_csq) * inv_eps2
    b_h += tl.load(Clogw + o_vc, mask=m_n, other=float("-inf")) * 1.4426950408889634
    return b_h, b_csq


@triton.jit
def _label_rows(Rlab, Lcost, o_vr, m_m, n_lab, LABELS: tl.constexpr):
    # Row side of the label term, loaded once per program (rows are fixed over the sweep):
    # b_lr = l_i · V, and for LABELS >= 16 (on-chip mode, LABELS = padded V) the rows
    # W[l_i, :] of the table as two float16 parts whose sum is W / lscale to 22 bits.
    b_lr = tl.load(Rlab + o_vr, mask=m_m, other=0).to(tl.int64) * n_lab
    if LABELS >= 16:
        o_v = tl.arange(0, LABELS)
        m_w = m_m[:, None] & (o_v < n_lab)[None, :]
        p_w = Lcost + b_lr[:, None] + o_v[None, :]
        b_w0 = tl.load(p_w, mask=m_w, other=0.0)
        b_w1 = tl.load(p_w + n_lab * n_lab, mask=m_w, other=0.0)
    else:
        b_w0 = tl.zeros([1, 16], tl.float16)
        b_w1 = b_w0
    return b_lr, b_w0, b_w1


@triton.jit
def _label_tile(Lcost, b_lr, b_w0, b_w1, Clab, o_vc, m_m, m_n, n_lab, lscale,
                LABELS: tl.constexpr):  # fmt: skip
    # label_weight · W[l_i, l_j] for one tile, in fp32. One return statement: Triton 3.6
    # type-checks every return of a function, constexpr-dead ones included.
    b_lc = tl.load(Clab + o_vc, mask=m_n, other=0)
    if LABELS >= 16:
        # On chip: a tensor-core product of the staged rows W[l_i, :] with the one-hot matrix
        # of the column labels. Products with 1 and sums with zeros are exact, so the two
        # parts give W to 22 bits without a scattered load per score.
        b_hot = (tl.arange(0, LABELS)[:, None] == b_lc[None, :]).to(tl.float16)
        b_lab = tl.dot(b_w0, b_hot)
        b_lab = tl.dot(b_w1, b_hot, b_lab) * lscale
    else:
        # Any V: a gather from the V × V table (fp32; it stays in L1/L2).
        b_lab = tl.load(
            Lcost + b_lr[:, None] + b_lc.to(tl.int64)[None, :],
            mask=m_m[:, None] & m_n[None, :],
            other=0.0,
        ).to(tl.float32)
    return b_lab


@triton.jit
def _cost_scores(
    b_s, b_h, b_rsq, b_csq, b_lab, scale2, inv_eps2, dot_scale, sq_floor,
    EUCLID: tl.constexpr, LABELS: tl.constexpr,
):  # fmt: skip
    # Dot tile → base-2 score tile z_ij (the one place that knows the cost):
    # - squared Euclidean: z = 2 r·c log2e / eps + h_j (the row term ‖r_i‖² is in the epilogue);
    # - euclidean: D = sqrt(max(‖r_i‖² + ‖c_j‖² − 2 r·c, sq_floor)), z = h_j − D log2e / eps
    #   (the row term is inside the tile; the epilogue adds nothing);
    # - label term: z −= label_weight · W[l_i, l_j] log2e / eps.
    # Returns (z, D); D is the dot tile itself when not EUCLID (unused then).
    b_d = b_s
    if EUCLID:
        b_d2 = b_rsq[:, None] + b_csq[None, :] - (2.0 * dot_scale) * b_s
        b_d = tl.sqrt(tl.maximum(b_d2, sq_floor))
        b_z = b_h[None, :] - b_d * inv_eps2
    else:
        b_z = b_s * scale2 + b_h[None, :]
    if LABELS:
        b_z = b_z - b_lab * inv_eps2
    return b_z, b_d


@triton.jit
def _online_lse(b_max, b_sum, b_z):
    # One tile of the streaming base-2 LSE. Returns (new max, rescale factor of the old sum
    # and accumulators, the shift to use for this tile's exp2). A row that has seen only -inf (masked or zero-weight columns) keeps
    # max = -inf; shift by 0 there so that exp2 gives 0 instead of NaN.
    b_new = tl.maximum(b_max, tl.max(b_z, 1))
    b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
    b_alpha = tl.exp2(b_max - b_ref)
    return b_new, b_alpha, b_ref


@triton.jit
def _softmin_epilogue(
    b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW: tl.constexpr
):
    _softmin_epilogue_cost(
        b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW, False
    )


@triton.jit
def _softmin_epilogue_cost(
    b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW: tl.constexpr,
    EUCLID: tl.constexpr,
):  # fmt: skip
    # T_i = ‖r_i‖² − eps ln2 · log2-LSE (euclidean: no row term); the schedule's average and
    # the damping are fused here.
    if EUCLID:
        b_t = -(eps * 0.6931471805599453) * (b_max + tl.log2(b_sum))
    else:
        b_t = tl.load(Rsq + o_vr, mask=m_m, other=0.0) - (eps * 0.6931471805599453) * (
            b_max + tl.log2(b_sum)
        )
    b_out = beta * b_t + alpha * tl.load(Rold + o_vr, mask=m_m, other=0.0)
    tl.store(Out + o_vr, b_out, mask=m_m)
    if WRITE_RAW:
        tl.store(Raw + o_vr, b_t, mask=m_m)


@triton.jit
def _softmin_rows(
    R,
    C,
    Rsq,
    Csq,
    Clogw,
    Cpot,
    Rold,
    Out,
    Raw,
    Pmax,
    Psum,
    Rlab,
    Clab,
    Lcost,
    i_b,
    i_m,
    i_s,
    n_rows,
    n_cols,
    d,
    cols_per_split,
    n_split,
    n_lab,
    s_rb,
    s_rn,
    s_cb,
    s_cn,
    s_vrb,
    s_vcb,
    s_ps,
    eps,
    alpha,
    beta,
    dot_scale,
    sq_floor,
    lscale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
    WRITE_RAW: tl.constexpr,
    EUCLID: tl.constexpr,
    LABELS: tl.constexpr,
    EVEN_D: tl.constexpr,
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
    p_r = R + i_b64 * s_rb + o_m.to(tl.int64)[:, None] * s_rn + o_d[None, :]
    p_c0 = C + i_b64 * s_cb
    b_r = tl.zeros([BLOCK_M, BLOCK_D], R.dtype.element_ty)  # placeholder when D_TILES > 1
    b_rl = b_r
    if D_TILES == 1:
        b_r, b_rl = _load_parts(p_r, m_m[:, None] & m_dd[None, :], d, PRECISION)
    o_vr = i_b64 * s_vrb + o_m
    # Row-side operands of the cost tile, fixed over the column sweep.
    b_rsq = tl.zeros([BLOCK_M], tl.float32)
    if EUCLID:
        b_rsq = tl.load(Rsq + o_vr, mask=m_m, other=0.0)
    if LABELS:
        b_lr, b_w0, b_w1 = _label_rows(Rlab, Lcost, o_vr, m_m, n_lab, LABELS)

    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    # With n_split > 1, this program sweeps one chunk of the columns (a multiple of BLOCK_N wide) and
    # leaves its partial (max, sum) for _lse_combine_kernel: more programs than row blocks
    # when n is too small to fill the GPU.
    col_start = i_s * cols_per_split
    col_stop = tl.minimum(col_start + cols_per_split, n_cols)
    for start_n in range(col_start, col_stop, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_cols
        p_c = p_c0 + o_n.to(tl.int64)[:, None] * s_cn + o_d[None, :]
        b_s, _ = _score_tile(
            p_r,
            p_c,
            m_m,
            m_n,
            m_dd,
            b_r,
            b_rl,
            o_d,
            d,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            D_TILES,
            PRECISION,
        )
        o_vc = i_b64 * s_vcb + o_n
        b_h, b_csq = _col_bias(Cpot, Csq, Clogw, o_vc, m_n, inv_eps2, EUCLID)
        b_lab = b_s
        if LABELS:
            b_lab = _label_tile(
                Lcost, b_lr, b_w0, b_w1, Clab, o_vc, m_m, m_n, n_lab, lscale, LABELS
            )
        b_z, _ = _cost_scores(
            b_s, b_h, b_rsq, b_csq, b_lab, scale2, inv_eps2, dot_scale, sq_floor, EUCLID, LABELS
        )
        b_new, b_alpha, b_ref = _online_lse(b_max, b_sum, b_z)
        b_sum = b_sum * b_alpha + tl.sum(tl.exp2(b_z - b_ref[:, None]), 1)
        b_max = b_new

    # A run-time branch, not a constexpr: one compiled kernel serves every n and m.
    if n_split > 1:
        tl.store(Pmax + i_s * s_ps + o_vr, b_max, mask=m_m)
        tl.store(Psum + i_s * s_ps + o_vr, b_sum, mask=m_m)
    else:
        _softmin_epilogue_cost(
            b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW, EUCLID
        )


@triton.jit(do_not_specialize=_DYNAMIC)
def _softmin_fwd_kernel(
    R,
    C,
    Rsq,
    Csq,
    Clogw,
    Cpot,
    Rold,
    Out,
    Raw,
    Pmax,
    Psum,
    Rlab,
    Clab,
    Lcost,
    n_rows,
    n_cols,
    d,
    cols_per_split,
    n_split,
    n_lab,
    s_rb,
    s_rn,
    s_cb,
    s_cn,
    s_vrb,
    s_vcb,
    s_ps,
    eps,
    alpha,
    beta,
    dot_scale,
    sq_floor,
    lscale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
    WRITE_RAW: tl.constexpr,
    EUCLID: tl.constexpr,
    LABELS: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    _softmin_rows(
        R,
        C,
        Rsq,
        Csq,
        Clogw,
        Cpot,
        Rold,
        Out,
        Raw,
        Pmax,
        Psum,
        Rlab,
        Clab,
        Lcost,
        tl.program_id(1),
        tl.program_id(0),
        tl.program_id(2),
        n_rows,
        n_cols,
        d,
        cols_per_split,
        n_split,
        n_lab,
        s_rb,
        s_rn,
        s_cb,
        s_cn,
        s_vrb,
        s_vcb,
        s_ps,
        eps,
        alpha,
        beta,
        dot_scale,
        sq_floor,
        lscale,
        BLOCK_M,
        BLOCK_N,
        BLOCK_D,
        D_TILES,
        PRECISION,
        WRITE_RAW,
        EUCLID,
        LABELS,
        EVEN_D,
    )


@triton.jit(do_not_specialize=_DYNAMIC + ["guarded"])
def _softmin_sym_kernel(
    X,
    Y,
    Xsq,
    Ysq,
    Xlogw,
    Ylogw,
    F,
    G,
    Fout,
    Gout,
    Fraw,
    Graw,
    PFmax,
    PFsum,
    PGmax,
    PGsum,
    Xlab,
    Ylab,
    XLc,
    YLc,
    Guard,
    guarded,
    n_x,
    n_y,
    d,
    n_blocks_x,
    cols_per_split_x,
    cols_per_split_y,
    n_split,
    n_lab,
    s_xb,
    s_xn,
    s_yb,
    s_yn,
    s_fb,
    s_gb,
    s_pfs,
    s_pgs,
    eps,
    alpha,
    beta_x,
    beta_y,
    dot_scale,
    sq_floor,
    lscale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr,
    PRECISION: tl.constexpr,
    WRITE_RAW: tl.constexpr,
    EUCLID: tl.constexpr,
    LABELS: tl.constexpr,
    EVEN_D: tl.constexpr,
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
            X,
            Y,
            Xsq,
            Ysq,
            Ylogw,
            G,
            F,
            Fout,
            Fraw,
            PFmax,
            PFsum,
            Xlab,
            Ylab,
            XLc,
            i_b,
            i_m,
            i_s,
            n_x,
            n_y,
            d,
            cols_per_split_x,
            n_split,
            n_lab,
            s_xb,
            s_xn,
            s_yb,
            s_yn,
            s_fb,
            s_gb,
            s_pfs,
            eps,
            alpha,
            beta_x,
            dot_scale,
            sq_floor,
            lscale,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            D_TILES,
            PRECISION,
            WRITE_RAW,
            EUCLID,
            LABELS,
            EVEN_D,
        )
    else:
        _softmin_rows(
            Y,
            X,
            Ysq,
            Xsq,
            Xlogw,
            F,
            G,
            Gout,
            Graw,
            PGmax,
            PGsum,
            Ylab,
            Xlab,
            YLc,
            i_b,
            i_m - n_blocks_x,
            i_s,
            n_y,
            n_x,
            d,
            cols_per_split_y,
            n_split,
            n_lab,
            s_yb,
            s_yn,
            s_xb,
            s_xn,
            s_gb,
            s_fb,
            s_pgs,
            eps,
            alpha,
            beta_y,
            dot_scale,
            sq_floor,
            lscale,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            D_TILES,
            PRECISION,
            WRITE_RAW,
            EUCLID,
            LABELS,
            EVEN_D,
        )


@triton.jit
def _combine_rows(
    Pmax,
    Psum,
    Rsq,
    Rold,
    Out,
    Raw,
    i_b,
    i_m,
    n_rows,
    n_split,
    s_vrb,
    s_ps,
    eps,
    alpha,
    beta,
    BLOCK: tl.constexpr,
    WRITE_RAW: tl.constexpr,
    EUCLID: tl.constexpr,
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
    _softmin_epilogue_cost(
        b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW, EUCLID
    )


@triton.jit(do_not_specialize=_DYNAMIC + ["guarded"])
def _lse_combine_kernel(
    PFmax,
    PFsum,
    Xsq,
    F,
    Fout,
    Fraw,
    PGmax,
    PGsum,
    Ysq,
    G,
    Gout,
    Graw,
    Guard,
    guarded,
    n_x,
    n_y,
    n_blocks_x,
    n_split,
    s_fb,
    s_gb,
    s_pfs,
    s_pgs,
    eps,
    alpha,
    beta_x,
    beta_y,
    BLOCK: tl.constexpr,
    WRITE_RAW: tl.constexpr,
    EUCLID: tl.constexpr,
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
            PFmax,
            PFsum,
            Xsq,
            F,
            Fout,
            Fraw,
            i_b,
            i_m,
            n_x,
            n_split,
            s_fb,
            s_pfs,
            eps,
            alpha,
            beta_x,
            BLOCK,
            WRITE_RAW,
            EUCLID,
        )
    else:
        _combine_rows(
            PGmax,
            PGsum,
            Ysq,
            G,
            Gout,
            Graw,
            i_b,
            i_m - n_blocks_x,
            n_y,
            n_split,
            s_gb,
            s_pgs,
            eps,
            alpha,
            beta_y,
            BLOCK,
            WRITE_RAW,
            EUCLID,
        )


_COMBINE_BLOCK = 256
# Tests set this to force a split count; None lets split_count decide.
FORCE_SPLIT: int | None = None


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # interpreter: split already at small sizes so that the path is exercised
    return cuda_sm_count(device)


def split_count(n_programs: int, n_cols: int, block_n: int, device: torch.device) -> int:
    """Column chunks per row block so that the grid has about four programs per SM.

    Each chunk keeps at least four column tiles, so the merge stays cheap relative to the sweep.
    """
    if FORCE_SPLIT is not None:
        return max(1, min(FORCE_SPLIT, cdiv(n_cols, block_n)))
    target = 4 * _sm_count(device)
    if n_programs >= target:
        return 1
    min_tiles = 1 if device.type != "cuda" else 4
    max_split = max(1, cdiv(n_cols, block_n * min_tiles))
    return max(1, min(cdiv(target, n_programs), max_split))


def wave_split(n_programs: int, n_cols: int, block_n: int, per_sm: int, device) -> int:
    """Column chunks per row block that fill whole waves of ``per_sm`` resident blocks per SM.

    A grid of w waves, the last one partly empty, takes ⌈w⌉ times one block's time, and a
    block sweeps 1/split of the columns: the cost of a split s is ⌈n_programs·s / slots⌉ / s.
    The smallest s within 2 % of the best cost wins (fewer chunks: less merging). Each chunk
    keeps at least four column tiles, as in :func:`split_count`.
    """
    if FORCE_SPLIT is not None:
        return max(1, min(FORCE_SPLIT, cdiv(n_cols, block_n)))
    slots = per_sm * _sm_count(device)
    max_split = max(1, min(64, cdiv(n_cols, block_n * 4)))
    costs = [cdiv(n_programs * s, slots) / s for s in range(1, max_split + 1)]
    best = min(costs)
    return next(s for s, c in enumerate(costs, 1) if c <= 1.02 * best)


def _chunk(n_cols: int, split: int, block_n: int) -> int:
    """Columns per chunk, a multiple of the tile width."""
    return cdiv(cdiv(n_cols, split), block_n) * block_n


def plan_split(n_programs: int, n_cols: int, block_n: int, device) -> tuple[int, int]:
    """(number of column chunks, columns per chunk) for a single-side sweep."""
    cps = _chunk(n_cols, split_count(n_programs, n_cols, block_n, device), block_n)
    return cdiv(n_cols, cps), cps


def combine_one_side(
    pmax, psum, sq, old, out, raw, split, eps, alpha, beta, want_raw, euclid=False
):  # fmt: skip
    """Merges the partial (max, sum) of a split single-side sweep and applies the epilogue."""
    B, n = sq.shape
    nb = cdiv(n, _COMBINE_BLOCK)
    # The y-side slots repeat the x side; n_blocks_x = nb routes every program to it.
    args = (pmax, psum, sq, old, out, raw)
    launch(_lse_combine_kernel, (nb, B),
        *args, *args, sq, 0, n, n, nb, split, sq.stride(0), sq.stride(0), B * n, B * n,
        float(eps), float(alpha), float(beta), float(beta),
        BLOCK=_COMBINE_BLOCK, WRITE_RAW=want_raw, EUCLID=euclid, **FP_FUSION,
    )  # fmt: skip


def _partials(split: int, like: torch.Tensor):
    if split == 1:
        return like, like  # unused placeholders
    shape = (split,) + tuple(like.shape)
    return torch.empty(shape, dtype=torch.float32, device=like.device), torch.empty(
        shape, dtype=torch.float32, device=like.device
    )


def operands(rows: Side, cols: Side, precision: str):
    """Dot-product operands, the scale² that restores their product, and the dot precision.

    With precision "tf32" the sides carry float16 copies of the points on the same 11-bit grid
    (``problem.round_to_half_grid``): products are exact either way, and float16 halves the
    bytes and doubles the tensor-core rate. With "tf32x3" they carry float16 hi/lo parts
    (``problem.split_half``) and the kernels form hi·hi + hi·lo + lo·hi (flag "f16x3").
    """
    grid = rows.xk is not None and cols.xk is not None and not (rows.split or cols.split)
    if precision == "tf32" and grid:
        return rows.xk, cols.xk, rows.kscale * cols.kscale, "tf32"
    if precision == "tf32x3" and rows.split and cols.split:
        # float16 hi/lo parts: three exact float16 products per score (kernel flag "f16x3")
        # instead of Triton's TF32x3 on float32 operands, at twice the rate and with no
        # in-kernel splitting.
        return rows.xk, cols.xk, rows.kscale * cols.kscale, "f16x3"
    if rows.x.dtype != torch.float32:
        # float16/bfloat16 points: the dot is exact-product with fp32 accumulation whatever
        # the flag, which only selects how fp32 operands use the tensor cores.
        return interpreter_operand(rows.x), interpreter_operand(cols.x), 1.0, "tf32"
    return rows.x, cols.x, 1.0, precision


def _half(operand: torch.Tensor, flag: str) -> bool:
    """One 16-bit score operand per point (not the split parts of "f16x3")."""
    return operand.dtype in (torch.float16, torch.bfloat16) and flag != "f16x3"


# Label tables up to this many classes are staged on chip (see _label_tile).
ONCHIP_MAX_V = 32


def _half_parts(W: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(2, V, V) float16 parts with hi + lo = W / scale to 22 bits, and the power-of-two scale.

    The scale puts max |W| near 2^14, inside float16's range with room for the low part.
    """
    top = float(W.abs().max())
    scale = 2.0 ** (math.ceil(math.log2(top)) - 14) if top > 0 else 1.0
    w = (W.to(torch.float64) / scale).to(torch.float32)
    hi = w.to(torch.float16)
    lo = (w - hi.to(torch.float32)).to(torch.float16)
    return torch.stack([hi, lo]).contiguous(), scale


_PARTS_CACHE: dict = {}
_PARTS_LOCK = threading.Lock()


def _staged_table(W: torch.Tensor) -> tuple[torch.Tensor, float]:
    # One split per table (keyed by its storage and version), not one per launch.
    key = (W.data_ptr(), W.device, W.shape, W._version)
    with _PARTS_LOCK:
        hit = _PARTS_CACHE.get(key)
        if hit is None or hit[0] is not W:
            if len(_PARTS_CACHE) > 64:
                _PARTS_CACHE.clear()
            hit = (W, *_half_parts(W))
            _PARTS_CACHE[key] = hit
    return hit[1], hit[2]


def cost_args(rows: Side, cols: Side):
    """(EUCLID, LABELS, row labels, column labels, table, V, table scale) for the kernels.

    LABELS is 0 (no label term), 1 (W gathered from global memory, any V) or the padded V
    (16 or 32) when W is small enough to be staged on chip as two float16 parts. Unused
    pointers are placeholders (constexpr branches never read them).
    """
    euclid = rows.cost == "euclidean"
    if rows.labels is None:
        return euclid, 0, rows.sq, rows.sq, rows.sq, 1, 1.0
    V = rows.lcost.shape[0]
    if V <= ONCHIP_MAX_V and FORCE_GLOBAL_LABELS is False:
        parts, scale = _staged_table(rows.lcost)
        return euclid, max(16, next_pow2(V)), rows.labels, cols.labels, parts, V, scale
    lcost = rows.lcost.to(torch.float32).contiguous()
    return euclid, 1, rows.labels, cols.labels, lcost, V, 1.0


#: Tests set this to True to exercise the global-gather label path at small V.
FORCE_GLOBAL_LABELS = False


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
    cfg = lse_config(d, _half(xr, precision))
    out = torch.empty_like(rows.sq)
    raw = torch.empty_like(rows.sq) if want_raw else out
    n_blocks = cdiv(n, cfg.block_m)
    split, cps = plan_split(n_blocks * B, m, cfg.block_n, rows.x.device)
    pmax, psum = _partials(split, rows.sq)
    euclid, labels, rlab, clab, lcost, n_lab, lscale = cost_args(rows, cols)
    _softmin_fwd_kernel[(n_blocks, B, split)](
        xr,
        xc,
        rows.sq,
        cols.sq,
        cols.logw,
        col_pot,
        old,
        out,
        raw,
        pmax,
        psum,
        rlab,
        clab,
        lcost,
        n,
        m,
        d,
        cps,
        split,
        n_lab,
        xr.stride(0),
        xr.stride(1),
        xc.stride(0),
        xc.stride(1),
        rows.sq.stride(0),
        cols.sq.stride(0),
        B * n,
        float(eps),
        float(alpha),
        float(beta),
        float(dot_scale),
        float(cols.sq_floor),
        lscale,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=cfg.block_d,
        D_TILES=cfg.d_tiles,
        PRECISION=precision,
        WRITE_RAW=want_raw,
        EUCLID=euclid,
        LABELS=labels,
        EVEN_D=d == cfg.block_d and cfg.d_tiles == 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **FP_FUSION,
    )
    if split > 1:
        combine_one_side(
            pmax, psum, rows.sq, old, out, raw, split, eps, alpha, beta, want_raw, euclid
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
    cfg = lse_config(d, _half(xx, precision))
    f_new, g_new, f_raw, g_raw = step_outputs(f, g, want_raw) if out is None else out
    guarded = 0 if guard is None else 1
    guard = f if guard is None else guard
    n_blocks_x = cdiv(n, cfg.block_m)
    n_blocks = n_blocks_x + cdiv(m, cfg.block_m)
    split = split_count(n_blocks * B, min(n, m), cfg.block_n, X.x.device)
    cps_x, cps_y = _chunk(m, split, cfg.block_n), _chunk(n, split, cfg.block_n)
    split = max(cdiv(m, cps_x), cdiv(n, cps_y))
    pfmax, pfsum = _partials(split, f)
    pgmax, pgsum = _partials(split, g)
    euclid, labels, xlab, ylab, xlc, n_lab, lscale = cost_args(X, Y)
    ylc = cost_args(Y, X)[4] if labels else xlc
    launch(
        _softmin_sym_kernel,
        (n_blocks, B, split),
        xx,
        xy,
        X.sq,
        Y.sq,
        X.logw,
        Y.logw,
        f,
        g,
        f_new,
        g_new,
        f_raw,
        g_raw,
        pfmax,
        pfsum,
        pgmax,
        pgsum,
        xlab,
        ylab,
        xlc,
        ylc,
        guard,
        guarded,
        n,
        m,
        d,
        n_blocks_x,
        cps_x,
        cps_y,
        split,
        n_lab,
        xx.stride(0),
        xx.stride(1),
        xy.stride(0),
        xy.stride(1),
        f.stride(0),
        g.stride(0),
        B * n,
        B * m,
        float(eps),
        float(alpha),
        float(beta_x),
        float(beta_y),
        float(dot_scale),
        float(X.sq_floor),
        lscale,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=cfg.block_d,
        D_TILES=cfg.d_tiles,
        PRECISION=precision,
        WRITE_RAW=want_raw,
        EUCLID=euclid,
        LABELS=labels,
        EVEN_D=d == cfg.block_d and cfg.d_tiles == 1,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **FP_FUSION,
    )
    if split > 1:
        nbx = cdiv(n, _COMBINE_BLOCK)
        nb = nbx + cdiv(m, _COMBINE_BLOCK)
        launch(
            _lse_combine_kernel,
            (nb, B),
            pfmax,
            pfsum,
            X.sq,
            f,
            f_new,
            f_raw,
            pgmax,
            pgsum,
            Y.sq,
            g,
            g_new,
            g_raw,
            guard,
            guarded,
            n,
            m,
            nbx,
            split,
            f.stride(0),
            g.stride(0),
            B * n,
            B * m,
            float(eps),
            float(alpha),
            float(beta_x),
            float(beta_y),
            BLOCK=_COMBINE_BLOCK,
            WRITE_RAW=want_raw,
            EUCLID=euclid,
            **FP_FUSION,
        )
    if want_raw:
        return f_new, g_new, f_raw, g_raw
    return f_new, g_new, None, None
