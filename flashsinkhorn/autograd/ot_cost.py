"""OT_eps as an autograd.Function with envelope-theorem gradients.

Forward: one Sinkhorn solve (no graph through the iterations) and the dual value.
Backward (docs/transport.md), with P the plan of the returned potentials and â = P 1,
b̂ = Pᵀ 1 its *induced* marginals (paper G.1), so that early-stopped solves get the exact
gradient of the plan actually computed:

- ∇_x = 2 (diag(â) x − P y), ∇_y = 2 (diag(b̂) y − Pᵀ x): one fused streaming pass per side,
  never an n × m tensor (after a dense-path solve, a kernel writes row blocks of the plan's
  softmax from the stored Gram matrix and cuBLAS multiplies them by the points instead:
  backends/triton/dense_grad.py). P is translation invariant, so the
  centred problem gives the gradient of the caller's points;
- ∇_a = f, ∇_b = g for a balanced problem (the GeomLoss convention; on the simplex the
  derivative is defined up to a constant only);
- a KL-relaxed (or semi-relaxed) problem has no such freedom: ∇_a is the partial derivative
  of the dual objective at fixed potentials, φ'(f) − eps · â / a + eps · m(b), with
  φ'(f) = f for a hard marginal and rho (1 − e^{−f/rho}) for a relaxed one.
"""

from __future__ import annotations

import torch

from .. import limits, tuning
from .._boundary import backward_autocast_off
from ..result import SinkhornResult, Solution, balanced_gauge
from .double_backward import EnvelopeGrad, hvp_settings
from .guard import guard_second_order


def _weight_grad(sol: Solution, side: str) -> torch.Tensor:
    """(B, n) gradient of the dual value w.r.t. the weights of one side (x: "X", y: "Y")."""
    problem = sol.problem
    R, Cs = (problem.X, problem.Y) if side == "X" else (problem.Y, problem.X)
    pot, other = (sol.f, sol.g) if side == "X" else (sol.g, sol.f)
    if problem.X.rho is None and problem.Y.rho is None:
        # in the gauge of the returned potentials (result.balanced_gauge)
        return balanced_gauge(problem, sol.f, sol.g)[0 if side == "X" else 1]
    eps = sol.eps
    # â_i / a_i = exp((pot_i − T_i) / eps), with T the soft-min of this side (one pass); it
    # stays finite where a_i = 0.
    _, raw = sol.backend.softmin(R, Cs, other, eps, pot, 0.0, 1.0, True, problem.precision)
    return relaxed_weight_grad(R, pot, raw, eps, Cs.mass[:, None])


def relaxed_weight_grad(R, pot: torch.Tensor, raw: torch.Tensor, eps: float, other_mass):
    """φ'(pot) − eps · â/w + eps · m, the weight gradient of a problem with a KL side, from
    the potential of side ``R``, its raw soft-min ``raw`` and the other side's mass m."""
    # eps (m(b) − â/a) = eps (m(b) − 1) − eps expm1(·): no cancellation at large eps
    dratio = torch.expm1((pot - raw) / eps)
    dphi = pot if R.rho is None else R.rho * -torch.expm1(-pot / R.rho)
    return dphi - eps * dratio + eps * (other_mass - 1.0)


def _reduce_like(grad: torch.Tensor, like: torch.Tensor, batched: bool) -> torch.Tensor:
    """Sums a (B, n) weight gradient to the caller's weight shape ((n,), (n,1), (B,n), (B,n,1))."""
    if batched and like.numel() != grad.numel():
        grad = grad.sum(0)  # weights shared by every problem of the batch
    return grad.reshape(like.shape).to(like.dtype)


