"""Functional API: validate, build the canonical problem, pick a backend, run the solver."""

from __future__ import annotations

import torch

from . import _validation as V
from .backends import resolve_backend, select_path
from .costs import CostSpec, check_cost, transform_points
from .problem import prepare
from .result import SinkhornResult
from .solvers import SolveState, dual_value, eps_schedule, estimate_diameter, graphs, solve


def resolve_precision(precision: str, backend_name: str, dtype: torch.dtype) -> str:
    """ "auto" is TF32 (on pre-rounded points) for fp32 Triton solves and exact fp32 otherwise."""
    V.check_choice("precision", precision, V.PRECISIONS)
    if precision != "auto":
        return precision
    return "tf32" if backend_name == "triton" and dtype == torch.float32 else "ieee"


def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    n_iters: int = 1000,
    tol: float | None = 1e-3,
    check_every: int = 10,
    schedule: str = "symmetric",
    scaling: float | None = None,
    diameter: float | None = None,
    rho_x: float | None = None,
    rho_y: float | None = None,
    backend: str = "auto",
    precision: str = "auto",
    check_finite: bool = True,
    path: str = "auto",
    cost: str = "sqeuclidean",
    feature_map: torch.Tensor | None = None,
    label_x: torch.Tensor | None = None,
    label_y: torch.Tensor | None = None,
    label_cost: torch.Tensor | None = None,
    feature_weight: float = 1.0,
    label_weight: float = 1.0,
) -> SinkhornResult:
    """Entropic optimal transport between two point clouds, cost C_ij = ‖x_i − y_j‖² by default.

    Solves min_P <C, P> + eps KL(P | a⊗b) (plus rho KL terms on relaxed marginals) in the log
    domain with streaming soft-min updates; the n × m cost is never stored on the Triton path.

    Args:
        x: (n, d) or (B, n, d) source points; float16/bfloat16/float32/float64.
        y: (m, d) or (B, m, d) target points, same dtype and device as ``x``.
        a: weights of ``x``, (n,) or (B, n), non-negative; default uniform 1/n.
        b: weights of ``y``, (m,) or (B, m); default uniform 1/m.
        eps: entropic regularisation, > 0, in units of the cost (squared distance).
        n_iters: iterations at the target eps (the maximum when ``tol`` is set). Default 1000.
        tol: stop when ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ <= tol for every problem of the batch; None
            runs exactly ``n_iters`` iterations (benchmark mode). Default 1e-3.
        check_every: iterations between two convergence tests (the only host
            synchronisations of the loop). Default 10.
        schedule: "symmetric" (averaged Jacobi updates, one fused launch per iteration) or
            "alternating" (Gauss–Seidel). Default "symmetric".
        scaling: None keeps eps fixed; a value in (0, 1) first anneals eps from
            ``diameter²`` down to ``eps``, dividing it by ``scaling²`` each iteration.
        diameter: largest distance between points, for annealing; estimated from the
            bounding box of both clouds when None.
        rho_x: KL relaxation strength of the x marginal (unbalanced OT); None is a hard
            constraint.
        rho_y: the same for the y marginal; one of the two alone gives semi-unbalanced OT.
        backend: "auto" (Triton for CUDA tensors, torch otherwise), "torch" or "triton".
        precision: dot-product precision of the kernels: "ieee" (exact fp32), "tf32" (points
            rounded to TF32, then exact products: a 2^-11 relative perturbation of the
            centred coordinates), "tf32x3" (fp32-accurate: float16 hi/lo parts of the
            points, three exact tensor-core products per score), or "auto"
            ("tf32" for fp32 Triton solves, "ieee" otherwise).
        check_finite: check the inputs for NaN/inf (one synchronisation). Default True.
        path: how the Triton backend reads the cost: "streaming" (x·yᵀ tiles recomputed
            each half-step, O((n + m) d) memory), "dense" (K = x yᵀ built once, then only
            streamed: faster at large d, O(B n m) memory) or "auto" (dense for d >= 256 when
            K fits in memory). ``result.path`` says which ran. Non-default costs and labels
            use the streaming kernels only (``path="dense"`` is then a ValueError).
        cost: ground cost c(x, y): "sqeuclidean" (‖x − y‖², default), "euclidean"
            (‖x − y‖) or "cosine" (1 − cos(x, y); a zero vector is mapped to the origin, so
            its cost to any point is feature_weight/2). ``eps`` is in units of this cost.
            See docs/costs.md.
        feature_map: linear map applied to the features of both clouds before the cost: a
            (k, d) matrix L (x ↦ L x) or a (d,) diagonal (for "sqeuclidean" the Mahalanobis
            cost with M = LᵀL). Default None.
        label_x: (n,) or (B, n) integer labels of ``x`` in [0, V) (OTDD label-augmented
            cost); give ``label_y`` and ``label_cost`` with it. Default None.
        label_y: (m,) or (B, m) integer labels of ``y`` in [0, V). Default None.
        label_cost: (V, V) non-negative finite label-to-label cost W. The cost becomes
            ``feature_weight · c(x_i, y_j) + label_weight · W[label_x_i, label_y_j]``.
        feature_weight: factor >= 0 of the feature cost. Default 1.
        label_weight: factor >= 0 of the label term. Default 1.

    Returns:
        A :class:`SinkhornResult` with potentials ``f``, ``g``, ``value``, ``n_iters``,
        ``converged``, ``marginal_error``. Potentials are not differentiable; use
        :func:`flashsinkhorn.ot_cost` for gradients.

    Raises:
        ValueError, TypeError: for invalid arguments, naming the argument.
    """
    eps = V.check_positive("eps", eps)
    n_iters = V.check_int("n_iters", n_iters, 1)
    tol = V.check_positive("tol", tol, allow_none=True)
    check_every = V.check_int("check_every", check_every, 1)
    V.check_choice("schedule", schedule, V.SCHEDULES)
    scaling = V.check_scaling(scaling)
    diameter = V.check_positive("diameter", diameter, allow_none=True)
    rho_x = V.check_positive("rho_x", rho_x, allow_none=True)
    rho_y = V.check_positive("rho_y", rho_y, allow_none=True)
    V.check_choice("backend", backend, V.BACKENDS)
    V.check_choice("precision", precision, V.PRECISIONS)
    V.check_choice("path", path, V.PATHS)
    V.check_points("x", x)
    V.check_points("y", y)
    V.check_pair(x, y)
    spec = check_cost(
        x, y, cost=cost, feature_map=feature_map, label_x=label_x, label_y=label_y,
        label_cost=label_cost, feature_weight=feature_weight, label_weight=label_weight,
    )  # fmt: skip
    with torch.no_grad():
        x, y = transform_points(x, spec), transform_points(y, spec)
    return solve_points(
        x, y, a, b, spec, eps=eps, n_iters=n_iters, tol=tol, check_every=check_every,
        schedule=schedule, scaling=scaling, diameter=diameter, rho_x=rho_x, rho_y=rho_y,
        backend=backend, precision=precision, check_finite=check_finite, path=path,
    )  # fmt: skip


