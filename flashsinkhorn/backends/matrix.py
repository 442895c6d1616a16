"""The cost-matrix problem kind: a cost C the caller has formed, instead of two point clouds.

:func:`flashsinkhorn.solve` takes C of shape (n, m) or (B, n, m). Its canonical
:class:`~flashsinkhorn.problem.Problem` has the sides of every other problem (weights,
log-weights, relaxation, zero-weight flags) with the cost ``"matrix"``: each side's ``x`` holds
*its own rows of the cost*, ``X.x = C`` (B, n, m) and ``Y.x = Cᵀ`` (B, m, n, a transposed
view, not a copy), and ``sq`` is zero (there is no shifted form to offset).
:class:`MatrixBackend` reads them:

    T_i = −eps · LSE_j[(p_j − C_ij) / eps + log w_j],

so the solver loop, the eps ladder, acceleration, stopping, the dual value and the result's
transport operators are the ones every solve uses. The soft-mins are torch operations on row
blocks of C (any device, float32 or float64), with no Triton kernel.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .. import _validation as V
from ..problem import Checks, Problem, Side, Stats, check_values
from . import torch_ref
from .base import Backend, Capabilities
from .blocks import CHUNK_ELEMENTS, row_chunks
from .torch_ref import expanded_softmin

#: ``Side.cost`` of a cost-matrix problem.
MATRIX = "matrix"


def prepare_matrix(
    C: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    *,
    rho_x: float | None,
    rho_y: float | None,
) -> tuple[Problem, float]:
    """Validates a cost matrix and its weights and builds the canonical problem.

    Args:
        C: (n, m) or (B, n, m) cost, any real floating dtype; float16/bfloat16 are read in
            float32 (the potential dtype), float64 stays float64.
        a: weights of the rows, (n,) or (B, n) (a shared (n,) for a batched C), or None for
            uniform 1/n.
        b: weights of the columns, (m,) or (B, m), or None for uniform 1/m.
        rho_x: KL relaxation of the row marginal, None for a hard constraint.
        rho_y: the same for the column marginal.

    Returns:
        ``(problem, spread)``: the problem, and max C − min C over the whole batch (the range
        of the cost that the soft-min sees: adding a constant to C only shifts the potentials).

    Raises:
        TypeError, ValueError: naming ``C``, ``a`` or ``b`` and what is allowed.
    """
    V.check_cost_matrix("C", C)
    a = V.check_matrix_weights("a", a, C, -2)
    b = V.check_matrix_weights("b", b, C, -1)
    batched = C.dim() == 3
    pdtype = torch.float64 if C.dtype == torch.float64 else torch.float32
    Cb = (C if batched else C.unsqueeze(0)).detach().to(pdtype)
    B, n, m = Cb.shape
    wa = _weights(a, B, n, Cb)
    wb = _weights(b, B, m, Cb)
    balanced = rho_x is None and rho_y is None
    checks = Checks(a is not None, b is not None, balanced, False, False,
                    1e-6 if pdtype == torch.float64 else 1e-4)  # fmt: skip
    # Every value check and the cost's range in one synchronisation.
    given = [(nm, w) for nm, w in (("a", wa), ("b", wb)) if nm in checks.names]
    stats = [*torch.aminmax(Cb)]
    for _, w in given:
        stats += [*torch.aminmax(w), w.sum(-1).min()]
    # the largest total mass, for the range checks (limits.py)
    stats.append(torch.maximum(wa.sum(-1).max(), wb.sum(-1).max()))
    if checks.gap:
        ma, mb = wa.sum(-1), wb.sum(-1)
        stats.append(((ma - mb).abs() / torch.maximum(ma, mb)).max())
    vals = torch.stack(stats).tolist()
    lo, hi = vals[0], vals[1]
    per = {nm: vals[2 + 3 * k : 5 + 3 * k] for k, (nm, _) in enumerate(given)}
    mass = vals[2 + 3 * len(given)]
    check_values(per, vals[-1] if checks.gap else 0.0, 0.0, checks, None, None)
    # An inf entry would make the soft-mins inf − inf = NaN, and the check costs no extra
    # synchronisation: it always runs.
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("C must not contain NaN or inf")
    null_a = "a" in per and per["a"][0] == 0
    null_b = "b" in per and per["b"][0] == 0
    # Uniform weights have mass exactly 1 and a balanced problem one mass (as in ``prepare``):
    # at large eps the soft-min's eps·ln M and the value's mass term meet the same M.
    side_x = _side(Cb, wa, rho_x, null_a, a is None)
    side_y = _side(Cb.transpose(1, 2), wb, rho_y, null_b, b is None)
    if balanced:
        side_y = replace(side_y, unit_mass=a is None, mass_of=None if a is None else side_x.w)
    # A matrix problem's statistics (limits.py): amax the largest |C_ij|, box2 the spread
    # max C − min C (the role of diameter²), mass the largest total mass.
    stats = Stats(amax=max(abs(lo), abs(hi)), box2=hi - lo, mass=mass)
    return Problem(side_x, side_y, batched, "ieee", stats=stats), hi - lo


def _weights(w: torch.Tensor | None, B: int, k: int, C: torch.Tensor) -> torch.Tensor:
    if w is None:
        return torch.full((B, k), 1.0 / k, dtype=C.dtype, device=C.device)
    return w.detach().to(C.dtype).expand(B, k).contiguous()


def _side(rows, w: torch.Tensor, rho: float | None, has_null: bool, unit: bool) -> Side:
    sq = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
    return Side(rows, sq, w, w.log(), rho, has_null=has_null, cost=MATRIX, unit_mass=unit)


def col_scores(rows: Side, sl: slice, cols: Side, col_pot, eps: float):
    """(B, r, m) log P_ij without the row term: (p_j − C_ij) / eps + log w_j, rows of C."""
    return (col_pot[:, None, :] - rows.x[:, sl]) / eps + cols.logw[:, None, :]


def log_plan(rows: Side, cols: Side, row_pot, col_pot, eps: float, sl=slice(None)):
    """(B, r, m) log P_ij = (p_i + p_j − C_ij) / eps + log w_i + log w_j of a block of rows."""
    z = col_scores(rows, sl, cols, col_pot, eps)
    return z + (row_pot[:, sl] / eps + rows.logw[:, sl])[:, :, None]


def _row_softmax(rows: Side, cols: Side, row_pot, col_pot, eps: float, sl: slice):
    """((B, r, m) row softmax of the plan, (B, r) row marginal) of a block of rows of C."""
    lp = log_plan(rows, cols, row_pot, col_pot, eps, sl)
    lse = torch.logsumexp(lp, dim=2, keepdim=True)
    # A row of zero weight has lse = -inf: shift it by 0 (its mass is 0 either way).
    soft = torch.exp(lp - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
    return soft, torch.exp(lse[..., 0])


class MatrixBackend(Backend):
    """Soft-mins and transports that read a given cost matrix, in row blocks of bounded size."""

    name = "torch"
    path = MATRIX
    # the value is differentiated w.r.t. C (autograd/matrix_cost.py): there are no points
    capabilities = Capabilities(second_order=False)

    def __init__(self, chunk_elements: int = CHUNK_ELEMENTS):
        self.chunk_elements = chunk_elements

    def softmin(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
        B, n, m = rows.x.shape
        T = torch.empty_like(rows.sq)
        h = cols.logw[:, None, :]
        large = eps >= rows.large_eps
        for sl in row_chunks(B, n, m, self.chunk_elements):
            z = (col_pot[:, None, :] - rows.x[:, sl]) / eps + h
            if large:  # about the mean score: exp(z) of near-equal z loses the cost
                zero = torch.zeros_like(T[:, sl])
                T[:, sl] = expanded_softmin(rows, sl, cols, col_pot, eps, z, zero, rows.x[:, sl])
                continue
            T[:, sl] = -eps * torch.logsumexp(z, dim=2)
        out = beta * T if alpha == 0.0 else alpha * old + beta * T
        return out, (T if want_raw else None)

    def transport(self, rows, cols, row_pot, col_pot, eps, V, A, Bw, precision):
        return torch_ref.transport(rows, cols, row_pot, col_pot, eps, V, A, Bw, precision,
                                   self.chunk_elements, row_softmax=_row_softmax)  # fmt: skip

    def plan_argmax(self, rows, cols, col_pot, eps, precision, idx=None, seed=None):
        return torch_ref.plan_argmax(rows, cols, col_pot, eps, precision, idx, seed,
                                     self.chunk_elements, row_scores=col_scores)  # fmt: skip

    def transport_grad(self, rows, cols, row_pot, col_pot, eps, precision):
        raise ValueError(
            "a cost-matrix solve has no points to differentiate; its value is differentiable "
            "with respect to C (the gradient is the plan) and the weights"
        )


def dense_plan(problem: Problem, f: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, n, m) plan P_ij = a_i b_j exp((f_i + g_j − C_ij) / eps) of a cost-matrix problem."""
    return torch.exp(log_plan(problem.X, problem.Y, f, g, eps))
