"""Tile helpers shared by the soft-min, plan, transport and dense kernels.

Each helper works on one [BLOCK_M, BLOCK_N] tile (rows × columns) or on the row vectors of a
program, in base 2 (log2e folded into the scales). They are the one place that knows the
score operands (``load_parts``, ``score_tile``), the kernel cost (``col_bias``,
``cost_scores``, ``cost_from_sq``, ``grad_weight``, ``mean_cost``, the epilogue), the label
term (``label_rows``, ``label_tile``) and the streaming LSE (``online_lse``).

Kernel costs are the integer ``COST`` constexpr of ``backends/kernel_costs.py``: the squared
Euclidean cost in the shifted (dot-product) form, every other cost a function of the clamped
squared distance (docs/costs.md). With COST = SQEUCLIDEAN and LABELS = 0 the kernels compile
to the plain squared-Euclidean code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import kernel_costs

#: Kernel cost ids as constexpr globals of the kernels (values: backends/kernel_costs.py).
SQEUCLIDEAN = tl.constexpr(kernel_costs.SQEUCLIDEAN)
EUCLIDEAN = tl.constexpr(kernel_costs.EUCLIDEAN)


@triton.jit
def batch_base(P, i_b64, s_b, EVEN_D: tl.constexpr):
    # Start of problem i_b's points. EVEN_D promises (the launchers check it, operands.even_d)
    # that rows and batches start at multiples of 16 elements: the hint lets the compiler prove
    # the tile rows 16-byte aligned, so their loads vectorise and software-pipeline (cp.async).
    # Without it the run-time batch stride leaves them 2-byte scalar loads.
    off = i_b64 * s_b
    if EVEN_D:
        off = tl.multiple_of(off, 16)
    return P + off


@triton.jit
def load_parts(p_t, m_t, d, PRECISION: tl.constexpr):
    # A tile of score operands and, for PRECISION "f16x3", its low float16 part (stored d
    # columns to the right, problem.split_half); otherwise the tile twice (no second load).
    b_t = tl.load(p_t, mask=m_t, other=0.0)
    b_tl = b_t
    if PRECISION == "f16x3":
        b_tl = tl.load(p_t + d, mask=m_t, other=0.0)
    return b_t, b_tl


@triton.jit
def plan_row_block(
    X, Xsq, U, i_b64, i_m, n_x, d, s_xb, s_xn, s_fb,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, D_TILES: tl.constexpr,
    PRECISION: tl.constexpr, COST: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    # What a plan sweep keeps of row block i_m for its whole column loop: offsets and masks,
    # the row tile on chip (D_TILES == 1; else a placeholder, score_tile streams it), the row
    # bias u of the plan's exponent (formed once per step by the bias kernel: one load per row
    # instead of three and their arithmetic) and, for costs that need them, the squared norms.
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < n_x
    o_d = tl.arange(0, BLOCK_D)
    p_r = batch_base(X, i_b64, s_xb, EVEN_D) + o_m.to(tl.int64)[:, None] * s_xn + o_d[None, :]
    # EVEN_D (d == BLOCK_D): no feature mask, so the tile loads stay vectorised.
    m_dd = (o_d < BLOCK_D) if EVEN_D else (o_d < d)
    b_r = tl.zeros([BLOCK_M, BLOCK_D], X.dtype.element_ty)
    b_rl = b_r
    if D_TILES == 1:
        b_r, b_rl = load_parts(p_r, m_m[:, None] & m_dd[None, :], d, PRECISION)
    b_u = tl.load(U + i_b64 * n_x + o_m, mask=m_m, other=float("-inf"))
    b_rsq = tl.zeros([BLOCK_M], tl.float32)
    if COST != SQEUCLIDEAN:
        b_rsq = tl.load(Xsq + i_b64 * s_fb + o_m, mask=m_m, other=0.0)
    return o_m, m_m, o_d, p_r, m_dd, b_r, b_rl, b_u, b_rsq


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
def score_tile(
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
        b_c, b_cl = load_parts(p_c, m_n[:, None] & m_dd[None, :], d, PRECISION)
        b_s = _score_dot(b_r, b_rl, b_c, b_cl, b_s, PRECISION)
    else:
        b_c = tl.zeros([BLOCK_N, BLOCK_D], p_c.dtype.element_ty)
        for i_d in range(D_TILES):
            m_d = (i_d * BLOCK_D + o_d) < d
            b_rd, b_rdl = load_parts(p_r + i_d * BLOCK_D, m_m[:, None] & m_d[None, :], d, PRECISION)
            b_cd, b_cdl = load_parts(p_c + i_d * BLOCK_D, m_n[:, None] & m_d[None, :], d, PRECISION)
            b_s = _score_dot(b_rd, b_rdl, b_cd, b_cdl, b_s, PRECISION)
    return b_s, b_c


@triton.jit
def col_bias(Cpot, Csq, Clogw, o_vc, m_n, inv_eps2, COST: tl.constexpr):
    # Base-2 column bias h_j and the column squared norms. Squared Euclidean (shifted form):
    # h_j = (p_j − ‖c_j‖²) log2e / eps + log2 w_j; other costs: h_j = p_j log2e / eps + log2 w_j.
    # Also the row prefactor of the plan (the same formula on the row side).
    b_csq = tl.load(Csq + o_vc, mask=m_n, other=0.0)
    if COST == SQEUCLIDEAN:
        b_h = (tl.load(Cpot + o_vc, mask=m_n, other=0.0) - b_csq) * inv_eps2
    else:
        b_h = tl.load(Cpot + o_vc, mask=m_n, other=0.0) * inv_eps2
    b_h += tl.load(Clogw + o_vc, mask=m_n, other=float("-inf")) * 1.4426950408889634
    return b_h, b_csq


@triton.jit
def cost_from_sq(COST: tl.constexpr, b_d2, sq_floor):
    # The cost of a non-shifted kernel cost from the squared distances (clamped at sq_floor:
    # rounding of the expansion may make them slightly < 0). Euclidean: sqrt.
    if COST == EUCLIDEAN:
        b_c = tl.sqrt(tl.maximum(b_d2, sq_floor))
    else:
        tl.static_assert(COST == EUCLIDEAN, "cost_from_sq: no formula for this kernel cost")
        b_c = b_d2
    return b_c


@triton.jit
def grad_weight(COST: tl.constexpr, b_p, b_c, sq_floor):
    # b_p times the weight w_ij of the envelope gradient Σ_j P_ij w_ij (r_i − c_j) of a
    # non-shifted cost, from its cost tile b_c. Euclidean: w = 1 / D, and the subgradient 0
    # where the distance is at the floor.
    if COST == EUCLIDEAN:
        b_far = b_c > tl.sqrt(sq_floor)
        b_w = tl.where(b_far, b_p / tl.where(b_far, b_c, 1.0), 0.0)
    else:
        tl.static_assert(COST == EUCLIDEAN, "grad_weight: no formula for this kernel cost")
        b_w = b_p
    return b_w


@triton.jit
def mean_cost(cost, b_msq):
    # Estimate of the mean cost between two clouds from their mean squared distance (cost: a
    # run-time id, so that one compiled kernel serves every cost). Euclidean: its square root,
    # an upper bound of the mean distance (Jensen).
    return tl.where(cost == EUCLIDEAN, tl.sqrt(b_msq), b_msq)


@triton.jit
def label_rows(Rlab, Lcost, o_vr, m_m, n_lab, LABELS: tl.constexpr):
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
def label_tile(Lcost, b_lr, b_w0, b_w1, Clab, o_vc, m_m, m_n, n_lab, lscale,
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
def cost_scores(
    b_s, b_h, b_rsq, b_csq, b_lab, scale2, inv_eps2, dot_scale, sq_floor,
    COST: tl.constexpr, LABELS: tl.constexpr,
):  # fmt: skip
    # Dot tile → base-2 score tile z_ij (the one place that forms the cost's scores):
    # - squared Euclidean: z = 2 r·c log2e / eps + h_j (the row term ‖r_i‖² is in the epilogue);
    # - other costs: C = cost_from_sq(‖r_i‖² + ‖c_j‖² − 2 r·c), z = h_j − C log2e / eps (the row
    #   term is inside the tile; the epilogue adds nothing);
    # - label term: z −= label_weight · W[l_i, l_j] log2e / eps.
    # Returns (z, C); C is the dot tile itself for the squared Euclidean cost (unused then).
    b_d = b_s
    if COST == SQEUCLIDEAN:
        b_z = b_s * scale2 + b_h[None, :]
    else:
        b_d2 = b_rsq[:, None] + b_csq[None, :] - (2.0 * dot_scale) * b_s
        b_d = cost_from_sq(COST, b_d2, sq_floor)
        b_z = b_h[None, :] - b_d * inv_eps2
    if LABELS:
        b_z = b_z - b_lab * inv_eps2
    return b_z, b_d


@triton.jit
def online_lse(b_max, b_sum, b_z):
    # One tile of the streaming base-2 LSE. Returns (new max, rescale factor of the old sum
    # and accumulators, the shift to use for this tile's exp2). A row that has seen only -inf
    # (masked or zero-weight columns) keeps max = -inf; shift by 0 there so that exp2 gives 0
    # instead of NaN.
    b_new = tl.maximum(b_max, tl.max(b_z, 1))
    b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
    b_alpha = tl.exp2(b_max - b_ref)
    return b_new, b_alpha, b_ref


@triton.jit
def expm1(t):
    # e^t − 1 to a few ulps: Taylor (Horner, degree 8; the first dropped term is below 1e-10
    # relative for |t| < 1/4) near 0, where exp(t) − 1 would keep only u/|t| of the result.
    b_q = 1.0 + t * (1.0 / 8.0)
    b_q = 1.0 + t * (1.0 / 7.0) * b_q
    b_q = 1.0 + t * (1.0 / 6.0) * b_q
    b_q = 1.0 + t * (1.0 / 5.0) * b_q
    b_q = 1.0 + t * (1.0 / 4.0) * b_q
    b_q = 1.0 + t * (1.0 / 3.0) * b_q
    b_q = 1.0 + t * 0.5 * b_q
    return tl.where(tl.abs(t) < 0.25, t * b_q, tl.exp(t) - 1.0)


@triton.jit
def log1p(s):
    # ln(1 + s) to a few ulps: its series (degree 9, alternating; the first dropped term is
    # below 1e-9 relative for |s| < 1/8) near 0, the direct form elsewhere.
    b_q = 1.0 - s * (8.0 / 9.0)
    b_q = 1.0 - s * (7.0 / 8.0) * b_q
    b_q = 1.0 - s * (6.0 / 7.0) * b_q
    b_q = 1.0 - s * (5.0 / 6.0) * b_q
    b_q = 1.0 - s * (4.0 / 5.0) * b_q
    b_q = 1.0 - s * (3.0 / 4.0) * b_q
    b_q = 1.0 - s * (2.0 / 3.0) * b_q
    b_q = 1.0 - s * 0.5 * b_q
    return tl.where(tl.abs(s) < 0.125, s * b_q, tl.log(1.0 + s))


@triton.jit
def softmin_epilogue(
    b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW: tl.constexpr,
    COST: tl.constexpr,
):  # fmt: skip
    # T_i = ‖r_i‖² − eps ln2 · log2-LSE (other costs: no row term); the schedule's average and
    # the damping are fused here: out = alpha · old + beta · T.
    if COST == SQEUCLIDEAN:
        b_t = tl.load(Rsq + o_vr, mask=m_m, other=0.0) - (eps * 0.6931471805599453) * (
            b_max + tl.log2(b_sum)
        )
    else:
        b_t = -(eps * 0.6931471805599453) * (b_max + tl.log2(b_sum))
    b_out = beta * b_t + alpha * tl.load(Rold + o_vr, mask=m_m, other=0.0)
    tl.store(Out + o_vr, b_out, mask=m_m)
    if WRITE_RAW:
        tl.store(Raw + o_vr, b_t, mask=m_m)
