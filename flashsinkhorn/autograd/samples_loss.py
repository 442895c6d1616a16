"""GeomLoss-compatible Sinkhorn loss: GeomLoss's iteration, our kernels and envelope gradients.

GeomLoss (p = 2) uses the half cost ½‖x − y‖², eps_G = blur², rho_G = reach². In our
full-cost units every quantity doubles: eps = 2 eps_G, rho = 2 rho_G, potentials f = 2 f_G,
so the damping 1 / (1 + eps / rho) and every plan are the same. The iteration reproduces
GeomLoss's ``sinkhorn_loop`` exactly (docs/transport.md):

1. a plain update from zero potentials at eps_list[0];
2. one averaged symmetric update per entry of eps_list (the first value appears twice);
3. the "last extrapolation": one full update of every potential from the previous ones,
   f⁺ = softmin(g), g⁺ = softmin(f) (and f_aa⁺, g_bb⁺ for the debiased terms).

Steps 1–3 are the library's solver loop with GeomLoss's ladder as its eps list and
``extrapolate=True`` (solvers/loop.py); the debiasing terms are self problems of that loop.
The value is GeomLoss's formula at the extrapolated potentials. GeomLoss differentiates the
last update by autograd with the old potentials detached, which is the envelope gradient with
the plans P(f⁺, g) (for x) and P(f, g⁺) (for y); we apply those plans with one fused
streaming pass per term instead of an n × m graph. For a relaxed problem (reach) GeomLoss's
autograd scales every gradient by (rho + eps/2)/(rho + eps) (its custom backward is never
called); we return the derivative of the value, i.e. GeomLoss's intended gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .. import limits
from ..backends import resolve_backend
from ..engine import resolve_precision
from ..options import SinkhornOptions
from ..problem import Problem, prepare
from ..solvers import estimate_diameter, geometric_ladder, solve
from .guard import guard_second_order


@dataclass(frozen=True)
class GeomLossSpec:
    """Options of a GeomLoss-style Sinkhorn loss in GeomLoss's own units (p = 2)."""

    blur: float
    reach: float | None
    diameter: float | None
    scaling: float
    debias: bool
    backend: str
    precision: str
    check_finite: bool = True
    #: GeomLoss's exponent: 2 (C = ½‖x − y‖², eps = blur², rho = reach²) or 1 (C = ‖x − y‖,
    #: eps = blur, rho = reach; the distance is sqrt(max(‖x − y‖², 1e-8)) as in GeomLoss).
    p: int = 2


def _k(spec: GeomLossSpec) -> float:
    """Our cost over GeomLoss's: 2 for p = 2 (‖x − y‖² vs ½‖x − y‖²), 1 for p = 1."""
    return 2.0 if spec.p == 2 else 1.0


def _rho(spec: GeomLossSpec) -> float | None:
    return None if spec.reach is None else _k(spec) * spec.reach**spec.p


def _prepare(x, y, a, b, spec: GeomLossSpec, prec: str) -> Problem:
    rho = _rho(spec)
    extra = {} if spec.p == 2 else {"cost": "euclidean", "sq_floor": GEOMLOSS_SQ_FLOOR}
    return prepare(
        x, y, a, b, rho_x=rho, rho_y=rho, precision=prec, check_finite=spec.check_finite, **extra
    )


#: GeomLoss's tensorized p = 1 cost clamps the squared distance at 1e-8 before the root.
GEOMLOSS_SQ_FLOOR = 1e-8


def geomloss_eps_list(diameter: float, blur: float, scaling: float, p: int = 2) -> list[float]:
    """GeomLoss's eps schedule in its own units, the duplicated first value included:
    ``[diameter^p] + exp(arange(p log diameter, p log blur, p log scaling)) + [blur^p]``."""
    return geometric_ladder(diameter**p, blur**p, scaling**p, keep_start=True)


