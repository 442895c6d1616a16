"""The debiased Sinkhorn divergence as one autograd.Function over its three solves.

S = OT(x, y) − ½ OT(x, x) − ½ OT(y, y), from the three results of
:func:`flashsinkhorn.engine.solve_divergence`. Gradients by the envelope theorem at the plan
of each term (docs/transport.md):

- ∇_x S = ∇_x OT(x, y) − ∇_1 OT(x, x): x enters the self term on both sides, whose plan is
  symmetric, so ½ (∇_1 + ∇_2) = ∇_1, one one-sided transport of the self plan (an
  asymmetric label cost keeps both halves);
- the two x terms (and the two y terms) run as one batched streaming launch when their
  problems have the same shape (``problem.stack_sides``): 2 × B problems of one grid;
- ∇_a S = ∇_a OT(x, y) − ∇_1 OT(a, a) likewise (the potentials for balanced problems);
- with ``create_graph=True`` (balanced, squared Euclidean cost) the point gradients are
  differentiable: each term's gradient goes through :class:`EnvelopeGrad`, whose backward
  is the streaming HVP of that term.
"""

from __future__ import annotations

import torch

from .. import limits, tuning
from .._boundary import backward_autocast_off
from ..problem import stack_sides, stackable
from .double_backward import EnvelopeGrad, hvp_settings
from .guard import guard_second_order
from .ot_cost import _label_cost_grad, _reduce_like, _weight_grad


class DivergenceFunction(torch.autograd.Function):
    """``apply(x, y, a, b, terms, hvp_options, label_cost, label_weight, second_order)``.

    ``terms``: the results (OT(x, y), OT(x, x), OT(y, y)) of ``engine.solve_divergence`` on
    these points. Returns S without the unbalanced mass term, () or (B,).
    """

    @staticmethod
    def forward(ctx, x, y, a, b, terms, hvp_options, label_cost, label_weight, second_order):
        tuning.keep_for_backward(ctx)
        xy, xx, yy = terms
        ctx.terms = terms
        ctx.hvp_options = hvp_options
        ctx.label_weight = label_weight
        caps = xy.solution.backend.capabilities
        ctx.backend_second_order = caps.second_order
        ctx.second_order = (
            bool(second_order) and xy.solution.problem.default_cost and caps.second_order
        )
        ctx.save_for_backward(x, y, a, b, label_cost)
        return xy.value - 0.5 * (xx.value + yy.value)

    @staticmethod
    @backward_autocast_off
    def backward(ctx, grad_out):
        x, y, a, b, label_cost = ctx.saved_tensors
        xy, xx, yy = ctx.terms
        problem = xy.solution.problem
        limits.check_plan(problem, xy.eps, "gradients")
        need = ctx.needs_input_grad
        balanced = problem.X.rho is None and problem.Y.rho is None
        second = ctx.second_order and torch.is_grad_enabled() and balanced and (need[0] or need[1])
        with torch.no_grad():
            go = grad_out.reshape(-1).to(problem.dtype)
            gW = None
            if need[6]:
                gW = sum(
                    s * _label_cost_grad(r, grad_out, ctx.label_weight)
                    for s, r in ((1.0, xy), (-0.5, xx), (-0.5, yy))
                ).to(label_cost.dtype)
            ga = gb = None
            sol = xy.solution
            if need[2] and a is not None:
                ga = _reduce_like((_weight_grad(sol, "X") - _self_weight_grad(xx)) * go[:, None],
                                  a, problem.batched)  # fmt: skip
            if need[3] and b is not None:
                gb = _reduce_like((_weight_grad(sol, "Y") - _self_weight_grad(yy)) * go[:, None],
                                  b, problem.batched)  # fmt: skip
            gx = gy = None
            if not second and (need[0] or need[1]):
                gx, gy = _points_grad(xy, xx, yy, go, need[0], need[1])
                gx = None if gx is None else problem.unbatch(gx).to(x.dtype)
                gy = None if gy is None else problem.unbatch(gy).to(y.dtype)
        if second:
            gx, gy = _points_grad_differentiable(ctx, x, y, a, b, grad_out)
            ga, gb = guard_second_order((ga, gb), (x, y, a, b))
        elif not ctx.second_order:
            from ..costs import SECOND_ORDER_MULTISCALE_MESSAGE, refuse_second_order

            msg = None if ctx.backend_second_order else SECOND_ORDER_MULTISCALE_MESSAGE
            gx, gy, ga, gb, gW = refuse_second_order(
                (gx, gy, ga, gb, gW), (x, y, a, b, label_cost), problem.cost, msg
            )
        else:
            gx, gy, ga, gb = guard_second_order((gx, gy, ga, gb), (x, y, a, b))
        return gx, gy, ga, gb, None, None, gW, None, None


