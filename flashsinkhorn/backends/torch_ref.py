"""Plain PyTorch backend: dense for small problems, row-chunked with bounded memory otherwise.

It is the CPU default, the float64 path and the oracle the Triton kernels are tested against.

Transport operators from potentials: for a row side R, a column side C and potentials
(p_R, p_C) the plan is

    P_ij = w^R_i w^C_j exp((p_R,i + p_C,j − C_ij) / eps) = exp(h_i + z_ij),

with z_ij the column-biased scores of :func:`block_scores` and h_i = (p_R,i − offset_i)/eps +
log w^R_i. Each row block is handled as a softmax: with L_i = LSE_j z_ij, the row marginal is
â_i = exp(h_i + L_i) and (P V)_i = â_i · Σ_j softmax_j(z_i·) V_j, which never overflows even
for potentials far from a fixed point. Pᵀ U is the same operator with the two sides exchanged.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..problem import Side
from . import gumbel
from .base import Backend
from .blocks import CHUNK_ELEMENTS, matmul_precision, row_chunks
from .kernel_costs import cost_from_sq, grad_weight, shifted


def exp_floored_(z: torch.Tensor) -> torch.Tensor:
    """exp of ``z`` in place, with the results below the dtype's smallest normal number (about
    1.2e-38 in float32) set to 0 (what they round to anyway, within 2e-38).

    torch's CPU exp is 100–500× slower in float32 for arguments whose result underflows
    (measured: 4M values in [−100, −88] take 1.6 s against 3 ms in [−80, 0]); clamping first
    keeps every evaluation on the fast path.
    """
    floor = math.log(torch.finfo(z.dtype).tiny) + 0.5
    z.clamp_(min=floor).exp_()
    return torch.nn.functional.threshold_(z, math.exp(floor + 0.25), 0.0)


def scores(rows_x: torch.Tensor, cols: Side, col_pot: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, r, m) log-domain scores (2 x·y + p_j − ‖y_j‖²)/eps + log w_j of a row block."""
    h = (col_pot - cols.sq) / eps + cols.logw
    xr = rows_x.to(h.dtype)
    yc = cols.x.to(h.dtype)
    return torch.baddbmm(h.unsqueeze(1), xr, yc.transpose(1, 2), alpha=2.0 / eps)


def label_block(rows: Side, sl: slice, cols: Side) -> torch.Tensor:
    """(B, r, m) label term label_weight · W[l_i, l_j] of a row block (rows' orientation)."""
    li = rows.labels[:, sl].long()
    lj = cols.labels.long()
    return rows.lcost[li[:, :, None], lj[:, None, :]]


def distance_block(rows_x: torch.Tensor, rsq: torch.Tensor, cols: Side, dtype) -> torch.Tensor:
    """(B, r, m) cost of a non-shifted kernel cost (``kernel_costs.cost_from_sq``) of a row
    block, from the same expansion ‖r_i‖² + ‖c_j‖² − 2 r_i·c_j that the kernels use."""
    xr = rows_x.to(dtype)
    yc = cols.x.to(dtype)
    d2 = torch.baddbmm(rsq[:, :, None] + cols.sq[:, None, :], xr, yc.transpose(1, 2), alpha=-2.0)
    return cost_from_sq(cols.cost, d2, cols.sq_floor)


def block_scores(rows: Side, sl: slice, cols: Side, col_pot: torch.Tensor, eps: float):
    """Scores of a row block for any kernel cost.

    Returns ``(z, offset, dist)``: z (B, r, m) log-domain scores such that the soft-min is
    ``T_i = offset_i − eps · LSE_j z_ij`` and the plan ``P_ij = exp(h_i + z_ij)`` with
    ``h_i = (p_i − offset_i)/eps + log w_i``; ``offset`` is ‖r_i‖² for the squared Euclidean
    cost (the shifted form) and 0 for the other costs; ``dist`` is the (B, r, m) cost block of
    the other costs (None for the squared Euclidean cost).
    """
    dtype = col_pot.dtype
    dist = None
    if not shifted(rows.cost):
        dist = distance_block(rows.x[:, sl], rows.sq[:, sl], cols, dtype)
        z = (col_pot[:, None, :] - dist) / eps + cols.logw[:, None, :]
        offset = torch.zeros_like(rows.sq[:, sl])
    else:
        z = scores(rows.x[:, sl], cols, col_pot, eps)
        offset = rows.sq[:, sl]
    if rows.labels is not None:
        z = z - label_block(rows, sl, cols) / eps
    return z, offset, dist


def cost_block(rows: Side, sl: slice, cols: Side, dtype) -> torch.Tensor:
    """(B, r, m) full cost C_ij of a row block (kernel cost plus label term)."""
    if not shifted(rows.cost):
        C = distance_block(rows.x[:, sl], rows.sq[:, sl], cols, dtype)
    else:
        xr, yc = rows.x[:, sl].to(dtype), cols.x.to(dtype)
        C = torch.baddbmm(
            rows.sq[:, sl, None] + cols.sq[:, None, :], xr, yc.transpose(1, 2), alpha=-2.0
        )
    if rows.labels is not None:
        C = C + label_block(rows, sl, cols)
    return C


