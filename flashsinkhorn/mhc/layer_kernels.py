"""Triton kernels of the hyper-connection layer (forward and backward).

Shapes: T tokens, n streams, C channels, K = n·C, N = n² + 2n coefficients (NP = N padded to
a power of two), x = X viewed as (T, K) with stream i at columns [i·C, (i+1)·C).

Forward: ``_hc_gemm_rms_kernel`` (split-K x·φ and Σx², one pass over X) →
``_hc_finalize_kernel`` (sum of the splits, r, alpha/bias, sigmoid and 2·sigmoid) → projection
→ ``_hc_premix_kernel`` (u = Σ_i H_pre[i]·X[i]) → ``_hc_residual_kernel``
(X_next = H_res·X + H_postᵀ·F, X read once and X_next written once).
Backward: ``_hc_residual_bwd_kernel`` (dF, dH_post, dH_res in one pass over dX_next, X, F) →
``_hc_premix_bwd_kernel`` (dH_pre) → coefficient backward (tiny, torch and the projection
backward) → ``_hc_dx_kernel`` (dX = H_resᵀ·dX_next + H_pre⊗du + dh·φᵀ + RMS term, by token
blocks) and ``_hc_dphi_kernel`` (partial dφᵀ = dhᵀ·x, K-major over token splits). The unfused
schedule (``TUNING.mhc_fused_dx = False``, :mod:`flashsinkhorn.tuning`): the residual backward
also writes dX_res = H_resᵀ·dX_next and ``_hc_input_bwd_kernel`` reads it back, writing dX and
accumulating dφ in one pass over X.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hc_gemm_rms_kernel(
    p_x,
    p_phi,
    p_y,
    p_ss,
    T,
    K,
    N,
    k_split,
    s_wk,
    s_wn,
    BM: tl.constexpr,
    BK: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # Split-K: N is tiny and K huge, so parallelism comes from K; each split writes partial sums.
    i_m = tl.program_id(0)
    i_s = tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    b_acc = tl.zeros((BM, NP), tl.float32)
    b_ss = tl.zeros((BM,), tl.float32)
    k0 = i_s * k_split
    for kk in range(0, k_split, BK):
        o_k = k0 + kk + tl.arange(0, BK)
        m_k = (o_k < K) & (kk + tl.arange(0, BK) < k_split)
        p_xt = p_x + o_m[:, None].to(tl.int64) * K + o_k[None, :]
        b_x = tl.load(p_xt, mask=m_m[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        # φ is read through strides: (1, K) strides (a K-major φᵀ copy) let tf32 wgmma take
        # the tile from shared memory as it is; φ's own (N, 1) layout is N-major.
        p_w = p_phi + o_k[:, None].to(tl.int64) * s_wk + o_n[None, :].to(tl.int64) * s_wn
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0).to(tl.float32)
        b_acc += tl.dot(b_x, b_w, input_precision=PREC)
        # The RMS reduction rides on the tile already in registers: X is read once.
        b_ss += tl.sum(b_x * b_x, 1)
    o_mn = i_s.to(tl.int64) * T * NP + o_m[:, None].to(tl.int64) * NP + o_n[None, :]
    tl.store(p_y + o_mn, b_acc, mask=m_m[:, None])
    tl.store(p_ss + i_s.to(tl.int64) * T + o_m, b_ss, mask=m_m)


@triton.jit
def _hc_finalize_kernel(
    p_y,
    p_ss,
    p_alpha_pre,
    p_alpha_post,
    p_alpha_res,
    p_bias,
    p_yraw,
    p_r,
    p_coef,
    p_res,
    T,
    K,
    N,
    n,
    n_split,
    rms_eps,
    BM: tl.constexpr,
    NP: tl.constexpr,
    SOFTMAX: tl.constexpr = False,
):
    # Sum of the split-K partials fused with r, alpha, bias and the activations (H_pre: sigmoid,
    # or with SOFTMAX a softmax over the n streams).
    i_m = tl.program_id(0)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    b_y = tl.zeros((BM, NP), tl.float32)
    b_ss = tl.zeros((BM,), tl.float32)
    for s in range(n_split):
        o_mn = s * T * NP + o_m[:, None].to(tl.int64) * NP + o_n[None, :]
        b_y += tl.load(p_y + o_mn, mask=m_m[:, None], other=0.0)
        b_ss += tl.load(p_ss + s * T + o_m, mask=m_m, other=0.0)
    b_r = tl.sqrt(b_ss / K + rms_eps)
    a_pre = tl.load(p_alpha_pre).to(tl.float32)
    a_post = tl.load(p_alpha_post).to(tl.float32)
    a_res = tl.load(p_alpha_res).to(tl.float32)
    b_alpha = tl.where(o_n < n, a_pre, tl.where(o_n < 2 * n, a_post, a_res))
    b_bias = tl.load(p_bias + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_z = b_alpha[None, :] * b_y / b_r[:, None] + b_bias[None, :]
    b_sig = 1.0 / (1.0 + tl.exp2(-b_z * 1.4426950408889634))
    is_pre = (o_n < n)[None, :]
    b_act = tl.where(is_pre, b_sig, 2.0 * b_sig)
    if SOFTMAX:
        b_zp = tl.where(is_pre, b_z, -float("inf"))
        b_e = tl.exp2((b_zp - tl.max(b_zp, 1)[:, None]) * 1.4426950408889634)
        b_act = tl.where(is_pre, b_e / tl.sum(b_e, 1)[:, None], b_act)
    m_2d = m_m[:, None] & m_n[None, :]
    tl.store(p_yraw + o_m[:, None].to(tl.int64) * N + o_n[None, :], b_y, mask=m_2d)
    tl.store(p_r + o_m, b_r, mask=m_m)
    p_c = p_coef + o_m[:, None].to(tl.int64) * (2 * n) + o_n[None, :]
    tl.store(p_c, b_act, mask=m_2d & (o_n < 2 * n)[None, :])
    p_rs = p_res + o_m[:, None].to(tl.int64) * (n * n) + (o_n[None, :] - 2 * n)
    tl.store(p_rs, b_z, mask=m_2d & (o_n >= 2 * n)[None, :])


@triton.jit
def _hres_tile(p, i_t, n, NS: tl.constexpr):
    # pointers and mask of token i_t's n×n H_res (or dH_res), padded to NS×NS
    o_i = tl.arange(0, NS)
    m_i = o_i < n
    return p + i_t * n * n + o_i[:, None] * n + o_i[None, :], m_i[:, None] & m_i[None, :]


@triton.jit
def _load_hres(p_hres, i_t, n, NS: tl.constexpr):
    p_h, m_ii = _hres_tile(p_hres, i_t, n, NS)
    return tl.load(p_h, mask=m_ii, other=0.0).to(tl.float32)


@triton.jit
def _store_dhres(p_dhres, i_t, n, b_dh, NS: tl.constexpr):
    p_dh, m_ii = _hres_tile(p_dhres, i_t, n, NS)
    tl.store(p_dh, b_dh, mask=m_ii)


@triton.jit
def _hc_premix_kernel(p_x, p_coef, p_u, n, C, NS: tl.constexpr, BC: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o_i = tl.arange(0, NS)
    m_i = o_i < n
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_x = tl.load(
        p_x + i_t * n * C + o_i[:, None] * C + o_c[None, :],
        mask=m_i[:, None] & m_c[None, :],
        other=0.0,
    ).to(tl.float32)
    b_h = tl.load(p_coef + i_t * 2 * n + o_i, mask=m_i, other=0.0)
    b_u = tl.sum(b_h[:, None] * b_x, 0)
    tl.store(p_u + i_t * C + o_c, b_u.to(p_u.dtype.element_ty), mask=m_c)


@triton.jit
def _hc_residual_kernel(
    p_x,
    p_f,
    p_coef,
    p_hres,
    p_out,
    n,
    C,
    NS: tl.constexpr,
    BC: tl.constexpr,
    MIX: tl.constexpr = True,
):
    # X_next[i, c] = Σ_j H_res[i, j]·X[j, c] + H_post[i]·F[c]: X read once, X_next written once.
    # Without MIX, H_res is the identity (X is an already mixed residual).
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o_i = tl.arange(0, NS)
    m_i = o_i < n
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    m_ic = m_i[:, None] & m_c[None, :]
    p_xt = p_x + i_t * n * C + o_i[:, None] * C + o_c[None, :]
    b_x = tl.load(p_xt, mask=m_ic, other=0.0).to(tl.float32)
    b_f = tl.load(p_f + i_t * C + o_c, mask=m_c, other=0.0).to(tl.float32)
    b_post = tl.load(p_coef + i_t * 2 * n + n + o_i, mask=m_i, other=0.0)
    if MIX:
        b_h = _load_hres(p_hres, i_t, n, NS)
        b_o = tl.sum(b_h[:, :, None] * b_x[None, :, :], 1) + b_post[:, None] * b_f[None, :]
    else:
        b_o = b_x + b_post[:, None] * b_f[None, :]
    p_o = p_out + i_t * n * C + o_i[:, None] * C + o_c[None, :]
    tl.store(p_o, b_o.to(p_out.dtype.element_ty), mask=m_ic)


@triton.jit
def _hc_residual_bwd_kernel(
    p_do,
    p_x,
    p_f,
    p_coef,
    p_hres,
    p_dx,
    p_df,
    p_dpost,
    p_dhres,
    n,
    C,
    NS: tl.constexpr,
    BC: tl.constexpr,
    WRITE_DX: tl.constexpr = True,
    MIX: tl.constexpr = True,
):
    # One token per program; dH_post and dH_res reduce over C in registers. With WRITE_DX off
    # the H_resᵀ·dX_next part of dX is left to _hc_dx_kernel. Without MIX (identity H_res) there
    # is no dH_res, and dX is dX_next itself (the caller uses it as is).
    i_t = tl.program_id(0).to(tl.int64)
    o_i = tl.arange(0, NS)
    m_i = o_i < n
    if WRITE_DX and MIX:
        b_h = _load_hres(p_hres, i_t, n, NS)
    b_post = tl.load(p_coef + i_t * 2 * n + n + o_i, mask=m_i, other=0.0)
    b_dpost = tl.zeros((NS,), tl.float32)
    b_dh = tl.zeros((NS, NS), tl.float32)
    for c0 in range(0, C, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < C
        m_ic = m_i[:, None] & m_c[None, :]
        o_ic = i_t * n * C + o_i[:, None] * C + o_c[None, :]
        b_do = tl.load(p_do + o_ic, mask=m_ic, other=0.0).to(tl.float32)
        b_f = tl.load(p_f + i_t * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        if WRITE_DX and MIX:
            # dX[j] = Σ_i H_res[i, j]·dX_next[i]
            b_dx = tl.sum(b_h[:, :, None] * b_do[:, None, :], 0)
            tl.store(p_dx + o_ic, b_dx.to(p_dx.dtype.element_ty), mask=m_ic)
        b_df = tl.sum(b_post[:, None] * b_do, 0)
        tl.store(p_df + i_t * C + o_c, b_df.to(p_df.dtype.element_ty), mask=m_c)
        b_dpost += tl.sum(b_do * b_f[None, :], 1)
        if MIX:
            b_x = tl.load(p_x + o_ic, mask=m_ic, other=0.0).to(tl.float32)
            b_dh += tl.sum(b_do[:, None, :] * b_x[None, :, :], 2)
    tl.store(p_dpost + i_t * n + o_i, b_dpost, mask=m_i)
    if MIX:
        _store_dhres(p_dhres, i_t, n, b_dh, NS)


@triton.jit
def _hc_premix_bwd_kernel(p_du, p_x, p_dpre, n, C, NS: tl.constexpr, BC: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    o_i = tl.arange(0, NS)
    m_i = o_i < n
    b_acc = tl.zeros((NS,), tl.float32)
    for c0 in range(0, C, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < C
        b_du = tl.load(p_du + i_t * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_x = tl.load(
            p_x + i_t * n * C + o_i[:, None] * C + o_c[None, :],
            mask=m_i[:, None] & m_c[None, :],
            other=0.0,
        ).to(tl.float32)
        b_acc += tl.sum(b_x * b_du[None, :], 1)
    tl.store(p_dpre + i_t * n + o_i, b_acc, mask=m_i)


@triton.jit
def _hc_input_bwd_kernel(
    p_x,
    p_dxr,
    p_du,
    p_coef,
    p_dy,
    p_rcoef,
    p_phi,
    p_dx,
    p_dphi,
    T,
    K,
    N,
    n,
    C,
    n_tsplit,
    BM: tl.constexpr,
    BK: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # dX = dX_res + H_pre[i]·du + dh·φᵀ + ρ·x (ρ: RMS term) and the partial dφ = xᵀ·dh over this
    # program's token blocks: one pass over X and dX_res, dX written once.
    i_k = tl.program_id(0)
    i_s = tl.program_id(1)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    o_stream = o_k // C
    o_chan = o_k % C
    b_wt = tl.load(
        p_phi + o_k[None, :].to(tl.int64) * N + o_n[:, None],
        mask=m_k[None, :] & m_n[:, None],
        other=0.0,
    ).to(tl.float32)
    b_dphi = tl.zeros((NP, BK), tl.float32)
    n_tb = tl.cdiv(T, BM)
    for tb in range(i_s, n_tb, n_tsplit):
        o_m = tb * BM + tl.arange(0, BM)
        m_m = o_m < T
        m_mk = m_m[:, None] & m_k[None, :]
        o_mk = o_m[:, None].to(tl.int64) * K + o_k[None, :]
        b_x = tl.load(p_x + o_mk, mask=m_mk, other=0.0).to(tl.float32)
        b_dxr = tl.load(p_dxr + o_mk, mask=m_mk, other=0.0).to(tl.float32)
        b_du = tl.load(
            p_du + o_m[:, None].to(tl.int64) * C + o_chan[None, :], mask=m_mk, other=0.0
        ).to(tl.float32)
        b_hp = tl.load(
            p_coef + o_m[:, None].to(tl.int64) * (2 * n) + o_stream[None, :],
            mask=m_mk,
            other=0.0,
        )
        b_dy = tl.load(
            p_dy + o_m[:, None].to(tl.int64) * NP + o_n[None, :], mask=m_m[:, None], other=0.0
        )
        b_rc = tl.load(p_rcoef + o_m, mask=m_m, other=0.0)
        b_dx = b_dxr + b_hp * b_du + tl.dot(b_dy, b_wt, input_precision=PREC)
        b_dx += b_rc[:, None] * b_x
        tl.store(p_dx + o_mk, b_dx.to(p_dx.dtype.element_ty), mask=m_mk)
        b_dyt = tl.load(
            p_dy + o_m[None, :].to(tl.int64) * NP + o_n[:, None], mask=m_m[None, :], other=0.0
        )
        b_dphi += tl.dot(b_dyt, b_x, input_precision=PREC)
    p_o = p_dphi + i_s.to(tl.int64) * K * NP + o_k[None, :].to(tl.int64) * NP + o_n[:, None]
    tl.store(p_o, b_dphi, mask=m_k[None, :])


@triton.jit
def _widen(b, BM: tl.constexpr, NS: tl.constexpr, BC: tl.constexpr):
    # [BM, NS] → [BM, NS·BC] with column j·BC + c holding b[:, j]
    return tl.reshape(tl.broadcast_to(b[:, :, None], (BM, NS, BC)), (BM, NS * BC))


@triton.jit(do_not_specialize=["m_base"])
def _hc_dx_kernel(
    p_x,
    p_dout,
    p_du,
    p_coef,
    p_hres,
    p_dy,
    p_rcoef,
    p_phi,
    p_dx,
    T,
    K,
    N,
    n,
    C,
    m_base,
    BM: tl.constexpr,
    BC: tl.constexpr,
    NS: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
    HAS_DOUT: tl.constexpr = True,
    HAS_DU: tl.constexpr = True,
):
    # Without HAS_DOUT / HAS_DU (coefficients only, no mixing) the first two terms are absent.
    # dX = H_resᵀ·dX_next + H_pre[j]·du + dh·φᵀ + ρ·x for BM tokens × channels [c0, c0 + BC) of
    # every stream (columns kk = j·BC + c ↔ K-index j·C + c0 + c), one tile per program: the
    # residual part is computed here from dX_next, so dX_res never goes through HBM. dφ is left
    # to _hc_dphi_kernel. Channel blocks vary fastest over the grid, so the programs resident
    # together read whole rows of X and dX_next (12 % faster than token blocks fastest).
    # Token blocks sit on grid axis 1 (at most 65,535 blocks): the host launches larger T in
    # slices of token blocks starting at m_base.
    i_c = tl.program_id(0)
    i_m = tl.program_id(1) + m_base
    o_kk = tl.arange(0, NS * BC)
    o_j = o_kk // BC
    o_cc = i_c * BC + o_kk % BC
    m_kk = (o_j < n) & (o_cc < C)
    o_k = o_j * C + o_cc
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    o_s = tl.arange(0, NS)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T
    m_mk = m_m[:, None] & m_kk[None, :]
    m_ms = m_m[:, None] & (o_s < n)[None, :]
    o_t = o_m[:, None].to(tl.int64)
    o_mk = o_t * K + o_k[None, :]
    b_x = tl.load(p_x + o_mk, mask=m_mk, other=0.0).to(tl.float32)
    b_rc = tl.load(p_rcoef + o_m, mask=m_m, other=0.0)
    b_dx = b_rc[:, None] * b_x
    if HAS_DU:
        b_du = tl.load(p_du + o_t * C + o_cc[None, :], mask=m_mk, other=0.0).to(tl.float32)
        b_hp = tl.load(p_coef + o_t * (2 * n) + o_s[None, :], mask=m_ms, other=0.0)
        b_dx += _widen(b_hp, BM, NS, BC) * b_du
    if HAS_DOUT:
        for i in range(n):
            # dX[j] += H_res[i, j]·dX_next[i] (the dX_next tile of stream i feeds every j)
            b_do = tl.load(p_dout + o_t * K + i * C + o_cc[None, :], mask=m_mk, other=0.0)
            b_h = tl.load(p_hres + o_t * (n * n) + i * n + o_s[None, :], mask=m_ms, other=0.0)
            b_dx += _widen(b_h.to(tl.float32), BM, NS, BC) * b_do.to(tl.float32)
    b_wt = tl.load(
        p_phi + o_k[None, :].to(tl.int64) * N + o_n[:, None],
        mask=m_kk[None, :] & m_n[:, None],
        other=0.0,
    ).to(tl.float32)
    b_dy = tl.load(p_dy + o_t * NP + o_n[None, :], mask=m_m[:, None], other=0.0)
    b_dx += tl.dot(b_dy, b_wt, input_precision=PREC)
    tl.store(p_dx + o_mk, b_dx.to(p_dx.dtype.element_ty), mask=m_mk)


@triton.jit
def _hc_dphi_kernel(
    p_x,
    p_dy,
    p_dphi,
    T,
    K,
    n_tsplit,
    BM: tl.constexpr,
    BK: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # Partial dφ over this program's token blocks (split over tokens; summed on the host),
    # accumulated as dφᵀ = dhᵀ·x: x stays the untransposed right-hand operand. As the left-hand
    # xᵀ it is M-major, which tf32 wgmma cannot read, and the staged transpose ran at 30 % of
    # bandwidth (docs/performance.md, mHC log 6); Triton's CUDA-core (ieee) dot is also faster
    # this way round.
    i_k = tl.program_id(0)
    i_s = tl.program_id(1)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, NP)
    b_acc = tl.zeros((NP, BK), tl.float32)
    n_tb = tl.cdiv(T, BM)
    for tb in range(i_s, n_tb, n_tsplit):
        o_m = tb * BM + tl.arange(0, BM)
        m_m = o_m < T
        b_x = tl.load(
            p_x + o_m[:, None].to(tl.int64) * K + o_k[None, :],
            mask=m_m[:, None] & m_k[None, :],
            other=0.0,
        ).to(tl.float32)
        b_dyt = tl.load(
            p_dy + o_m[None, :].to(tl.int64) * NP + o_n[:, None], mask=m_m[None, :], other=0.0
        )
        b_acc += tl.dot(b_dyt, b_x, input_precision=PREC)
    p_o = p_dphi + i_s.to(tl.int64) * K * NP + o_k[None, :].to(tl.int64) * NP + o_n[:, None]
    tl.store(p_o, b_acc, mask=m_k[None, :])


@triton.jit
def _hc_stream_mix_kernel(
    p_x,
    p_hpre,
    s_hp,
    p_hres,
    p_u,
    p_r,
    n,
    C,
    NS: tl.constexpr,
    BC: tl.constexpr,
    WRITE_R: tl.constexpr,
):
    # u = Σ_i H_pre[i]·X[i] and R[i] = Σ_j H_res[i, j]·X[j] from one read of X (H_pre rows at
    # stride s_hp: the layer's (T, 2n) coefficient buffer or a (T, n) tensor).
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o_i = tl.arange(0, NS)
    m_i = o_i < n
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    m_ic = m_i[:, None] & m_c[None, :]
    o_ic = i_t * n * C + o_i[:, None] * C + o_c[None, :]
    b_x = tl.load(p_x + o_ic, mask=m_ic, other=0.0).to(tl.float32)
    b_hp = tl.load(p_hpre + i_t * s_hp + o_i, mask=m_i, other=0.0).to(tl.float32)
    b_u = tl.sum(b_hp[:, None] * b_x, 0)
    tl.store(p_u + i_t * C + o_c, b_u.to(p_u.dtype.element_ty), mask=m_c)
    if WRITE_R:
        b_h = _load_hres(p_hres, i_t, n, NS)
        b_r = tl.sum(b_h[:, :, None] * b_x[None, :, :], 1)
        tl.store(p_r + o_ic, b_r.to(p_r.dtype.element_ty), mask=m_ic)


@triton.jit
def _hc_stream_mix_bwd_kernel(
    p_du,
    p_dr,
    p_x,
    p_hpre,
    s_hp,
    p_hres,
    p_dx,
    p_dpre,
    p_dhres,
    n,
    C,
    NS: tl.constexpr,
    BC: tl.constexpr,
    HAS_DU: tl.constexpr,
    HAS_DR: tl.constexpr,
    DHRES: tl.constexpr,
):
    # Backward of _hc_stream_mix_kernel, one token per program: dX[j] = H_pre[j]·du +
    # Σ_i H_res[i, j]·dR[i], dH_pre[j] = Σ_c du·X[j], dH_res[i, j] = Σ_c dR[i]·X[j] (DHRES).
    # The layer's static mode passes dX_next as dR and takes dH_res from the residual backward.
    i_t = tl.program_id(0).to(tl.int64)
    o_i = tl.arange(0, NS)
    m_i = o_i < n
    b_hp = tl.load(p_hpre + i_t * s_hp + o_i, mask=m_i, other=0.0).to(tl.float32)
    if HAS_DR:
        b_h = _load_hres(p_hres, i_t, n, NS)
    b_dpre = tl.zeros((NS,), tl.float32)
    b_dh = tl.zeros((NS, NS), tl.float32)
    for c0 in range(0, C, BC):
        o_c = c0 + tl.arange(0, BC)
        m_c = o_c < C
        m_ic = m_i[:, None] & m_c[None, :]
        o_ic = i_t * n * C + o_i[:, None] * C + o_c[None, :]
        b_x = tl.load(p_x + o_ic, mask=m_ic, other=0.0).to(tl.float32)
        b_dx = tl.zeros((NS, BC), tl.float32)
        if HAS_DU:
            b_du = tl.load(p_du + i_t * C + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_dx += b_hp[:, None] * b_du[None, :]
            b_dpre += tl.sum(b_x * b_du[None, :], 1)
        if HAS_DR:
            b_dr = tl.load(p_dr + o_ic, mask=m_ic, other=0.0).to(tl.float32)
            b_dx += tl.sum(b_h[:, :, None] * b_dr[:, None, :], 0)
            if DHRES:
                b_dh += tl.sum(b_dr[:, None, :] * b_x[None, :, :], 2)
        tl.store(p_dx + o_ic, b_dx.to(p_dx.dtype.element_ty), mask=m_ic)
    tl.store(p_dpre + i_t * n + o_i, b_dpre, mask=m_i)
    if DHRES:
        _store_dhres(p_dhres, i_t, n, b_dh, NS)
