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
from dataclasses import dataclass, field

import torch

from .. import limits, tuning
from .._boundary import backward_autocast_off
from ..hessian.joint import TransportHessian
from ..options import HVPOptions
from ..result import Solution
from ..solvers import estimate_diameter, geometric_ladder
from ..solvers.annealing import ladder_cap
from .double_backward import WEIGHT_MESSAGE, grad_out_cotangent, hvp_settings
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
    #: The ``backend`` argument as the caller wrote it: it decides the potentials' shape.
    route: str = "auto"
    #: Schur-solve settings of second derivatives.
    hvp: HVPOptions = field(default_factory=HVPOptions)


def geomloss_multiscale(route: str, batch: int, n: int, m: int, d: int, p: int) -> bool:
    """Whether GeomLoss 0.3.1 runs its "multiscale" routine for these inputs (``batch`` = 0
    for unbatched clouds): asked for, or chosen by "auto" above 10⁸ point pairs in <= 3
    dimensions for p = 2; with a batch of more than one it falls back to "tensorized"."""
    if route == "auto":
        route = "multiscale" if n * m > 10000**2 and d <= 3 and p == 2 else "tensorized"
    return route == "multiscale" and batch <= 1


def potentials_shape(F: torch.Tensor, x: torch.Tensor, y: torch.Tensor, spec) -> torch.Tensor:
    """GeomLoss's shape of a potential computed as (B, n): it returns ``F.view_as(α)`` with α
    the weights as its routine saw them, (B, n) for the tensorized and online routines (B = 1
    for unbatched clouds) and (n,) for the multiscale one."""
    batch = x.shape[0] if x.dim() == 3 else 0
    if geomloss_multiscale(spec.route, batch, x.shape[-2], y.shape[-2], x.shape[-1], spec.p):
        return F.reshape(F.shape[-1])
    return F


def _k(spec: GeomLossSpec) -> float:
    """Our cost over GeomLoss's: 2 for p = 2 (‖x − y‖² vs ½‖x − y‖²), 1 for p = 1."""
    return 2.0 if spec.p == 2 else 1.0


def _rho(spec: GeomLossSpec) -> float | None:
    return None if spec.reach is None else _k(spec) * spec.reach**spec.p


def geomloss_problem_args(spec: GeomLossSpec) -> dict:
    """The keywords of ``problem.prepare`` for GeomLoss's cost and relaxation (our units)."""
    rho = _rho(spec)
    extra = {} if spec.p == 2 else {"cost": "euclidean", "sq_floor": GEOMLOSS_SQ_FLOOR}
    return {"rho_x": rho, "rho_y": rho, **extra}


#: GeomLoss's tensorized p = 1 cost clamps the squared distance at 1e-8 before the root.
GEOMLOSS_SQ_FLOOR = 1e-8


def geomloss_eps_list(
    diameter: float, blur: float, scaling: float, p: int = 2, dtype: torch.dtype | None = None
) -> list[float]:
    """GeomLoss's eps schedule in its own units, the duplicated first value included:
    ``[diameter^p] + exp(arange(p log diameter, p log blur, p log scaling)) + [blur^p]``,
    computed from logarithms and starting at most at ``ladder_cap(dtype)`` (GeomLoss's own
    list overflows there)."""
    return geometric_ladder(
        0.0, blur**p, 0.0, keep_start=True, log_start=p * math.log(diameter),
        log_ratio=p * math.log(scaling), cap=ladder_cap(dtype), scaling=scaling,
    )  # fmt: skip


def geomloss_solve_ladder(
    x: torch.Tensor, y: torch.Tensor, spec: GeomLossSpec, dtype: torch.dtype
) -> list[float]:
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
    # The cap applies to our (k times larger) eps.
    ladder = geomloss_eps_list(diameter, spec.blur, spec.scaling, spec.p, dtype)
    return [min(k * e, ladder_cap(dtype)) for e in ladder]