def _eps_list(x: torch.Tensor, y: torch.Tensor, spec: GeomLossSpec) -> list[float]:
    """The schedule in our (full-cost) units. Like GeomLoss, the diameter is the bounding box
    of all the caller's points, every batch together, before any centring."""
    diameter = spec.diameter
    if diameter is None:
        xb = x.detach() if x.dim() == 3 else x.detach().unsqueeze(0)
        yb = y.detach() if y.dim() == 3 else y.detach().unsqueeze(0)
        diameter = estimate_diameter(xb, yb)
    if not (diameter > 0 and math.isfinite(diameter)):
        # All points coincide (GeomLoss takes log(0) here): any positive start is equivalent.
        diameter = spec.blur
    k = _k(spec)
    return [k * e for e in geomloss_eps_list(diameter, spec.blur, spec.scaling, spec.p)]


class _Loop:
    """The potentials of GeomLoss's loop for the xy, xx and yy problems (our units).

    Each problem runs the solver loop on the ladder ``[eps_0] + eps_list`` with one iteration
    at the last eps: a plain update from zero at eps_0, one averaged update per entry of
    eps_list, then the extrapolation (a plain update that keeps the previous potentials).
    """

    def __init__(self, problem: Problem, impl, eps_list: list[float], debias: bool):
        opts = SinkhornOptions(eps=eps_list[-1], n_iters=1, tol=None, schedule="symmetric",
                               acceleration="none", scaling=None)  # fmt: skip
        ladder = [eps_list[0], *eps_list]

        def run(pr):
            return solve(pr, impl, ladder, opts, extrapolate=True)

        st = run(problem)
        self.f, self.g, self.f_old, self.g_old = st.f, st.g, st.f_prev, st.g_prev
        self.debias = debias
        if debias:
            sx = run(replace(problem, Y=problem.X))
            sy = run(replace(problem, X=problem.Y))
            self.p, self.p_old, self.q, self.q_old = sx.f, sx.f_prev, sy.f, sy.f_prev
        self.eps = st.eps


