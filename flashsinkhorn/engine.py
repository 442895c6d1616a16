"""From validated options to a result: build the problem, pick the backend, run the loop.

This is the one place where a solve is assembled. The public functions validate their
arguments into a :class:`~flashsinkhorn.options.SinkhornOptions` and call
:func:`solve_points`; the autograd functions, the Hessian operator and OTDD call it too, so
none of them imports the public layer.
"""

from __future__ import annotations

import math

import torch

from . import _validation as V
from . import limits
from .backends import kernel_costs, resolve_backend, select_path
from .backends.sides import prepare_sides
from .options import SinkhornOptions
from .problem import prepare
from .result import SinkhornResult
from .solvers import SolveState, dual_value, eps_schedule, estimate_diameter, graphs, solve


def resolve_precision(precision: str, backend_name: str, dtype: torch.dtype) -> str:
    """ "auto" is TF32 (on pre-rounded points) for fp32 Triton solves and exact fp32 otherwise."""
    V.check_choice("precision", precision, V.PRECISIONS)
    if precision != "auto":
        return precision
    return "tf32" if backend_name == "triton" and dtype == torch.float32 else "ieee"


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
    spec = opts.cost
    impl = resolve_backend(opts.backend, x.device, x.dtype)
    prec = resolve_precision(opts.precision, impl.name, x.dtype)
    with torch.no_grad():
        problem = prepare(
            x, y, a, b, rho_x=opts.rho_x, rho_y=opts.rho_y, precision=prec,
            check_finite=opts.check_finite, cost=spec.kernel_cost,
            labels=spec.labels_for_prepare(), sq_floor=sq_floor,
            sides=prepare_sides(x, y),
        )  # fmt: skip
        impl = select_path(impl, problem, opts.path)
        opts, eps_list = schedule_for(problem, opts, gpu=impl.name == "triton")
        problem = limits.admit(problem, eps_list, tol=opts.tol)

        def run():
            st = solve(problem, impl, eps_list, opts)
            return st, dual_value(problem, st.f, st.g, st.eps, impl)

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
        schedule=opts.schedule,
        acceleration=opts.acceleration,
    )


def schedule_for(problem, opts: SinkhornOptions, *, diameter=None, gpu: bool = False):
    """The options with "auto" resolved for this problem, and its eps ladder.

    The cost's range that the rule and the ladder start from is diameter^p (+ the largest
    label cost), p = 2 for the squared Euclidean cost and 1 for the euclidean one; the
    diameter is ``opts.diameter``, else ``diameter``, else the bounding box of both clouds.
    ``gpu``: the backend streams the scores on a GPU (the choice of acceleration weighs an
    iteration's launches against its kernels).
    """
    wants_range = opts.scaling == "auto" and opts.tol is not None
    wants_range = wants_range or isinstance(opts.scaling, float)
    diameter = opts.diameter if opts.diameter is not None else diameter
    if wants_range and diameter is None:
        diameter = estimate_diameter(problem.X.x, problem.Y.x)
    power = kernel_costs.power(problem.cost)
    offset = float(problem.X.lcost.max()) if problem.has_labels and wants_range else 0.0
    scale = diameter**power + offset if diameter else None
    if scale is not None and not math.isfinite(scale):
        scale = diameter = None  # non-finite points (check_finite=False): no ladder
    work = problem.B * problem.X.n * problem.Y.n if gpu else None
    opts = opts.resolve(scale, work)
    return opts, eps_schedule(opts.eps, opts.scaling, diameter, power, offset)


def _tensors(state: SolveState, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # what a graphed fixed-iteration solve hands back (the rest of the state is known)
    return state.f, state.g, value
