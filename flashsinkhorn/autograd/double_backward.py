"""Differentiable envelope gradients: the second derivative of OT_eps through the HVP.

When a backward of :class:`~.ot_cost.OTCostFunction` runs with ``create_graph=True``, the
gradients w.r.t. x and y are produced by :class:`EnvelopeGrad`, whose own backward is the
joint Hessian of OT_eps in (x, y) applied to the incoming cotangents (the Hessian is
symmetric, so the vector–Jacobian product of the gradient map *is* an HVP). Autograd then
composes it with whatever produced x and y (e.g. y = x W), so parameter-space HVPs of composed
objectives come out of plain ``torch.autograd.grad``, chain-rule terms included.

Second derivatives through the weights a, b are not implemented and raise.
"""

from __future__ import annotations

import torch

from .. import tuning
from .._boundary import backward_autocast_off
from ..hessian.joint import TransportHessian
from ..options import HVPOptions
from .guard import guard_second_order

WEIGHT_MESSAGE = (
    "flashsinkhorn: second derivatives of OT losses through the weights a, b are not "
    "implemented (only through the points x, y); detach a and b (a.detach()) before the loss "
    "when you differentiate twice"
)


def hvp_settings(options: HVPOptions | dict | None) -> dict:
    """Schur-solve settings for the double backward (``hvp_options`` of the losses), as the
    keyword arguments of ``TransportHessian.apply``."""
    o = HVPOptions.build(options)
    return {"tau": o.tau, "cg_tol": o.cg_tol, "cg_max_iter": o.cg_max_iter,
            "check_every": o.cg_check_every}  # fmt: skip


def grad_out_cotangent(Gx, Gy, Vx, Vy, go, shape) -> torch.Tensor:
    """The backward of ``grad_out`` through the scaled envelope gradients go · G: Σ ⟨G, V⟩
    per problem, in the shape of ``grad_out``."""
    acc = torch.zeros_like(go)
    if Vx is not None and Gx is not None:
        acc = acc + (Gx * Vx).sum((1, 2))
    if Vy is not None and Gy is not None:
        acc = acc + (Gy * Vy).sum((1, 2))
    return acc.reshape(shape)


class EnvelopeGrad(torch.autograd.Function):
    """``apply(x, y, a, b, grad_out, res, need_x, need_y, options) -> (gx, gy)``.

    Forward: the envelope gradients 2 (diag(â) x − P y) and 2 (diag(b̂) y − Pᵀ x) scaled by
    ``grad_out`` (None for a side not needed). Backward: joint HVP (cached plan, one Schur solve
    per call) plus the derivative w.r.t. ``grad_out``.
    """

    @staticmethod
    def forward(ctx, x, y, a, b, grad_out, res, need_x, need_y, options):
        tuning.keep_for_backward(ctx)
        sol = res.solution
        problem, impl = sol.problem, sol.backend
        go = grad_out.detach().reshape(-1).to(problem.dtype)
        Gx = Gy = None
        if need_x:
            Gx, _ = impl.transport_grad(problem.X, problem.Y, sol.f, sol.g, res.eps,
                                        problem.precision)  # fmt: skip
        if need_y:
            Gy, _ = impl.transport_grad(problem.Y, problem.X, sol.g, sol.f, res.eps,
                                        problem.precision)  # fmt: skip
        ctx.res, ctx.options, ctx.Gx, ctx.Gy, ctx.go = res, options, Gx, Gy, go
        ctx.go_shape = grad_out.shape
        ctx.dtypes = (x.dtype, y.dtype)
        gx = None if Gx is None else problem.unbatch(Gx * go[:, None, None]).to(x.dtype)
        gy = None if Gy is None else problem.unbatch(Gy * go[:, None, None]).to(y.dtype)
        return gx, gy

    @staticmethod
    @backward_autocast_off
    def backward(ctx, vx, vy):
        need = ctx.needs_input_grad
        if need[2] or need[3]:
            raise RuntimeError(WEIGHT_MESSAGE)
        res = ctx.res
        problem = res.solution.problem
        if not hasattr(ctx, "hessian"):
            ctx.hessian = TransportHessian(res)
        go = ctx.go

        def batched(v):
            if v is None:
                return None
            v = v.detach().to(problem.dtype)
            return v if problem.batched else v.unsqueeze(0)

        Vx, Vy = batched(vx), batched(vy)
        hx = hy = ggo = None
        if (need[0] or need[1]) and (Vx is not None or Vy is not None):
            Ax = None if Vx is None else Vx * go[:, None, None]
            Ay = None if Vy is None else Vy * go[:, None, None]
            Hx, Hy, _, _ = ctx.hessian.apply(Ax, Ay, want_x=need[0], want_y=need[1],
                                             **ctx.options)  # fmt: skip
            hx = None if Hx is None else problem.unbatch(Hx).to(ctx.dtypes[0])
            hy = None if Hy is None else problem.unbatch(Hy).to(ctx.dtypes[1])
        if need[4]:
            ggo = grad_out_cotangent(ctx.Gx, ctx.Gy, Vx, Vy, go, ctx.go_shape)
        # A third derivative would need the derivative of the HVP itself: refuse it loudly.
        hx, hy = guard_second_order((hx, hy), (vx, vy))
        return hx, hy, None, None, ggo, None, None, None, None