def _dot(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (w * v).sum(-1)


class SamplesLossFunction(torch.autograd.Function):
    """``apply(x, y, a, b, spec, loop)`` -> GeomLoss's Sinkhorn value, () or (B,).

    ``loop``: the finished solve of (x, y, a, b) (``engine.solve_geomloss``, run outside this
    function): its problem, backend and the potentials of GeomLoss's loop.
    """

    @staticmethod
    def forward(ctx, x, y, a, b, spec: GeomLossSpec, loop):
        tuning.keep_for_backward(ctx)
        problem = loop.problem
        with torch.no_grad():
            value = _value(problem, loop, spec)
        ctx.problem, ctx.impl, ctx.loop, ctx.spec = problem, loop.backend, loop, spec
        ctx.save_for_backward(x, y, a, b)
        return problem.unbatch(value)

    @staticmethod
    @backward_autocast_off
    def backward(ctx, grad_out):
        x, y, a, b = ctx.saved_tensors
        problem, loop, spec = ctx.problem, ctx.loop, ctx.spec
        limits.check_plan(problem, loop.eps, "gradients", "blur")
        need = ctx.needs_input_grad
        # create_graph=True: for p = 2 and balanced marginals the point gradients are
        # differentiable, their backward the streaming HVP (as ot_cost's).
        second = torch.is_grad_enabled() and (need[0] or need[1])
        gx = gy = ga = gb = None
        if second and spec.p == 2 and spec.reach is None:
            gx, gy = _SamplesPointsGrad.apply(x, y, a, b, grad_out, ctx, need[0], need[1])
        elif need[0] or need[1]:
            with torch.no_grad():
                Gx, Gy = _points_grads(ctx, need[0], need[1])
                go = grad_out.reshape(-1).to(problem.dtype)
                gx = None if Gx is None else problem.unbatch(Gx * go[:, None, None]).to(x.dtype)
                gy = None if Gy is None else problem.unbatch(Gy * go[:, None, None]).to(y.dtype)
        with torch.no_grad():
            go = grad_out.reshape(-1).to(problem.dtype)
            if need[2] and a is not None:
                ga = _reduce(_weight_grad(loop.f, _get(loop, "p"), spec) * go[:, None], a)
            if need[3] and b is not None:
                gb = _reduce(_weight_grad(loop.g, _get(loop, "q"), spec) * go[:, None], b)
        if second and spec.p == 2 and spec.reach is None:
            ga, gb = guard_second_order((ga, gb), (x, y, a, b))
            return gx, gy, ga, gb, None, None
        if spec.p == 1:  # no second derivatives of the euclidean cost: a ValueError, as ot_cost
            from ..costs import refuse_second_order

            gx, gy, ga, gb = refuse_second_order((gx, gy, ga, gb), (x, y, a, b), "euclidean")
        else:
            gx, gy, ga, gb = guard_second_order((gx, gy, ga, gb), (x, y, a, b))
        return gx, gy, ga, gb, None, None


def _points_grads(ctx, need_x: bool, need_y: bool):
    """(B, n, d), (B, m, d) point gradients of GeomLoss's value per unit of grad_out (None
    where not needed): the envelope gradients with the plans P(f⁺, g) for x and P(f, g⁺) for
    y, minus those of the debiasing terms."""
    problem, impl, loop, spec = ctx.problem, ctx.impl, ctx.loop, ctx.spec
    X, Y, prec, eps = problem.X, problem.Y, problem.precision, loop.eps

    def grad(R, C, own_new, other_old, sym_new, sym_old):
        # Our kernels give the gradient of our cost: 2 Σ_j P_ij (r_i − c_j) for p = 2
        # (GeomLoss's cost is half of ours), Σ_j P_ij (r_i − c_j)/‖r_i − c_j‖ for p = 1.
        G, _ = impl.transport_grad(R, C, own_new, other_old, eps, prec)
        if spec.debias:
            G = G - impl.transport_grad(R, R, sym_new, sym_old, eps, prec)[0]
        return G / _k(spec)

    Gx = Gy = None
    if need_x:
        Gx = grad(X, Y, loop.f, loop.g_old, _get(loop, "p"), _get(loop, "p_old"))
    if need_y:
        Gy = grad(Y, X, loop.g, loop.f_old, _get(loop, "q"), _get(loop, "q_old"))
    return Gx, Gy


@dataclass(frozen=True)
class _Plan:
    """The plan of a pair of potentials, in the form ``TransportHessian`` reads."""

    solution: Solution
    eps: float


class _SamplesPointsGrad(torch.autograd.Function):
    """``apply(x, y, a, b, grad_out, fctx, need_x, need_y) -> (gx, gy)``: the point gradients
    of :class:`SamplesLossFunction` (p = 2, balanced), differentiable once more.

    Backward: each gradient is differentiated with the plan it was computed from, as the
    joint Hessian of OT_eps (``hessian/joint.py``) at that plan: P(f⁺, g) for the x gradient,
    P(f, g⁺) for the y gradient, and for the debiasing term −½ OT(x, x) the sum of the four
    blocks of the self problem's Hessian at P(f_aa⁺, f_aa) (the same for y), all halved for
    GeomLoss's half cost. At the fixed point these plans coincide and this is the Hessian
    of the debiased divergence with eps = 2 blur².
    """

    @staticmethod
    def forward(ctx, x, y, a, b, grad_out, fctx, need_x, need_y):
        tuning.keep_for_backward(ctx)
        problem = fctx.problem
        Gx, Gy = _points_grads(fctx, need_x, need_y)
        go = grad_out.detach().reshape(-1).to(problem.dtype)
        ctx.fctx, ctx.Gx, ctx.Gy, ctx.go, ctx.go_shape = fctx, Gx, Gy, go, grad_out.shape
        ctx.dtypes = (x.dtype, y.dtype)
        gx = None if Gx is None else problem.unbatch(Gx * go[:, None, None]).to(x.dtype)
        gy = None if Gy is None else problem.unbatch(Gy * go[:, None, None]).to(y.dtype)
        return gx, gy

    @staticmethod
    def backward(ctx, vx, vy):
        need = ctx.needs_input_grad
        if need[2] or need[3]:
            raise RuntimeError(WEIGHT_MESSAGE)
        fctx = ctx.fctx
        problem, loop, impl = fctx.problem, fctx.loop, fctx.impl
        go = ctx.go
        settings = hvp_settings(fctx.spec.hvp)

        def batched(v):
            if v is None:
                return None
            v = v.detach().to(problem.dtype)
            return v if problem.batched else v.unsqueeze(0)

        # Built on first use and kept on the node: repeated products (retain_graph=True, as in
        # Lanczos) reuse each plan's marginals and barycentric products.
        if not hasattr(ctx, "hessians"):
            ctx.hessians = {}
        cache = ctx.hessians

        def hessian(key, pr, f, g):
            if key not in cache:
                plan = _Plan(Solution(pr, impl, f, g, loop.eps), loop.eps)
                cache[key] = TransportHessian(plan)
            return cache[key]

        Vx, Vy = batched(vx), batched(vy)
        Hx = Hy = hx = hy = ggo = None
        debias = fctx.spec.debias
        if (need[0] or need[1]) and Vx is not None and ctx.Gx is not None:
            Ax = Vx * go[:, None, None]
            h = hessian("x", problem, loop.f, loop.g_old)
            dx, dy, _, _ = h.apply(Ax, None, want_x=need[0], want_y=need[1], **settings)
            Hx, Hy = _add(Hx, dx), _add(Hy, dy)
            if debias and need[0]:
                sx, sy, _, _ = hessian("xx", loop.problem_xx, loop.p, loop.p_old).apply(
                    Ax, Ax, **settings
                )
                Hx = _add(Hx, -0.5 * (sx + sy))
        if (need[0] or need[1]) and Vy is not None and ctx.Gy is not None:
            Ay = Vy * go[:, None, None]
            h = hessian("y", problem, loop.f_old, loop.g)
            dx, dy, _, _ = h.apply(None, Ay, want_x=need[0], want_y=need[1], **settings)
            Hx, Hy = _add(Hx, dx), _add(Hy, dy)
            if debias and need[1]:
                sx, sy, _, _ = hessian("yy", loop.problem_yy, loop.q, loop.q_old).apply(
                    Ay, Ay, **settings
                )
                Hy = _add(Hy, -0.5 * (sx + sy))
        k = _k(fctx.spec)
        if need[0] and Hx is not None:
            hx = problem.unbatch(Hx / k).to(ctx.dtypes[0])
        if need[1] and Hy is not None:
            hy = problem.unbatch(Hy / k).to(ctx.dtypes[1])
        if need[4]:
            ggo = grad_out_cotangent(ctx.Gx, ctx.Gy, Vx, Vy, go, ctx.go_shape)
        # A third derivative would need the derivative of the HVP itself: refuse it loudly.
        hx, hy = guard_second_order((hx, hy), (vx, vy))
        return hx, hy, None, None, ggo, None, None, None


def _add(total: torch.Tensor | None, t: torch.Tensor | None) -> torch.Tensor | None:
    return t if total is None else (total if t is None else total + t)


def _get(loop, name: str):
    return getattr(loop, name, None)


def _units(spec: GeomLossSpec) -> tuple[float, float | None]:
    return spec.blur**spec.p, (None if spec.reach is None else spec.reach**spec.p)


def _value(problem, loop, spec: GeomLossSpec) -> torch.Tensor:
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


def geomloss_potentials(loop, x, y, spec: GeomLossSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """GeomLoss's ``potentials=True`` output (F, G) in half-cost units from the finished solve
    ``loop`` of (x, y) (``engine.solve_geomloss``), in GeomLoss's shapes
    (:func:`potentials_shape`: (1, n) for unbatched clouds); not differentiable."""
    k = _k(spec)
    with torch.no_grad():
        F, G = loop.f / k, loop.g / k
        if spec.debias:
            F, G = F - loop.p / k, G - loop.q / k
    return potentials_shape(F, x, y, spec), potentials_shape(G, y, x, spec)
