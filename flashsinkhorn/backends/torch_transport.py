"""Transport operators from potentials in plain PyTorch (row-chunked, float64 capable).

For a row side R, a column side C and potentials (p_R, p_C) the plan is

    P_ij = w^R_i w^C_j exp((p_R,i + p_C,j − ‖r_i − c_j‖²) / eps)
         = exp(h_i + z_ij),   h_i = (p_R,i − ‖r_i‖²)/eps + log w^R_i,

with z_ij the column-biased scores of :func:`.torch_ref.scores`. Each row block is handled
as a softmax: with L_i = LSE_j z_ij, the row marginal is â_i = exp(h_i + L_i) and
(P V)_i = â_i · Σ_j softmax_j(z_i·) V_j, which never overflows even for potentials far from
a fixed point. Pᵀ U is the same operator with the two sides exchanged.
"""

from __future__ import annotations

import torch

from ..problem import Side
from .torch_ref import CHUNK_ELEMENTS, block_scores, matmul_precision, row_chunks


def _row_softmax(rows: Side, cols: Side, row_pot, col_pot, eps: float, sl: slice, dist=False):
    """((B, r, m) row-softmax of the scores, (B, r) row marginal â) for a block of rows;
    with ``dist=True`` also the distance block of the euclidean cost (None otherwise)."""
    z, offset, D = block_scores(rows, sl, cols, col_pot.to(rows.sq.dtype), eps)
    lse = torch.logsumexp(z, dim=2, keepdim=True)
    # A row with no reachable column (all weights zero) has lse = -inf: give it zero mass.
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    soft = torch.exp(z - lse_safe)
    h = (row_pot[:, sl] - offset) / eps + rows.logw[:, sl]
    marg = torch.nan_to_num(torch.exp(h + lse[..., 0]), nan=0.0)
    return (soft, marg, D) if dist else (soft, marg)


def transport(
    rows: Side,
    cols: Side,
    row_pot: torch.Tensor,
    col_pot: torch.Tensor,
    eps: float,
    V: torch.Tensor | None,
    A: torch.Tensor | None,
    Bw: torch.Tensor | None,
    precision: str,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(P ∘ A Bwᵀ) V (or P V without A, Bw) and the row marginal P 1; see Backend.transport."""
    B, n, _ = rows.x.shape
    m = cols.x.shape[1]
    dtype = rows.sq.dtype
    marg = torch.empty_like(rows.sq)
    out = None if V is None else V.new_empty((B, n, V.shape[2]), dtype=dtype)
    Vd = None if V is None else V.to(dtype)
    with matmul_precision(precision, rows.x.device):
        for sl in row_chunks(B, n, m, chunk_elements):
            soft, marg[:, sl] = _row_softmax(rows, cols, row_pot, col_pot, eps, sl)
            if V is None:
                continue
            if A is not None:
                soft = soft * torch.bmm(A[:, sl].to(dtype), Bw.to(dtype).transpose(1, 2))
            out[:, sl] = marg[:, sl, None] * torch.bmm(soft, Vd)
    return out, marg


def transport_grad(
    rows: Side,
    cols: Side,
    row_pot: torch.Tensor,
    col_pot: torch.Tensor,
    eps: float,
    precision: str,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(∇_r OT_eps, â): the envelope gradient w.r.t. the row points, â = P 1.

    Squared Euclidean cost (labels or not): 2 (diag(â) r − P c). Euclidean cost:
    Σ_j P_ij (r_i − c_j) / ‖r_i − c_j‖, with the subgradient 0 where the distance is 0 (at
    or below the floor), i.e. ``diag((P ∘ 1/C) 1) r − (P ∘ 1/C) c``.
    """
    B, n, d = rows.x.shape
    m = cols.x.shape[1]
    dtype = rows.sq.dtype
    marg = torch.empty_like(rows.sq)
    grad = rows.sq.new_empty((B, n, d))
    yc = cols.x.to(dtype)
    with matmul_precision(precision, rows.x.device):
        for sl in row_chunks(B, n, m, chunk_elements):
            if rows.cost == "euclidean":
                soft, marg[:, sl], D = _row_softmax(rows, cols, row_pot, col_pot, eps, sl, True)
                floor = max(cols.sq_floor, 0.0) ** 0.5
                wgt = torch.where(D > floor, soft / torch.where(D > 0, D, 1.0), 0.0)
                xr = rows.x[:, sl].to(dtype)
                gsl = wgt.sum(-1, keepdim=True) * xr - torch.bmm(wgt, yc)
                grad[:, sl] = marg[:, sl, None] * gsl
                continue
            soft, marg[:, sl] = _row_softmax(rows, cols, row_pot, col_pot, eps, sl)
            # â_i (r_i − Σ_j softmax_ij c_j): the row-normalised form keeps the difference of
            # two nearly equal terms at the scale of the points, not of â·points.
            bary = torch.bmm(soft, yc)
            grad[:, sl] = 2.0 * marg[:, sl, None] * (rows.x[:, sl].to(dtype) - bary)
    return grad, marg