def _row_softmax(rows: Side, cols: Side, row_pot, col_pot, eps: float, sl: slice, dist=False):
    """((B, r, m) row-softmax of the scores, (B, r) row marginal â) for a block of rows;
    with ``dist=True`` also the cost block of a non-shifted cost (None otherwise)."""
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
    row_softmax=None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(P ∘ A Bwᵀ) V (or P V without A, Bw) and the row marginal P 1; see Backend.transport.

    ``row_softmax(rows, cols, row_pot, col_pot, eps, sl) -> (soft, marg)`` forms a block of
    rows of the plan (default: from the points; a cost-matrix backend passes its own)."""
    row_softmax = _row_softmax if row_softmax is None else row_softmax
    B, n, _ = rows.x.shape
    m = cols.x.shape[1]
    dtype = rows.sq.dtype
    marg = torch.empty_like(rows.sq)
    out = None if V is None else V.new_empty((B, n, V.shape[2]), dtype=dtype)
    Vd = None if V is None else V.to(dtype)
    with matmul_precision(precision, rows.x.device):
        for sl in row_chunks(B, n, m, chunk_elements):
            soft, marg[:, sl] = row_softmax(rows, cols, row_pot, col_pot, eps, sl)
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

    Squared Euclidean cost (labels or not): 2 (diag(â) r − P c). Other costs:
    Σ_j P_ij w_ij (r_i − c_j) with the weights of ``kernel_costs.grad_weight`` (euclidean:
    1 / ‖r_i − c_j‖, and the subgradient 0 where the distance is at or below the floor), i.e.
    ``diag((P ∘ w) 1) r − (P ∘ w) c``.
    """
    B, n, d = rows.x.shape
    m = cols.x.shape[1]
    dtype = rows.sq.dtype
    marg = torch.empty_like(rows.sq)
    grad = rows.sq.new_empty((B, n, d))
    yc = cols.x.to(dtype)
    with matmul_precision(precision, rows.x.device):
        for sl in row_chunks(B, n, m, chunk_elements):
            if not shifted(rows.cost):
                soft, marg[:, sl], D = _row_softmax(rows, cols, row_pot, col_pot, eps, sl, True)
                wgt = grad_weight(rows.cost, soft, D, cols.sq_floor)
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


def natural_scores(rows: Side, sl: slice, cols: Side, col_pot: torch.Tensor, dist) -> torch.Tensor:
    """(B, r, m) scores of a row block in cost units, eps·(z − log w): 2 r·c + p_j − ‖c_j‖²
    for the squared Euclidean cost (shifted form), p_j − C_ij otherwise (``dist`` the cost
    block of :func:`block_scores`), minus the label term."""
    dtype = col_pot.dtype
    if dist is None:
        xr, yc = rows.x[:, sl].to(dtype), cols.x.to(dtype)
        v = torch.baddbmm((col_pot - cols.sq)[:, None, :], xr, yc.transpose(1, 2), alpha=2.0)
    else:
        v = col_pot[:, None, :] - dist
    if rows.labels is not None:
        v = v - label_block(rows, sl, cols)
    return v


def expanded_softmin(rows: Side, sl: slice, cols: Side, col_pot, eps: float, z, offset, dist):
    """The soft-min of a row block at large eps, expanded about the weighted mean score.

    With v the scores in cost units (:func:`natural_scores`), c_i = Σ_j w̄_j v_ij their mean
    under the normalised weights w̄ and t = (v − c)/eps,

        T_i = offset_i − c_i − eps log M − eps log1p(Σ_j w̄_j expm1(t_ij)),

    exact for any c and accurate where |t| <= 1: every term keeps the digits of the cost,
    where exp(z) of scores within ulps of each other does not (docs/precision.md). M is the
    side's nominal mass (``Side.nominal_mass``). Rows with a larger spread keep the plain
    log-sum-exp, which is accurate there.
    """
    v = natural_scores(rows, sl, cols, col_pot, dist)
    wn = cols.w / cols.w.sum(-1, keepdim=True)
    live = (wn > 0)[:, None, :]
    c = (wn[:, None, :] * torch.where(live, v, 0.0)).sum(-1, keepdim=True)
    t = (v - c) / eps
    s = (wn[:, None, :] * torch.where(live, torch.expm1(t), 0.0)).sum(-1)
    spread = torch.where(live, t.abs(), 0.0).amax(-1)
    logm = torch.log(cols.nominal_mass.to(c.dtype))[:, None]
    expanded = offset - c[..., 0] - eps * (logm + torch.log1p(s))
    plain = offset - eps * torch.logsumexp(z, dim=2)
    return torch.where(spread <= 1.0, expanded, plain)


def gather_rows(side: Side, idx: torch.Tensor) -> Side:
    """The side restricted to rows ``idx`` (B, k) of each problem (a batch of k-point sides)."""

    def take(t):
        if t is None:
            return None
        index = idx if t.dim() == 2 else idx[..., None].expand(-1, -1, t.shape[2])
        return torch.gather(t, 1, index)

    return replace(side, x=take(side.x), sq=take(side.sq), w=take(side.w),
                   logw=take(side.logw), labels=take(side.labels), xk=None, mean=None,
                   mass_of=None)  # fmt: skip


