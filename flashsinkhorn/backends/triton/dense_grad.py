"""Envelope gradient of a dense solve: the plan's row softmax from the stored Gram matrix.

For the squared Euclidean cost the gradient with respect to the row points is
2 â_i (r_i − Σ_j S_ij c_j) with S the row softmax of the scores z_ij (torch_ref). Here a
row block of S is written by one kernel that reads its strip of K twice (online LSE, then
exp2(z − LSE)), and S c is one cuBLAS product: three passes over the block's n·m values where
the eager torch chain made about seven (docs/performance.md, H200 section).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv
from ...problem import Side
from ..blocks import matmul_precision, row_chunks
from .configs import DENSE_SOFTMAX_TILES
from .tiles import online_lse


# Row strides and sizes vary per call; K's stride is a multiple of 16 (padded rows).
@triton.jit(do_not_specialize=["row0", "n_rows", "n_cols", "s_kb", "s_sb", "s_sr", "s_vcb", "s_lb"])
def _dense_softmax_fwd_kernel(
    K,
    Csq,
    Clogw,
    Cpot,
    S,
    Lse,
    row0,
    n_rows,
    n_cols,
    s_kb,
    s_k,
    s_sb,
    s_sr,
    s_vcb,
    s_lb,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    # Rows row0 + i of the orientation: K[r, c] (x side) or K[c, r] (y side). S and Lse are
    # indexed from row0 (the chunk's own buffers).
    i_m = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    scale2 = 2.0 * 1.4426950408889634 / eps
    inv_eps2 = 1.4426950408889634 / eps
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_m = row0 + o_r
    m_m = o_m < n_rows
    o_m64 = o_m.to(tl.int64)
    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, n_cols, BLOCK_N):
        b_z, m_n, o_n = k_scores(
            K, Csq, Clogw, Cpot, i_b, o_m, o_m64, m_m, start_n, n_cols, s_kb, s_k, s_vcb,
            scale2, inv_eps2, BLOCK_N, TRANSPOSED,
        )  # fmt: skip
        b_max, b_alpha, b_ref = online_lse(b_max, b_sum, b_z)
        b_sum = b_sum * b_alpha + tl.sum(tl.exp2(b_z - b_ref[:, None]), 1)
    # A row with no reachable column (every weight zero) has LSE −inf and an all-zero S row.
    b_lse = b_max + tl.log2(b_sum)
    b_sub = tl.where(b_max == float("-inf"), 0.0, b_lse)
    tl.store(Lse + i_b * s_lb + o_r, b_lse * 0.6931471805599453, mask=m_m)
    o_r64 = o_r.to(tl.int64)
    for start_n in range(0, n_cols, BLOCK_N):
        b_z, m_n, o_n = k_scores(
            K, Csq, Clogw, Cpot, i_b, o_m, o_m64, m_m, start_n, n_cols, s_kb, s_k, s_vcb,
            scale2, inv_eps2, BLOCK_N, TRANSPOSED,
        )  # fmt: skip
        p_s = S + i_b * s_sb + o_r64[:, None] * s_sr + o_n[None, :]
        tl.store(p_s, tl.exp2(b_z - b_sub[:, None]), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def k_scores(
    K, Csq, Clogw, Cpot, i_b, o_m, o_m64, m_m, start_n, n_cols, s_kb, s_k, s_vcb,
    scale2, inv_eps2, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr,
):  # fmt: skip
    """A [BLOCK_M, BLOCK_N] tile of log2-domain scores 2 K/eps + (g − ‖c‖²)/eps + log w read
    from K (row r, column c: K[r, c], or K[c, r] when TRANSPOSED); also returns the column
    mask and offsets.

    Along K's rows the load is masked at the padded width s_k (16-byte vectors; the padding
    holds zeros). Row sweeps: the padding columns have a −inf bias and add nothing. Column
    sweeps: the padding is tile rows past the last row, never stored.
    """
    o_n = start_n + tl.arange(0, BLOCK_N)
    m_n = o_n < n_cols
    o_n64 = o_n.to(tl.int64)
    if TRANSPOSED:
        p_k = K + i_b * s_kb + o_n64[None, :] * s_k + o_m64[:, None]
        m_k = (o_m < s_k)[:, None] & m_n[None, :]
    else:
        p_k = K + i_b * s_kb + o_m64[:, None] * s_k + o_n64[None, :]
        m_k = m_m[:, None] & (o_n < s_k)[None, :]
    b_k = tl.load(p_k, mask=m_k, other=0.0)
    o_vc = i_b * s_vcb + o_n
    b_h = (
        tl.load(Cpot + o_vc, mask=m_n, other=0.0) - tl.load(Csq + o_vc, mask=m_n, other=0.0)
    ) * inv_eps2
    b_h += tl.load(Clogw + o_vc, mask=m_n, other=float("-inf")) * 1.4426950408889634
    return b_k * scale2 + b_h[None, :], m_n, o_n


def dense_transport_grad(
    gram: torch.Tensor,
    transposed: bool,
    rows: Side,
    cols: Side,
    row_pot: torch.Tensor,
    col_pot: torch.Tensor,
    eps: float,
    precision: str,
    chunk_elements: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(∇_r OT_eps, â) for the squared Euclidean cost with the scores read from ``gram``.

    Args:
        gram: (B, n_x, m_pad) fp32 Gram matrix x·yᵀ with rows padded to a multiple of 16.
        transposed: True when ``rows`` is the y side (K read column-wise).
        rows, cols, row_pot, col_pot, eps, precision: as Backend.transport_grad.
        chunk_elements: B · rows · m scores materialised at once (the S block).
    """
    B, n, _ = rows.x.shape
    m = cols.x.shape[1]
    dtype = torch.float32
    grad = rows.sq.new_empty((B, n, rows.x.shape[2]))
    marg = torch.empty_like(rows.sq)
    yc = cols.x.to(dtype)
    col_pot = col_pot.to(dtype).contiguous()
    block_m, block_n, warps = DENSE_SOFTMAX_TILES[transposed]
    for sl in row_chunks(B, n, m, chunk_elements):
        r = sl.stop - sl.start
        soft = torch.empty((B, r, m), dtype=dtype, device=rows.x.device)
        lse = torch.empty((B, r), dtype=dtype, device=rows.x.device)
        _dense_softmax_fwd_kernel[(cdiv(r, block_m), B)](
            gram,
            cols.sq,
            cols.logw,
            col_pot,
            soft,
            lse,
            sl.start,
            sl.stop,
            m,
            gram.stride(0),
            gram.stride(1),
            soft.stride(0),
            soft.stride(1),
            cols.sq.stride(0),
            lse.stride(0),
            float(eps),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            TRANSPOSED=transposed,
            num_warps=warps,
            **FP_FUSION,
        )
        h = (row_pot[:, sl] - rows.sq[:, sl]) / eps + rows.logw[:, sl]
        marg[:, sl] = torch.nan_to_num(torch.exp(h + lse), nan=0.0)
        with matmul_precision(precision, rows.x.device):
            bary = torch.bmm(soft, yc)
        # â_i (r_i − Σ_j S_ij c_j): the difference at the scale of the points (torch_ref)
        grad[:, sl] = 2.0 * marg[:, sl, None] * (rows.x[:, sl].to(dtype) - bary)
    return grad, marg