def _points_grad(xy, xx, yy, go, need_x: bool, need_y: bool):
    """(B, n, d), (B, m, d) first-order gradients of S (None where not needed): the cross
    and self transports of each cloud, batched into as few launches as their shapes allow."""
    sol = xy.solution
    X, Y = sol.problem.X, sol.problem.Y
    # (rows, columns, row potential, column potential, sign, which gradient)
    parts = []
    if need_x:
        parts += [(X, Y, sol.f, sol.g, 1.0, 0), *_self_parts(xx, 0)]
    if need_y:
        parts += [(Y, X, sol.g, sol.f, 1.0, 1), *_self_parts(yy, 1)]
    grads: list[torch.Tensor | None] = [None, None]
    B = sol.problem.B
    impl, eps, prec = sol.backend, xy.eps, sol.problem.precision
    for group in _groups(parts):
        rows = [p[0] for p in group]
        cols = [p[1] for p in group]
        if len(group) > 1:
            R, C = stack_sides(rows), stack_sides(cols)
            fr = torch.cat([p[2] for p in group], 0)
            gc = torch.cat([p[3] for p in group], 0)
        else:
            R, C, fr, gc = rows[0], cols[0], group[0][2], group[0][3]
        G, _ = impl.transport_grad(R, C, fr, gc, eps, prec)
        for k, p in enumerate(group):
            term = G[k * B : (k + 1) * B] * (p[4] * go)[:, None, None]
            grads[p[5]] = term if grads[p[5]] is None else grads[p[5]] + term
    return grads[0], grads[1]


def _self_parts(res, which: int) -> list[tuple]:
    """The transports of a self term −½ OT(z, z), whose cloud enters both sides: for a self
    problem (symmetric plan) ½ (∇_1 + ∇_2) = ∇_1, one transport; else both halves."""
    sol = res.solution
    R, C = sol.problem.X, sol.problem.Y
    if R is C:
        return [(R, R, sol.f, sol.f, -1.0, which)]
    return [(R, C, sol.f, sol.g, -0.5, which), (C, R, sol.g, sol.f, -0.5, which)]


def _self_weight_grad(res) -> torch.Tensor:
    """∂/∂w of OT(w, w) over 2 (both sides of the self term)."""
    if res.solution.problem.X is res.solution.problem.Y:
        return _weight_grad(res.solution, "X")
    return 0.5 * (_weight_grad(res.solution, "X") + _weight_grad(res.solution, "Y"))


def _groups(parts: list) -> list[list]:
    """The parts as launch groups: all in one when their rows and columns stack, else each
    cloud's two terms together if they stack, else one by one."""
    if stackable([p[0] for p in parts]) and stackable([p[1] for p in parts]):
        return [parts]
    out = []
    for k in (0, 1):
        own = [p for p in parts if p[5] == k]
        if own and stackable([p[0] for p in own]) and stackable([p[1] for p in own]):
            out.append(own)
        else:
            out += [[p] for p in own]
    return out


def _points_grad_differentiable(ctx, x, y, a, b, grad_out):
    """The point gradients under ``create_graph=True``: each term through EnvelopeGrad, so
    that their backward is the HVP of S."""
    xy, xx, yy = ctx.terms
    need = ctx.needs_input_grad
    opts = hvp_settings(ctx.hvp_options)
    gx, gy = EnvelopeGrad.apply(x, y, a, b, grad_out, xy, need[0], need[1], opts)
    half = -0.5 * grad_out
    if need[0]:
        u, v = EnvelopeGrad.apply(x, x, a, a, half, xx, True, True, opts)
        gx = gx + u + v
    if need[1]:
        u, v = EnvelopeGrad.apply(y, y, b, b, half, yy, True, True, opts)
        gy = gy + u + v
    return gx, gy
