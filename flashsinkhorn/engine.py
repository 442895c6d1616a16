"""From validated options to a result: the one place a solve is assembled.

Every entry point (``sinkhorn``, ``solve``, ``ot_cost``, ``sinkhorn_divergence``,
``SinkhornDivergence``, ``SamplesLoss``, the Hessian operator, OTDD, the sharded solve)
goes through the same four steps here:

1. :func:`bind`: the backend of the device and dtype (the registry), its strategy (plain or
   multiscale), the precision, ``prepare`` (canonical problem), the path, then
   :func:`admit`: "auto" options resolved for the problem, its eps ladder, and
   ``limits.admit`` (range checks, plan floor, large-eps sides);
2. :func:`run`: the loop, by the backend's strategy (``Capabilities.strategy``), replayed from
   a CUDA graph for a fixed number of iterations on a graph-safe backend;
3. the self terms of a divergence from ``problem.self_terms`` (the one place they are
   stacked), each on the backend :func:`rebind` gives its problem;
4. :func:`finish`: the :class:`~flashsinkhorn.result.SinkhornResult` with the
   :class:`~flashsinkhorn.result.Route` that every "auto" resolved to.

Nothing here reads a backend's name or path: only its ``capabilities``. The autograd
functions receive finished solves (the solve runs outside them) and never solve themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import _validation as V
from . import limits
from .backends import kernel_costs, resolve_backend, select_path
from .backends.base import Backend
from .backends.matrix import MatrixBackend, prepare_matrix
from .backends.sides import prepare_sides
from .multiscale import multiscale_applies, multiscale_backend, solve_multiscale
from .options import SinkhornOptions
from .problem import Problem, prepare, self_terms
from .result import Route, SinkhornResult, Solution
from .solvers import SolveState, dual_value, eps_schedule, estimate_diameter, graphs, solve
from .solvers.annealing import cost_range

if TYPE_CHECKING:
    from .autograd.samples_loss import GeomLossSpec


def resolve_precision(precision: str, backend: Backend, dtype: torch.dtype) -> str:
    """The precision of a solve: ``precision`` unless "auto", else the backend's default for
    ``dtype`` (``Capabilities.default_precision``: TF32 on pre-rounded points for float32
    solves on compiled kernels, exact products otherwise)."""
    V.check_choice("precision", precision, V.PRECISIONS)
    if precision != "auto":
        return precision
    return backend.capabilities.default_precision(dtype)


@dataclass(frozen=True)
class Bound:
    """A problem ready to run: admitted, its backend bound to it, every "auto" resolved.

    Attributes:
        problem: the canonical problem, admitted by the range checks for its ladder.
        backend: the backend bound to ``problem`` (its path and strategy chosen).
        base: the backend of the device and dtype before any path or strategy (the self
            terms of a divergence bind their own problems from it).
        opts: the options with "auto" resolved for this problem.
        eps_list: the eps ladder (its last value is the target eps).
    """

    problem: Problem
    backend: Backend
    base: Backend
    opts: SinkhornOptions
    eps_list: list[float]


def bind(x, y, a, b, opts: SinkhornOptions, *, sq_floor: float = 0.0) -> Bound:
    """Resolves the backend, prepares the problem of transformed points and admits it.

    Args:
        x: (n, d) or (B, n, d) transformed source points (``costs.transform_points``).
        y: (m, d) or (B, m, d) transformed target points.
        a: weights of x or None (checked here, with the points' values).
        b: weights of y or None.
        opts: validated options; ``opts.cost`` supplies the kernel cost and the labels.
        sq_floor: floor of the squared distance under the euclidean cost's square root.
    """
    spec = opts.cost
    base = resolve_backend(opts.backend, x.device, x.dtype)
    multiscale = multiscale_applies(x, y, opts)
    # the multiscale path forms distances from exact coordinates (no tensor-core rounding)
    prec = "ieee" if multiscale else resolve_precision(opts.precision, base, x.dtype)
    problem = prepare(
        x, y, a, b, rho_x=opts.rho_x, rho_y=opts.rho_y, precision=prec,
        check_finite=opts.check_finite, cost=spec.kernel_cost,
        labels=spec.labels_for_prepare(), sq_floor=sq_floor,
        sides=prepare_sides(x, y),
    )  # fmt: skip
    if multiscale:
        impl = multiscale_backend(base, problem, opts)
    else:
        impl = select_path(base, problem, opts.path)
    problem, opts, eps_list = admit(
        problem, opts, long_iterations=impl.capabilities.long_iterations
    )
    return Bound(problem, impl, base, opts, eps_list)


def admit(problem: Problem, opts: SinkhornOptions, *, long_iterations: bool = False,
          eps_list: list[float] | None = None, names=("rho_x", "rho_y"),
          eps_name: str = "eps", work: int | None = None):  # fmt: skip
    """``(problem, opts, eps_list)``: the options with "auto" resolved for ``problem``, its
    eps ladder (:func:`schedule_for`; ``eps_list`` when given, with ``opts`` resolved
    already), and the problem admitted by ``limits.admit`` for that ladder (range checks,
    the plan floor of a solve with a tolerance, the large-eps sides; ``names`` and
    ``eps_name`` are the relaxation and eps arguments its errors name). ``work``: the
    scores per half-step of the whole problem when ``problem`` holds one shard of it (a
    sharded solve), else B·n·m.
    """
    if eps_list is None:
        opts, eps_list = schedule_for(problem, opts, gpu=long_iterations, work=work)
    problem = limits.admit(problem, eps_list, tol=opts.tol, names=names, eps_name=eps_name)
    return problem, opts, eps_list


def rebind(bound: Bound, problem: Problem) -> Backend:
    """The backend of another problem of the same solve (the self terms of a divergence):
    the same strategy, and a path chosen for that problem (a dense-path backend holds the
    Gram matrix of its own problem)."""
    if bound.backend.capabilities.strategy == "multiscale":
        return multiscale_backend(bound.base, problem, bound.opts)
    return select_path(bound.base, problem, bound.opts.path)


def run(problem: Problem, backend: Backend, eps_list: list[float], opts: SinkhornOptions, *,
        value: bool = True, extrapolate: bool = False):  # fmt: skip
    """``(state, value or None)``: the loop on a bound problem, by the backend's strategy.

    A fixed number of iterations never synchronises: on CUDA, on a graph-safe backend, the
    solve and its value are replayed from a cached graph (solvers/graphs.py).

    Args:
        value: also compute the dual value of the final potentials.
        extrapolate: end with one plain update that keeps the previous potentials
            (``SolveState.f_prev``; GeomLoss's last extrapolation).
    """

    with graphs.staged(problem, backend) as launched:
        return _run(launched, backend, eps_list, opts, value, extrapolate)


def _run(problem, backend, eps_list, opts, value, extrapolate):
    """:func:`run` on the problem its launches read (``graphs.staged``)."""

    def eager():
        if backend.capabilities.strategy == "multiscale":
            check_multiscale_eps(problem, eps_list[-1])
            st = solve_multiscale(problem, backend, eps_list, opts, problem.diameter)
        else:
            with backend.threads():
                st = solve(problem, backend, eps_list, opts, extrapolate=extrapolate)
        val = dual_value(problem, st.f, st.g, st.eps, backend) if value else None
        backend.release()  # a backend's per-solve storage (the CPU path's kernel)
        return st, val

    key = None
    if opts.tol is None and value and not extrapolate:
        key = graphs.solve_key(problem, backend, eps_list, opts.n_iters, opts.schedule)
    if key is None:
        return eager()
    f, g, val = graphs.run(key, lambda: _tensors(*eager()), problem.device)
    n_done = len(eps_list) - 1 + opts.n_iters
    return SolveState(f, g, eps_list[-1], n_done, False, None, n_annealing=len(eps_list) - 1), val


def finish(problem: Problem, backend: Backend, state: SolveState, value: torch.Tensor,
           opts: SinkhornOptions) -> SinkhornResult:  # fmt: skip
    """The result of a solve, with the route every "auto" resolved to."""
    own = problem.X is problem.Y
    route = Route(
        backend=backend.name,
        path=backend.path,
        strategy=backend.capabilities.strategy,
        precision=problem.precision,
        # a self problem runs the averaged one-potential iteration (solvers/loop.py)
        schedule="symmetric" if own else opts.schedule,
        acceleration="none" if own else opts.acceleration,
    )
    return SinkhornResult(
        problem=problem, backend=backend, f=state.f, g=state.g, value=value, eps=state.eps,
        n_iters=state.n_iters, converged=state.converged,
        marginal_error=state.marginal_error, errors=state.errors, route=route,
        n_annealing=state.n_annealing,
    )  # fmt: skip


def _solve(problem: Problem, impl: Backend, eps_list, opts: SinkhornOptions) -> SinkhornResult:
    """Runs and finishes one bound problem."""
    return finish(problem, impl, *run(problem, impl, eps_list, opts), opts)


def solve_points(x, y, a, b, opts: SinkhornOptions, *, sq_floor: float = 0.0) -> SinkhornResult:
    """Solves the problem of points already mapped by ``costs.transform_points``.

    Args:
        x, y, a, b, opts, sq_floor: as in :func:`bind`.
    """
    with torch.no_grad():
        bd = bind(x, y, a, b, opts, sq_floor=sq_floor)
        return _solve(bd.problem, bd.backend, bd.eps_list, bd.opts)


def solve_divergence(x, y, a, b, opts: SinkhornOptions):
    """The three solves of the Sinkhorn divergence: OT(x, y), OT(x, x), OT(y, y).

    One ``prepare`` serves all three: the self terms use the sides of the joint problem
    (``problem.self_terms``), so they share its centring, operand scale and eps ladder. When
    both clouds have the same size and relaxation, OT(x, x) and OT(y, y) run as one batch of
    2B self problems: one launch per iteration for both.

    Args:
        x, y, a, b: as in :func:`bind`.
        opts: validated options. With labels the self terms use (label_x, label_x) and
            (label_y, label_y) with the same label cost W; when W is not symmetric they are
            solved as two-potential problems.

    Returns:
        The results of OT(x, y), OT(x, x) and OT(y, y), each with its own problem
        (``problem.X is problem.Y`` for the self terms).
    """
    with torch.no_grad():
        bd = bind(x, y, a, b, opts)
        # the three values must resolve their difference (the mass term's rounding)
        limits.check_divergence(bd.problem, bd.opts.eps, bd.opts.tol)
        xy = _solve(bd.problem, bd.backend, bd.eps_list, bd.opts)
        terms = self_terms(bd.problem)

        def term(p: Problem) -> SinkhornResult:
            return _solve(p, rebind(bd, p), bd.eps_list, bd.opts)

        if terms.both is None:
            return xy, term(terms.xx), term(terms.yy)
        p = terms.both
        backend = rebind(bd, p)
        st, value = run(p, backend, bd.eps_list, bd.opts)

        def part(k: int) -> SinkhornResult:
            # problem k of the two stacked self terms, as a result of its own problem
            err = st.marginal_error
            sk = SolveState(
                terms.part(st.f, k), terms.part(st.g, k), st.eps, st.n_iters, st.converged,
                None if err is None else terms.part(err, k), st.errors,
                n_annealing=st.n_annealing,
            )  # fmt: skip
            return finish(terms.xx if k == 0 else terms.yy, backend, sk, terms.part(value, k),
                          bd.opts)  # fmt: skip

        return xy, part(0), part(1)


def solve_matrix(C: torch.Tensor, a, b, opts: SinkhornOptions) -> SinkhornResult:
    """Solves the problem of a given cost matrix (``backends/matrix.py``) with the same loop.

    The result's ``value`` is differentiable w.r.t. C, a and b
    (``autograd/matrix_cost.py``), computed from the finished solve.

    Args:
        C: (n, m) or (B, n, m) cost, checked here with its weights.
        a: weights of the rows or None.
        b: weights of the columns or None.
        opts: validated options; the cost, backend, precision, path, diameter and
            check_finite are unused (C's values are always checked).
    """
    with torch.no_grad():
        problem, spread = prepare_matrix(C, a, b, rho_x=opts.rho_x, rho_y=opts.rho_y)
        impl = MatrixBackend()
        scale = spread if spread > 0 else None
        opts = opts.resolve(scale)
        # The ladder of the squared Euclidean cost with diameter² = the spread of C: for C the
        # squared distances of two clouds it is sinkhorn()'s ladder from their largest distance.
        diameter = None if scale is None else math.sqrt(scale)
        eps_list = eps_schedule(opts.eps, opts.scaling, diameter)
        # the range checks, plan floor and large-eps soft-min of every other solve
        problem, _, _ = admit(problem, opts, eps_list=eps_list)
        state, value = run(problem, impl, eps_list, opts)
    # imported here: the autograd package imports hessian/, whose public half imports this
    # module (the import points down, docs/architecture.md; only the order is circular)
    from .autograd.matrix_cost import MatrixCostFunction

    sol = Solution(problem, impl, state.f, state.g, state.eps)
    value = MatrixCostFunction.apply(C, a, b, sol, value)
    return finish(problem, impl, state, value, opts)


@dataclass(frozen=True)
class GeomLossSolve:
    """The potentials of GeomLoss's loop for the xy, xx and yy problems (our units).

    ``f, g``: the extrapolated potentials of OT(x, y); ``f_old, g_old``: those before the
    extrapolation; ``p, q`` (and ``p_old, q_old``) the same for the self terms (None without
    debiasing).
    """

    problem: Problem
    backend: Backend
    eps: float
    f: torch.Tensor
    g: torch.Tensor
    f_old: torch.Tensor
    g_old: torch.Tensor
    debias: bool
    problem_xx: Problem | None = None
    problem_yy: Problem | None = None
    p: torch.Tensor | None = None
    p_old: torch.Tensor | None = None
    q: torch.Tensor | None = None
    q_old: torch.Tensor | None = None


def solve_geomloss(x, y, a, b, spec: GeomLossSpec) -> GeomLossSolve:
    """GeomLoss's ``sinkhorn_loop`` on checked clouds (``autograd/samples_loss.py``).

    Each problem runs the solver loop on GeomLoss's ladder ``[eps_0] + eps_list`` with one
    iteration at the last eps: a plain update from zero at eps_0, one averaged update per
    entry of eps_list, then the extrapolation (a plain update that keeps the previous
    potentials). The self terms are those of ``problem.self_terms``.
    """
    from .autograd.samples_loss import geomloss_problem_args, geomloss_solve_ladder

    base = resolve_backend(spec.backend, x.device, x.dtype)
    prec = resolve_precision(spec.precision, base, x.dtype)
    with torch.no_grad():
        problem = prepare(
            x, y, a, b, precision=prec, check_finite=spec.check_finite,
            **geomloss_problem_args(spec),
        )  # fmt: skip
        eps_list = geomloss_solve_ladder(x, y, spec, problem.dtype)
        opts = SinkhornOptions(eps=eps_list[-1], n_iters=1, tol=None, schedule="symmetric",
                               acceleration="none", scaling=None)  # fmt: skip
        problem, _, _ = admit(problem, opts, eps_list=eps_list, names=("reach", "reach"),
                              eps_name="blur")  # fmt: skip
        ladder = [eps_list[0], *eps_list]

        def loop(p: Problem) -> SolveState:
            return run(p, base, ladder, opts, value=False, extrapolate=True)[0]

        st = loop(problem)
        out = dict(problem=problem, backend=base, eps=st.eps, f=st.f, g=st.g, f_old=st.f_prev,
                   g_old=st.g_prev, debias=spec.debias)  # fmt: skip
        if spec.debias:
            terms = self_terms(problem)
            out.update(problem_xx=terms.xx, problem_yy=terms.yy)
            if terms.both is not None:
                sb = loop(terms.both)
                sx = (terms.part(sb.f, 0), terms.part(sb.f_prev, 0))
                sy = (terms.part(sb.f, 1), terms.part(sb.f_prev, 1))
            else:
                tx, ty = loop(terms.xx), loop(terms.yy)
                sx, sy = (tx.f, tx.f_prev), (ty.f, ty.f_prev)
            out.update(p=sx[0], p_old=sx[1], q=sy[0], q_old=sy[1])
    return GeomLossSolve(**out)


def check_multiscale_eps(problem: Problem, eps: float) -> None:
    """Refuses the multiscale path at an eps where the soft-min needs the large-eps
    expansion (limits.py): every tile pair would be visited there anyway."""
    if eps >= problem.X.large_eps or eps >= problem.Y.large_eps:
        raise ValueError(
            f"path='multiscale' is for small eps (eps much below diameter²); eps={eps:.3g} is "
            "at the scale of the cost itself, where every tile pair is visited: use "
            "path='auto' or 'streaming'"
        )


def schedule_for(problem, opts: SinkhornOptions, *, diameter=None, gpu: bool = False,
                 work: int | None = None):  # fmt: skip
    """The options with "auto" resolved for this problem, and its eps ladder.

    The cost's range that the rule and the ladder start from is diameter^p (+ the largest
    label cost), p = 2 for the squared Euclidean cost and 1 for the euclidean one; the
    diameter is ``opts.diameter``, else ``diameter``, else the bounding box of both clouds
    (``problem.diameter``, the largest over a batch, read with prepare's value checks).
    ``gpu``: an iteration of the backend costs far more than its launches on large problems
    (``Capabilities.long_iterations``; the choice of acceleration weighs them); ``work``
    the scores per half-step of the whole problem (None: B·n·m of ``problem``).
    """
    wants_range = opts.scaling == "auto" and opts.tol is not None
    wants_range = wants_range or isinstance(opts.scaling, float)
    diameter = opts.diameter if opts.diameter is not None else diameter
    if wants_range and diameter is None:
        diameter = problem.diameter
    if wants_range and diameter is None:
        diameter = estimate_diameter(problem.X.x, problem.Y.x)
    power = kernel_costs.power(problem.cost)
    offset = float(problem.X.lcost.max()) if problem.has_labels and wants_range else 0.0
    if diameter is not None and not math.isfinite(diameter):
        diameter = None  # non-finite points (check_finite=False): no ladder
    # inf where diameter^power overflows: the rule then anneals, from the ladder's cap.
    scale = cost_range(diameter, power, offset) if diameter else None
    if work is None:
        work = problem.B * problem.X.n * problem.Y.n
    work = work if gpu else None
    opts = opts.resolve(scale, work)
    eps_list = eps_schedule(opts.eps, opts.scaling, diameter, power, offset, dtype=problem.dtype)
    return opts, eps_list


def _tensors(state: SolveState, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # what a graphed fixed-iteration solve hands back (the rest of the state is known)
    return state.f, state.g, value
