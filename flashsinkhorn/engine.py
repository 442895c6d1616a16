"""From validated options to a result: build the problem, pick the backend, run the loop.

This is the one place where a solve is assembled. The public functions validate their
arguments into a :class:`~flashsinkhorn.options.SinkhornOptions` and call
:func:`solve_points`; the autograd functions, the Hessian operator and OTDD call it too, so
none of them imports the public layer. :func:`solve_matrix` is the same assembly for a given
cost matrix (:func:`flashsinkhorn.solve`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from . import _validation as V
from . import limits
from .backends import kernel_costs, resolve_backend, select_path
from .backends.matrix import MatrixBackend, prepare_matrix
from .backends.sides import prepare_sides
from .multiscale import multiscale_applies, multiscale_backend, solve_multiscale
from .options import SinkhornOptions
from .problem import Problem, prepare, stack_sides, stackable
from .result import SinkhornResult
from .solvers import SolveState, dual_value, eps_schedule, estimate_diameter, graphs, solve
from .solvers.annealing import cost_range


def resolve_precision(precision: str, backend_name: str, dtype: torch.dtype) -> str:
    """ "auto" is TF32 (on pre-rounded points) for fp32 Triton solves and exact fp32 otherwise."""
    V.check_choice("precision", precision, V.PRECISIONS)
    if precision != "auto":
        return precision
    return "tf32" if backend_name == "triton" and dtype == torch.float32 else "ieee"


def _problem(x, y, a, b, opts: SinkhornOptions, sq_floor: float):
    """The backend (its path chosen) and the canonical problem of transformed points."""
    spec = opts.cost
    impl = resolve_backend(opts.backend, x.device, x.dtype)
    multiscale = multiscale_applies(x, y, opts)
    # the multiscale path forms distances from exact coordinates (no tensor-core rounding)
    prec = "ieee" if multiscale else resolve_precision(opts.precision, impl.name, x.dtype)
    problem = prepare(
        x, y, a, b, rho_x=opts.rho_x, rho_y=opts.rho_y, precision=prec,
        check_finite=opts.check_finite, cost=spec.kernel_cost,
        labels=spec.labels_for_prepare(), sq_floor=sq_floor,
        sides=prepare_sides(x, y),
    )  # fmt: skip
    if multiscale:
        return multiscale_backend(impl, problem, opts), problem
    return select_path(impl, problem, opts.path), problem


def _path_for(base, problem, opts: SinkhornOptions, like):
    """The backend of another problem of the same solve (the self terms of a divergence):
    multiscale when ``like`` (the first problem's backend) is, else ``select_path``."""
    if like.path == "multiscale":
        return multiscale_backend(base, problem, opts)
    return select_path(base, problem, opts.path)


def _solve(problem, impl, eps_list, opts: SinkhornOptions) -> SinkhornResult:
    """Runs the loop on a prepared problem (options resolved) and wraps the result."""

    def run():
        if impl.path == "multiscale":
            check_multiscale_eps(problem, eps_list[-1])
            st = solve_multiscale(problem, impl, eps_list, opts, problem.diameter)
        else:
            with impl.threads():
                st = solve(problem, impl, eps_list, opts)
        value = dual_value(problem, st.f, st.g, st.eps, impl)
        impl.release()
        return st, value

    # A fixed number of iterations never synchronises: on CUDA the solve and its value may
    # be replayed from a cached graph (solvers/graphs.py).
    key = None
    if opts.tol is None:
        key = graphs.solve_key(problem, impl, eps_list, opts.n_iters, opts.schedule)
    if key is None:
        state, value = run()
    else:
        f, g, value = graphs.run(key, lambda: _tensors(*run()), problem.device)
        n_done = len(eps_list) - 1 + opts.n_iters
        state = SolveState(f, g, eps_list[-1], n_done, False, None)
    return _result(problem, impl, state, value, opts)


def solve_points(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    opts: SinkhornOptions,
    *,
    sq_floor: float = 0.0,
) -> SinkhornResult:
    """Solves the problem of points already mapped by ``costs.transform_points``.

    Args:
        x: (n, d) or (B, n, d) transformed source points.
        y: (m, d) or (B, m, d) transformed target points.
        a: weights of x or None (checked here, with the points' values).
        b: weights of y or None.
        opts: validated options; ``opts.cost`` supplies the kernel cost and the labels.
        sq_floor: floor of the squared distance under the euclidean cost's square root.
    """
    with torch.no_grad():
        impl, problem, opts, eps_list = _admitted(x, y, a, b, opts, sq_floor)
        return _solve(problem, impl, eps_list, opts)


def _admitted(x, y, a, b, opts: SinkhornOptions, sq_floor: float):
    """The backend, the prepared problem (admitted by the range checks for its eps ladder),
    the options with "auto" resolved, and the ladder."""
    impl, problem = _problem(x, y, a, b, opts, sq_floor)
    opts, eps_list = schedule_for(problem, opts, gpu=_streams(impl))
    return impl, limits.admit(problem, eps_list, tol=opts.tol), opts, eps_list


def solve_divergence(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    opts: SinkhornOptions,
) -> tuple[SinkhornResult, SinkhornResult, SinkhornResult]:
    """The three solves of the Sinkhorn divergence: OT(x, y), OT(x, x), OT(y, y).

    One ``prepare`` serves all three (the self terms use the sides of the joint problem, so
    they share its centring, operand scale and eps ladder). The self terms are *self
    problems* of the loop: one potential, one soft-min per iteration (half the work of a
    two-potential solve). When both clouds have the same size and relaxation, OT(x, x) and
    OT(y, y) run as one batch of 2B self problems: one launch per iteration for both.

    Args:
        x, y, a, b: as in :func:`solve_points`.
        opts: validated options. With labels the self terms use (label_x, label_x) and
            (label_y, label_y) with the same label cost W; when W is not symmetric their
            costs are not either, and they are solved as two-potential problems.

    Returns:
        The results of OT(x, y), OT(x, x) and OT(y, y), each with its own problem
        (``problem.X is problem.Y`` for the self terms).
    """
    with torch.no_grad():
        impl, problem, opts, eps_list = _admitted(x, y, a, b, opts, 0.0)
        xy = _solve(problem, impl, eps_list, opts)
        base = resolve_backend(opts.backend, x.device, x.dtype)

        def run(p):
            # each problem gets its own path (a dense-path backend holds that problem's K)
            return _solve(p, _path_for(base, p, opts, impl), eps_list, opts)

        X, Y = problem.X, problem.Y
        if X.lcost is not None and not torch.equal(X.lcost, X.lcost.transpose(0, 1)):
            # An asymmetric label cost makes the self terms' costs asymmetric: their plans are
            # not symmetric and they keep two potentials (each side's lcost is oriented with
            # its own labels first: X holds W, Y holds Wᵀ).
            px = replace(problem, Y=replace(X, lcost=Y.lcost))
            py = replace(problem, X=replace(Y, lcost=X.lcost))
            return xy, run(px), run(py)
        if Y.lcost is not None:
            Y = replace(Y, lcost=X.lcost)  # W = Wᵀ: one object for both orientations
        px = replace(problem, X=X, Y=X)
        py = replace(problem, X=Y, Y=Y)
        if not stackable([X, Y]):
            return xy, run(px), run(py)
        Z = stack_sides([X, Y])
        centre = None if problem.centre is None else problem.centre.repeat(2, 1)
        both = run(Problem(Z, Z, True, problem.precision, centre))
    return xy, *(_part(both, k, p) for k, p in ((0, px), (1, py)))


def _streams(impl) -> bool:
    """The "auto" acceleration weighs an iteration's launches against its kernels by the
    scores per half-step (``SinkhornOptions.resolve``): for a backend that streams them on a
    GPU, and for the multiscale path on any device (its fine iterations are long; Anderson
    mixing needed 63 fine iterations against 103 over-relaxed on 6,000-point 3-D clouds)."""
    return impl.name == "triton" or impl.path == "multiscale"


def check_multiscale_eps(problem: Problem, eps: float) -> None:
    """Refuses the multiscale path at an eps where the soft-min needs the large-eps
    expansion (limits.py): every tile pair would be visited there anyway."""
    if eps >= problem.X.large_eps or eps >= problem.Y.large_eps:
        raise ValueError(
            f"path='multiscale' is for small eps (eps much below diameter²); eps={eps:.3g} is "
            "at the scale of the cost itself, where every tile pair is visited: use "
            "path='auto' or 'streaming'"
        )


def _part(res: SinkhornResult, k: int, problem: Problem) -> SinkhornResult:
    """Problem ``k`` of the two stacked self terms, as a result of its own problem."""
    B = problem.B
    part = slice(k * B, (k + 1) * B)
    sol = res.solution
    err = res._error
    return SinkhornResult(
        problem=problem,
        backend=sol.backend,
        f=sol.f[part],
        g=sol.g[part],
        value=res.value[part],
        eps=res.eps,
        n_iters=res.n_iters,
        converged=res.converged,
        marginal_error=None if err is None else err[part],
        errors=res.errors,
        schedule=res.schedule,
        acceleration=res.acceleration,
    )


def solve_matrix(
    C: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    opts: SinkhornOptions,
) -> SinkhornResult:
    """Solves the problem of a given cost matrix (``backends/matrix.py``) with the same loop.

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
        return _solve(problem, impl, eps_list, opts)


def _result(problem, impl, state: SolveState, value, opts: SinkhornOptions) -> SinkhornResult:
    return SinkhornResult(
        problem=problem,
        backend=impl,
        f=state.f,
        g=state.g,
        value=value,
        eps=state.eps,
        n_iters=state.n_iters,
        converged=state.converged,
        marginal_error=state.marginal_error,
        errors=state.errors,
        # a self problem runs the averaged one-potential iteration (solvers/loop.py)
        schedule="symmetric" if problem.X is problem.Y else opts.schedule,
        acceleration="none" if problem.X is problem.Y else opts.acceleration,
    )


def schedule_for(problem, opts: SinkhornOptions, *, diameter=None, gpu: bool = False):
    """The options with "auto" resolved for this problem, and its eps ladder.

    The cost's range that the rule and the ladder start from is diameter^p (+ the largest
    label cost), p = 2 for the squared Euclidean cost and 1 for the euclidean one; the
    diameter is ``opts.diameter``, else ``diameter``, else the bounding box of both clouds
    (``problem.diameter``, the largest over a batch, read with prepare's value checks).
    ``gpu``: the backend streams the scores on a GPU (the choice of acceleration weighs an
    iteration's launches against its kernels).
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
    work = problem.B * problem.X.n * problem.Y.n if gpu else None
    opts = opts.resolve(scale, work)
    eps_list = eps_schedule(opts.eps, opts.scaling, diameter, power, offset, dtype=problem.dtype)
    return opts, eps_list


def _tensors(state: SolveState, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # what a graphed fixed-iteration solve hands back (the rest of the state is known)
    return state.f, state.g, value