def solve_points(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    spec: CostSpec,
    *,
    eps: float,
    n_iters: int,
    tol: float | None,
    check_every: int,
    schedule: str,
    scaling: float | None,
    diameter: float | None,
    rho_x: float | None,
    rho_y: float | None,
    backend: str,
    precision: str,
    check_finite: bool,
    path: str,
    sq_floor: float = 0.0,
) -> SinkhornResult:
    """:func:`sinkhorn` on points already mapped by ``costs.transform_points`` (arguments
    already validated): the kernel cost and labels of ``spec`` go into the problem."""
    impl = resolve_backend(backend, x.device, x.dtype)
    prec = resolve_precision(precision, impl.name, x.dtype)
    with torch.no_grad():
        problem = prepare(
            x, y, a, b, rho_x=rho_x, rho_y=rho_y, precision=prec, check_finite=check_finite,
            cost=spec.kernel_cost, labels=spec.labels_for_prepare(), sq_floor=sq_floor,
        )  # fmt: skip
        impl = select_path(impl, problem, path)
        if scaling is not None and diameter is None:
            diameter = estimate_diameter(problem.X.x, problem.Y.x)
        power = 1 if problem.cost == "euclidean" else 2
        offset = 0.0
        if problem.has_labels and scaling is not None:
            offset = float(problem.X.lcost.max())
        eps_list = eps_schedule(eps, scaling, diameter, power, offset)

        def run():
            st = solve(problem, impl, eps_list=eps_list, n_iters=n_iters, tol=tol,
                       check_every=check_every, schedule=schedule)  # fmt: skip
            return st, dual_value(problem, st.f, st.g, st.eps, impl)

        # A fixed number of iterations never synchronises: on CUDA the solve and its value may
        # be replayed from a cached graph (solvers/graphs.py).
        key = None
        if tol is None:
            key = graphs.solve_key(problem, impl, eps_list, n_iters, schedule)
        if key is None:
            state, value = run()
        else:
            f, g, value = graphs.run(key, lambda: _tensors(*run()), problem.device)
            state = SolveState(f, g, eps_list[-1], len(eps_list) - 1 + n_iters, False, None)
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
        schedule=schedule,
    )


def _tensors(state: SolveState, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # what a graphed fixed-iteration solve hands back (the rest of the state is known)
    return state.f, state.g, value