def _dot(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (w * v).sum(-1)


class SamplesLossFunction(torch.autograd.Function):
    """``apply(x, y, a, b, spec)`` -> GeomLoss's Sinkhorn value, () or (B,)."""

    @staticmethod
    def forward(ctx, x, y, a, b, spec: GeomLossSpec):
        impl = resolve_backend(spec.backend, x.device, x.dtype)
        prec = resolve_precision(spec.precision, impl.name, x.dtype)
        with torch.no_grad():
            problem = _prepare(x, y, a, b, spec, prec)
            eps_list = _eps_list(x, y, spec)
            problem = limits.admit(problem, eps_list, tol=None, names=("reach", "reach"))
            loop = _Loop(problem, impl, eps_list, spec.debias)
            value = _value(problem, loop, spec)
        ctx.problem, ctx.impl, ctx.loop, ctx.spec = problem, impl, loop, spec
        ctx.save_for_backward(x, y, a, b)
        return problem.unbatch(value)

    @staticmethod
    def backward(ctx, grad_out):
        x, y, a, b = ctx.saved_tensors
        problem, impl, loop, spec = ctx.problem, ctx.impl, ctx.loop, ctx.spec
        limits.check_plan(problem, loop.eps, "gradients")
        X, Y, prec, eps = problem.X, problem.Y, problem.precision, loop.eps
        need = ctx.needs_input_grad
        gx = gy = ga = gb = None
        with torch.no_grad():
            go = grad_out.reshape(-1).to(problem.dtype)

            def points_grad(R, C, own_new, other_old, sym_new, sym_old):
                # Our kernels give the gradient of our cost: 2 Σ_j P_ij (r_i − c_j) for p = 2
                # (GeomLoss's cost is half of ours), Σ_j P_ij (r_i − c_j)/‖r_i − c_j‖ for p = 1.
                G, _ = impl.transport_grad(R, C, own_new, other_old, eps, prec)
                if spec.debias:
                    G = G - impl.transport_grad(R, R, sym_new, sym_old, eps, prec)[0]
                return problem.unbatch(G * (go / _k(spec))[:, None, None])

            if need[0]:
                gx = points_grad(X, Y, loop.f, loop.g_old, _get(loop, "p"), _get(loop, "p_old"))
                gx = gx.to(x.dtype)
            if need[1]:
                gy = points_grad(Y, X, loop.g, loop.f_old, _get(loop, "q"), _get(loop, "q_old"))
                gy = gy.to(y.dtype)
            if need[2] and a is not None:
                ga = _reduce(_weight_grad(loop.f, _get(loop, "p"), spec) * go[:, None], a)
            if need[3] and b is not None:
                gb = _reduce(_weight_grad(loop.g, _get(loop, "q"), spec) * go[:, None], b)
        gx, gy, ga, gb = guard_second_order((gx, gy, ga, gb), (x, y, a, b))
        return gx, gy, ga, gb, None


def _get(loop: _Loop, name: str):
    return getattr(loop, name, None)


def _units(spec: GeomLossSpec) -> tuple[float, float | None]:
    return spec.blur**spec.p, (None if spec.reach is None else spec.reach**spec.p)


def _value(problem: Problem, loop: _Loop, spec: GeomLossSpec) -> torch.Tensor:
    """(B,) GeomLoss's ``sinkhorn_cost`` at the extrapolated potentials (half-cost units)."""
    a, b = problem.X.w, problem.Y.w
    k = _k(spec)
    F, G = loop.f / k, loop.g / k
    eps, rho = _units(spec)
    if spec.debias:
        Pa, Qb = loop.p / k, loop.q / k
        if rho is None:
            return _dot(a, F - Pa) + _dot(b, G - Qb)
        ea = torch.exp(-Pa / rho) - torch.exp(-F / rho)
        eb = torch.exp(-Qb / rho) - torch.exp(-G / rho)
        return (rho + eps / 2) * (_dot(a, ea) + _dot(b, eb))
    if rho is None:
        return _dot(a, F) + _dot(b, G)
    return (rho + eps / 2) * (_dot(a, -torch.expm1(-F / rho)) + _dot(b, -torch.expm1(-G / rho)))


def _weight_grad(f: torch.Tensor, p: torch.Tensor | None, spec: GeomLossSpec) -> torch.Tensor:
    """(B, n) derivative of the value w.r.t. one side's weights (half-cost units).

    Balanced: the potentials (up to a constant, as in GeomLoss). Relaxed: the derivative of
    the value at the fixed point, (rho + eps)(e^{−f_aa/rho} − e^{−f_ba/rho}) debiased and
    (rho + eps)(1 − e^{−f/rho}) − eps/2 otherwise (docs/transport.md).
    """
    eps, rho = _units(spec)
    k = _k(spec)
    F = f / k
    if rho is None:
        return F - p / k if spec.debias else F
    if spec.debias:
        return (rho + eps) * (torch.exp(-p / k / rho) - torch.exp(-F / rho))
    return (rho + eps) * -torch.expm1(-F / rho) - eps / 2


def _reduce(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.numel() != grad.numel():
        grad = grad.sum(0)
    return grad.reshape(like.shape).to(like.dtype)


def geomloss_potentials(x, y, a, b, spec: GeomLossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """GeomLoss's ``potentials=True`` output (F, G) in half-cost units; not differentiable."""
    impl = resolve_backend(spec.backend, x.device, x.dtype)
    prec = resolve_precision(spec.precision, impl.name, x.dtype)
    k = _k(spec)
    with torch.no_grad():
        problem = _prepare(x, y, a, b, spec, prec)
        eps_list = _eps_list(x, y, spec)
        problem = limits.admit(problem, eps_list, tol=None, names=("reach", "reach"))
        loop = _Loop(problem, impl, eps_list, spec.debias)
        F, G = loop.f / k, loop.g / k
        if spec.debias:
            F, G = F - loop.p / k, G - loop.q / k
    return problem.unbatch(F), problem.unbatch(G)