def plan_argmax(
    rows: Side,
    cols: Side,
    col_pot: torch.Tensor,
    eps: float,
    precision: str,
    idx: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    row_scores=None,
) -> torch.Tensor:
    """Row argmax of the plan, Gumbel-perturbed with ``seed``; see Backend.plan_argmax.

    ``row_scores(rows, sl, cols, col_pot, eps) -> (B, r, m)`` gives the log-domain scores of a
    row block up to a row constant (default: :func:`block_scores`; a cost-matrix backend
    passes its own)."""
    side = rows if idx is None else gather_rows(rows, idx)
    B, k = side.sq.shape
    m = cols.x.shape[1]
    out = torch.empty((B, k), dtype=torch.int64, device=rows.x.device)
    cols_j = torch.arange(m, device=rows.x.device)
    draws = torch.arange(B, device=rows.x.device)[:, None] * k
    if row_scores is None:
        row_scores = lambda *a: block_scores(*a)[0]  # noqa: E731
    # the noise holds a few int64 temporaries per score: smaller blocks than the transports
    budget = chunk_elements // 8 if seed is not None else chunk_elements
    with matmul_precision(precision, rows.x.device):
        for sl in row_chunks(B, k, m, budget):
            z = row_scores(side, sl, cols, col_pot.to(rows.sq.dtype), eps)
            if seed is not None:
                r = torch.arange(sl.start, sl.stop, device=rows.x.device)
                keys = gumbel.draw_keys(seed, draws + r[None, :])[..., None]
                z = z + math.log(2.0) * gumbel.gumbel2(seed, keys, cols_j).to(z.dtype)
            out[:, sl] = z.argmax(-1)
    return out


class TorchBackend(Backend):
    """Reference backend built from batched matmuls and ``torch.logsumexp``."""

    name = "torch"
    path = "dense"  # row blocks of the score matrix are materialised

    def __init__(self, chunk_elements: int = CHUNK_ELEMENTS, kernel_path: bool = False):
        self.chunk_elements = chunk_elements
        #: ``backend="auto"`` on the CPU: ``select_path`` may replace it with the stored-kernel
        #: backend (kernel_cpu.py); ``backend="torch"`` keeps the log-domain soft-min.
        self.kernel_path = kernel_path

    def softmin(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
        B, n, _ = rows.x.shape
        m = cols.x.shape[1]
        T = torch.empty_like(rows.sq)
        large = eps >= rows.large_eps
        with matmul_precision(precision, rows.x.device):
            for sl in row_chunks(B, n, m, self.chunk_elements):
                if large:
                    z, offset, D = block_scores(rows, sl, cols, col_pot, eps)
                    T[:, sl] = expanded_softmin(rows, sl, cols, col_pot, eps, z, offset, D)
                    continue
                if shifted(rows.cost) and rows.labels is None:
                    lse = torch.logsumexp(scores(rows.x[:, sl], cols, col_pot, eps), dim=2)
                    T[:, sl] = rows.sq[:, sl] - eps * lse
                    continue
                z, offset, _ = block_scores(rows, sl, cols, col_pot, eps)
                T[:, sl] = offset - eps * torch.logsumexp(z, dim=2)
        out = beta * T if alpha == 0.0 else alpha * old + beta * T
        return out, (T if want_raw else None)

    def has_plan_sums(self, X, Y, eps, cols):
        # zero weights make 0/0 of a plan row; large eps needs the expansion of softmin
        return X.labels is None and not (X.has_null or Y.has_null) and eps < X.large_eps

    def plan_sums(self, X, Y, f, g, eps, precision, shift, cols):
        B, n, _ = X.x.shape
        rows = torch.empty_like(X.sq)
        col_sums = torch.zeros_like(Y.sq) if cols else None
        sigma = 0.0 if shift is None else shift[:, None].to(X.sq.dtype)
        with matmul_precision(precision, X.x.device):
            for sl in row_chunks(B, n, Y.x.shape[1], self.chunk_elements):
                z, offset, _ = block_scores(X, sl, Y, g, eps)
                h = (f[:, sl] - offset - sigma) / eps + X.logw[:, sl]
                p = torch.exp(z + h[:, :, None])
                rows[:, sl] = p.sum(2)
                if cols:
                    col_sums += p.sum(1)
        return rows, col_sums

    def transport(self, rows, cols, row_pot, col_pot, eps, V, A, Bw, precision):
        return transport(
            rows, cols, row_pot, col_pot, eps, V, A, Bw, precision, self.chunk_elements
        )

    def transport_grad(self, rows, cols, row_pot, col_pot, eps, precision):
        return transport_grad(rows, cols, row_pot, col_pot, eps, precision, self.chunk_elements)

    def plan_argmax(self, rows, cols, col_pot, eps, precision, idx=None, seed=None):
        return plan_argmax(rows, cols, col_pot, eps, precision, idx, seed, self.chunk_elements)
