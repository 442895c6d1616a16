"""OT_eps of a cost-matrix solve as an autograd.Function (envelope-theorem gradients).

The value is the dual objective at the returned potentials (f, g),

    D(f, g; C, a, b) = φ_a(f) + φ_b(g) − eps ⟨a⊗b, exp((f⊕g − C)/eps) − 1⟩,

so by the envelope theorem its derivatives are the partial derivatives of D there:

- ∂/∂C_ij = a_i b_j exp((f_i + g_j − C_ij)/eps) = P_ij, the plan of the returned potentials
  (balanced or not), one dense (B, n, m) tensor like C itself;
- ∂/∂a, ∂/∂b: exactly as for point clouds (``ot_cost._weight_grad``): f and g for a balanced
  problem, whose derivative on the simplex is defined up to a constant only; the partial
  derivative of D for a KL-relaxed one.
"""

from __future__ import annotations

import torch

from .. import limits, tuning
from .._boundary import backward_autocast_off
from ..backends.matrix import dense_plan
from .guard import guard_second_order
from .ot_cost import _reduce_like, _weight_grad


class MatrixCostFunction(torch.autograd.Function):
    """``apply(C, a, b, sol, value)``: ``value`` ((B,)), differentiable w.r.t. C, a and b.

    ``sol`` is the :class:`~flashsinkhorn.result.Solution` of the finished cost-matrix solve
    of (C, a, b) and ``value`` its dual value (run outside this function); the forward only
    copies the value.
    """

    @staticmethod
    def forward(ctx, C, a, b, sol, value):
        tuning.keep_for_backward(ctx)
        ctx.sol = sol
        ctx.save_for_backward(C, a, b)
        return value.clone()

    @staticmethod
    @backward_autocast_off
    def backward(ctx, grad_out):
        C, a, b = ctx.saved_tensors
        sol = ctx.sol
        problem = sol.problem
        need = ctx.needs_input_grad
        gC = ga = gb = None
        with torch.no_grad():
            go = grad_out.reshape(-1).to(problem.dtype)
            if need[0]:
                limits.check_plan(problem, sol.eps, "the gradient with respect to C")
                P = dense_plan(problem, sol.f, sol.g, sol.eps)
                gC = problem.unbatch(P.mul_(go[:, None, None])).to(C.dtype)
            if need[1] and a is not None:
                ga = _reduce_like(_weight_grad(sol, "X") * go[:, None], a, problem.batched)
            if need[2] and b is not None:
                gb = _reduce_like(_weight_grad(sol, "Y") * go[:, None], b, problem.batched)
        # The plan's own dependence on (C, a, b) is not in these gradients: refuse to
        # differentiate them again rather than return a wrong second derivative.
        gC, ga, gb = guard_second_order((gC, ga, gb), (C, a, b))
        return gC, ga, gb, None, None