class OTCostFunction(torch.autograd.Function):
    """``apply(x, y, a, b, res, hvp_options=None, ...)``: OT_eps, () or (B,), envelope gradients.

    ``res`` is the finished :class:`SinkhornResult` of (x, y, a, b) (``engine.solve_points``,
    run outside this function). With ``create_graph=True`` the x and y gradients of a
    balanced problem are themselves differentiable: their backward is the streaming HVP
    (``double_backward.py``; ``hvp_options`` sets its Schur solve).
    """

    @staticmethod
    def forward(
        ctx, x, y, a, b, res, hvp_options=None, label_cost=None, label_weight=1.0,
        second_order=True,
    ):  # fmt: skip
        tuning.keep_for_backward(ctx)
        ctx.res = res
        ctx.hvp_options = hvp_options
        ctx.label_weight = label_weight
        # Other costs (costs.py) have no second derivatives, and a backend without second
        # order (the multiscale path) no HVP: refuse them with a ValueError.
        caps = res.solution.backend.capabilities
        ctx.backend_second_order = caps.second_order
        ctx.second_order = (
            bool(second_order) and res.solution.problem.default_cost and caps.second_order
        )
        ctx.save_for_backward(x, y, a, b, label_cost)
        return res.value.clone()

    @staticmethod
    @backward_autocast_off
    def backward(ctx, grad_out):
        limits.check_plan(ctx.res.solution.problem, ctx.res.eps, "gradients")
        x, y, a, b, label_cost = ctx.saved_tensors
        gW = None
        if ctx.needs_input_grad[6]:
            with torch.no_grad():
                gW = _label_cost_grad(ctx.res, grad_out, ctx.label_weight).to(label_cost.dtype)
        if not ctx.second_order:
            from ..costs import SECOND_ORDER_MULTISCALE_MESSAGE, refuse_second_order

            res = ctx.res
            grads = _first_order(ctx, x, y, a, b, grad_out, ctx.needs_input_grad)
            msg = None if ctx.backend_second_order else SECOND_ORDER_MULTISCALE_MESSAGE
            grads = refuse_second_order(
                (*grads, gW), (x, y, a, b, label_cost), res.solution.problem.cost, msg
            )
            return (*grads[:4], None, None, grads[4], None, None)
        gx, gy, ga, gb = _backward_sqeuclidean(ctx, x, y, a, b, grad_out)
        return gx, gy, ga, gb, None, None, gW, None, None


def _first_order(ctx, x, y, a, b, grad_out, need):
    """(gx, gy, ga, gb) without any graph (envelope gradients of any cost)."""
    res: SinkhornResult = ctx.res
    problem = res.solution.problem
    impl = res.solution.backend
    gx = gy = ga = gb = None
    with torch.no_grad():
        go = grad_out.reshape(-1).to(problem.dtype)
        if need[0]:
            G, _ = impl.transport_grad(
                problem.X, problem.Y, res.solution.f, res.solution.g, res.eps, problem.precision
            )
            gx = problem.unbatch(G.mul_(go[:, None, None])).to(x.dtype)  # G is ours
        if need[1]:
            G, _ = impl.transport_grad(
                problem.Y, problem.X, res.solution.g, res.solution.f, res.eps, problem.precision
            )
            gy = problem.unbatch(G.mul_(go[:, None, None])).to(y.dtype)
        if need[2] and a is not None:
            ga = _reduce_like(_weight_grad(res.solution, "X") * go[:, None], a, problem.batched)
        if need[3] and b is not None:
            gb = _reduce_like(_weight_grad(res.solution, "Y") * go[:, None], b, problem.batched)
    return gx, gy, ga, gb


def _label_cost_grad(res: SinkhornResult, grad_out, label_weight: float) -> torch.Tensor:
    """(V, V) dOT/dW = label_weight · Σ_b go_b · onehot(l_x)ᵀ P onehot(l_y), streamed.

    P onehot(l_y) is one transport application with V value columns (no n × m tensor); the
    left one-hot product is a scatter-add over the rows.
    """
    problem = res.solution.problem
    X, Y = problem.X, problem.Y
    nv = X.lcost.shape[0]
    go = grad_out.reshape(-1).to(problem.dtype)
    onehot_y = torch.nn.functional.one_hot(Y.labels.long(), nv).to(problem.dtype)
    PV, _ = res.solution.backend.transport(
        X, Y, res.solution.f, res.solution.g, res.eps, onehot_y, None, None, problem.precision
    )  # (B, n, V)
    PV = PV * go[:, None, None]
    G = torch.zeros((nv, nv), dtype=problem.dtype, device=PV.device)
    G.index_add_(0, X.labels.reshape(-1).long(), PV.reshape(-1, nv))
    return label_weight * G


def _backward_sqeuclidean(ctx, x, y, a, b, grad_out):
    """The squared Euclidean backward: differentiable x/y gradients (HVP) under create_graph."""
    res: SinkhornResult = ctx.res
    problem = res.solution.problem
    need = ctx.needs_input_grad
    gx = gy = ga = gb = None
    balanced = problem.X.rho is None and problem.Y.rho is None
    second = torch.is_grad_enabled() and balanced and (need[0] or need[1])
    if second:
        # create_graph=True: differentiable x/y gradients whose backward is the HVP.
        gx, gy = EnvelopeGrad.apply(
            x, y, a, b, grad_out, res, need[0], need[1], hvp_settings(ctx.hvp_options)
        )
        need = (False, False, *need[2:])
    fx, fy, ga, gb = _first_order(ctx, x, y, a, b, grad_out, need)
    gx = gx if fx is None else fx
    gy = gy if fy is None else fy
    if second:
        ga, gb = guard_second_order((ga, gb), (x, y, a, b))
    else:
        gx, gy, ga, gb = guard_second_order((gx, gy, ga, gb), (x, y, a, b))
    return gx, gy, ga, gb
