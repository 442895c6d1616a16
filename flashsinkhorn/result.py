"""The result object returned by :func:`flashsinkhorn.sinkhorn`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import limits
from ._boundary import entry_point
from ._summary import summary
from ._validation import check_int
from .backends.base import Backend
from .backends.matrix import MATRIX, dense_plan
from .problem import Problem
from .solvers.objective import marginal_error as _marginal_error
from .solvers.objective import marginals as _marginals
from .solvers.objective import nominal_weighted_sum


def balanced_gauge(problem: Problem, f: torch.Tensor, g: torch.Tensor):
    """The potentials of a balanced problem in the returned gauge: ⟨a, f⟩ = ⟨b, g⟩.

    A balanced problem's potentials are defined up to (f + c, g − c); the solver reaches a
    different c per schedule, acceleration and backend (alternating from zero: ⟨a, f⟩ =
    0.1089 against ⟨b, g⟩ = 0.0021 on one problem where the symmetric schedule gave 0.0554 /
    0.0557), so the same call returned other potentials when the size, tolerance or device
    changed the schedule. Shifting by c = (⟨b, g⟩ − ⟨a, f⟩) / (M_a + M_b) (nominal masses)
    fixes one gauge for every path (docs/conventions.md). The plan, the value, transports,
    gradients in x and y and HVPs read f + g only and do not change: they read the solver's
    potentials, and the shift is formed only where the potentials themselves are read
    (``SinkhornResult.f``/``g``, the weight gradients). A relaxed side fixes the constant
    itself; a self problem (one potential) has f = g already. A few device reductions, no
    synchronisation.
    """
    X, Y = problem.X, problem.Y
    if X is Y or X.rho is not None or Y.rho is not None:
        return f, g
    sa, sb = nominal_weighted_sum(X, f), nominal_weighted_sum(Y, g)
    c = ((sb - sa) / (X.nominal_mass + Y.nominal_mass))[:, None]
    return f + c, g - c


@dataclass(frozen=True)
class Solution:
    """What the operators built on a solve read from it (autograd, Hessian, OTDD).

    This is the library's internal interface to a result: the canonical problem, the backend
    that solved it and the potentials in batched form, so that gradients and transports
    apply the plan actually computed.

    Attributes:
        problem: the canonical (centred, batched) problem.
        backend: the backend of the solve (its path included).
        f: (B, n) potential of x, as the solver left it (any additive gauge for a balanced
            problem; everything read from the plan is gauge free).
        g: (B, m) potential of y.
        eps: the final eps.
    """

    problem: Problem
    backend: Backend
    f: torch.Tensor
    g: torch.Tensor
    eps: float


@dataclass(frozen=True)
class Route:
    """What every "auto" of a solve resolved to, decided once by the engine.

    Attributes:
        backend: the backend's label ("torch" or "triton").
        path: how the soft-mins read the cost: "streaming", "dense", "matrix" or
            "multiscale".
        strategy: "plain" (the loop on the points) or "multiscale" (coarse solve, lift,
            block-sparse fine loop).
        precision: the dot-product precision, "ieee", "tf32" or "tf32x3".
        schedule: "symmetric" or "alternating".
        acceleration: "none", "overrelax" or "anderson".
    """

    backend: str
    path: str
    strategy: str
    precision: str
    schedule: str
    acceleration: str


class SinkhornResult:
    """Potentials of an entropic OT solve and what derives from them.

    Conventions (docs/conventions.md): cost C_ij = ‖x_i − y_j‖² (or the given matrix of
    :func:`flashsinkhorn.solve`), plan P_ij = a_i b_j exp((f_i + g_j − C_ij) / eps).

    Attributes:
        f: (n,) or (B, n) potential of x; for a balanced problem in the gauge
            ⟨a, f⟩ = ⟨b, g⟩, whatever path ran (docs/conventions.md).
        g: (m,) or (B, m) potential of y.
        value: () or (B,) OT_eps, the dual objective at (f, g).
        eps: the final (target) eps.
        n_iters: iterations performed, annealing included: ``n_annealing`` iterations of the
            eps ladder, then at most the ``n_iters`` argument's iterations at the target eps
            (``n_iters=5, scaling=0.5`` at eps = 1e-3 on unit-square clouds reports 12: 7 + 5).
        n_annealing: iterations of the annealing ladder (0 without annealing); the
            iterations at the target eps are ``n_iters - n_annealing``.
        converged: True when the marginal-error test passed; always False with ``tol=None``.
        errors: error history, (iteration, worst marginal error over the batch) at each
            convergence test (every ``check_every`` iterations at the target eps; iteration
            counts as ``n_iters`` does; empty with ``tol=None``). Plot it with
            ``plt.semilogy(*zip(*result.errors))``.
        backend: name of the backend that ran ("torch" or "triton").
        path: "streaming" (cost tiles recomputed on chip), "dense" (stored scores) or
            "matrix" (the given cost matrix of :func:`flashsinkhorn.solve`).
        precision: dot-product precision used ("ieee", "tf32", "tf32x3").
        schedule: the schedule that ran, "symmetric" or "alternating" ("auto" resolved).
        acceleration: the acceleration that ran: "none", "overrelax" or "anderson".
        route: the `Route` of the solve (backend, path, strategy, precision,
            schedule, acceleration: what every "auto" resolved to).
        solution: the :class:`Solution` (batched potentials, problem, backend) that
            gradients and transport operators read.

    Everything read off the plan (``marginal_error`` when the convergence test did not give
    it, :meth:`marginals`, :meth:`apply`, :meth:`apply_T`, :meth:`barycentric_map`,
    :meth:`plan`) raises ``ValueError`` when eps is below the resolution of the potentials'
    dtype, about 1.2e-5·diameter² in float32 (docs/precision.md); f, g and value stay valid.
    """

    def __init__(
        self,
        *,
        problem: Problem,
        backend: Backend,
        f: torch.Tensor,
        g: torch.Tensor,
        value: torch.Tensor,
        eps: float,
        n_iters: int,
        converged: bool,
        marginal_error: torch.Tensor | None,
        errors: list[tuple[int, float]],
        route: Route,
        n_annealing: int = 0,
    ):
        self.solution = Solution(problem, backend, f, g, eps)
        self._error = marginal_error
        self._gauged: tuple[torch.Tensor, torch.Tensor] | None = None
        self.value = problem.unbatch(value)
        self.eps = eps
        self.n_iters = n_iters
        self.n_annealing = n_annealing
        self.converged = converged
        self.errors = errors
        self.route = route
        self.backend = route.backend
        self.path = route.path
        self.precision = route.precision
        self.schedule = route.schedule
        self.acceleration = route.acceleration

    def balanced_potentials(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, n), (B, m) potentials in the returned gauge (:func:`balanced_gauge`), formed on
        first use: the solve itself, its value, transports and HVPs read f + g only, so the
        default path pays nothing for the gauge."""
        if self._gauged is None:
            sol = self.solution
            self._gauged = balanced_gauge(sol.problem, sol.f, sol.g)
        return self._gauged

    @property
    def f(self) -> torch.Tensor:
        """(n,) or (B, n) potential of x (balanced: in the gauge ⟨a, f⟩ = ⟨b, g⟩)."""
        return self.solution.problem.unbatch(self.balanced_potentials()[0])

    @property
    def g(self) -> torch.Tensor:
        """(m,) or (B, m) potential of y (balanced: in the gauge ⟨a, f⟩ = ⟨b, g⟩)."""
        return self.solution.problem.unbatch(self.balanced_potentials()[1])

    @property
    @entry_point
    def marginal_error(self) -> torch.Tensor:
        """() or (B,) ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ of the returned plan.

        Known from the convergence test when it passed; otherwise computed on first access (one
        streaming pass per side).
        """
        if self._error is None:
            self._check_plan("the marginal error")
            with torch.no_grad():
                self._error = _marginal_error(
                    self.solution.problem,
                    self.solution.backend,
                    self.solution.f,
                    self.solution.g,
                    self.eps,
                )
        return self.solution.problem.unbatch(self._error)

    @entry_point
    def marginals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column marginals (P1, Pᵀ1) of the plan, shapes like ``f`` and ``g``.

        Raises:
            ValueError: eps below the resolution of the potentials' dtype (docs/precision.md).
        """
        self._check_plan("marginals")
        with torch.no_grad():
            ra, rb = _marginals(
                self.solution.problem,
                self.solution.backend,
                self.solution.f,
                self.solution.g,
                self.eps,
            )
        return self.solution.problem.unbatch(ra), self.solution.problem.unbatch(rb)

    def _check_plan(self, what: str) -> None:
        limits.check_plan(self.solution.problem, self.eps, what)

    # ----- transport operators (streaming; no n × m tensor except in plan()) -----

    def _values(self, name: str, V: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
        """Validates values for apply/apply_T; returns them as (B, n, p) and a vector flag."""
        problem = self.solution.problem
        if not isinstance(V, torch.Tensor) or not V.is_floating_point():
            raise TypeError(f"{name} must be a real floating torch.Tensor, got {type(V).__name__}")
        if V.device != problem.device:
            raise ValueError(f"{name} must be on {problem.device}, got {V.device}")
        base = 1 if problem.batched else 0
        vector = V.dim() == base + 1
        W = V.unsqueeze(-1) if vector else V
        ok = W.dim() == base + 2 and W.shape[base] == n
        ok = ok and (not problem.batched or W.shape[0] == problem.B)
        if not ok:
            lead = f"({problem.B}, {n}" if problem.batched else f"({n}"
            raise ValueError(f"{name} must have shape {lead}, p) or {lead},), got {tuple(V.shape)}")
        W = W if problem.batched else W.unsqueeze(0)
        return W.to(problem.dtype), vector

    def _finish(self, out: torch.Tensor, vector: bool) -> torch.Tensor:
        out = self.solution.problem.unbatch(out)
        return out[..., 0] if vector else out

    @entry_point
    def apply(self, V: torch.Tensor) -> torch.Tensor:
        """P @ V in one streaming pass (V of any width; the plan is never formed).

        Args:
            V: (m, p) or (m,) values on y; batched (B, m, p) or (B, m).

        Returns:
            (n, p) or (n,) (batched: (B, n, p) or (B, n)), potential dtype. Not differentiable.
        """
        problem = self.solution.problem
        W, vector = self._values("V", V, problem.Y.n)
        self._check_plan("apply()")
        with torch.no_grad():
            out, _ = self.solution.backend.transport(
                problem.X,
                problem.Y,
                self.solution.f,
                self.solution.g,
                self.eps,
                W,
                None,
                None,
                problem.precision,
            )
        return self._finish(out, vector)

    @entry_point
    def apply_T(self, U: torch.Tensor) -> torch.Tensor:
        """Pᵀ @ U in one streaming pass.

        Args:
            U: (n, p) or (n,) values on x; batched (B, n, p) or (B, n).

        Returns:
            (m, p) or (m,) (batched: (B, m, p) or (B, m)), potential dtype. Not differentiable.
        """
        problem = self.solution.problem
        W, vector = self._values("U", U, problem.X.n)
        self._check_plan("apply_T()")
        with torch.no_grad():
            out, _ = self.solution.backend.transport(
                problem.Y,
                problem.X,
                self.solution.g,
                self.solution.f,
                self.eps,
                W,
                None,
                None,
                problem.precision,
            )
        return self._finish(out, vector)

    @entry_point
    def barycentric_map(self) -> torch.Tensor:
        """Entropic barycentric projection T(x_i) = (P y)_i / â_i, with â = P 1.

        Computed in the centred frame of the solve and returned in the caller's coordinates.
        With ``cost="cosine"``, a ``feature_map`` or a ``feature_weight`` the map is of the
        transformed points (the space in which the cost is (squared) Euclidean).
        A point with zero induced mass (zero weight) maps to itself.

        Returns:
            (n, d) or (B, n, d), potential dtype.

        Raises:
            ValueError: for a cost-matrix solve (:func:`flashsinkhorn.solve`), which has no
                points; ``apply(V)`` maps any values V of the columns.
        """
        problem = self.solution.problem
        X, Y = problem.X, problem.Y
        if problem.cost == MATRIX:
            raise ValueError(
                "barycentric_map() needs point clouds; a cost-matrix solve has none: use "
                "apply(V) / marginals()[0] with the values V of its columns"
            )
        self._check_plan("barycentric_map()")
        with torch.no_grad():
            py, marg = self.solution.backend.transport(
                X, Y, self.solution.f, self.solution.g, self.eps, Y.x, None, None, problem.precision
            )
            xc = X.x.to(problem.dtype)
            safe = torch.where(marg > 0, marg, torch.ones_like(marg))
            T = torch.where((marg > 0)[..., None], py / safe[..., None], xc)
            if problem.centre is not None:
                T = T + problem.centre[:, None, :]
        return problem.unbatch(T)

    @entry_point
    def plan(self, max_elements: int = 1 << 26) -> torch.Tensor:
        """The dense plan P_ij = a_i b_j exp((f_i + g_j − C_ij) / eps).

        C_ij is the solve's cost (‖x_i − y_j‖² by default; see ``cost=`` and the label term;
        the given matrix of :func:`flashsinkhorn.solve`).

        Args:
            max_elements: refuse when B·n·m exceeds this (default 2^26, 256 MiB in fp32).

        Returns:
            (n, m) or (B, n, m), potential dtype.

        Raises:
            ValueError: above ``max_elements``; use :meth:`apply` / :meth:`apply_T` instead;
                eps below the resolution of the potentials' dtype (docs/precision.md).
        """
        max_elements = check_int("max_elements", max_elements, 1)
        problem = self.solution.problem
        X, Y = problem.X, problem.Y
        size = problem.B * X.n * Y.n
        if size > max_elements:
            raise ValueError(
                f"plan() would materialise B·n·m = {size:,} elements (> max_elements="
                f"{max_elements:,}); use apply()/apply_T() (streaming) or raise max_elements"
            )
        self._check_plan("plan()")
        with torch.no_grad():
            if problem.cost == MATRIX:
                return problem.unbatch(dense_plan(problem, self.solution.f, self.solution.g,
                                                  self.eps))  # fmt: skip
            if problem.default_cost:
                x, y = X.x.to(problem.dtype), Y.x.to(problem.dtype)
                C = X.sq[:, :, None] + Y.sq[:, None, :] - 2.0 * torch.bmm(x, y.transpose(1, 2))
            else:
                from .backends.torch_ref import cost_block

                C = cost_block(X, slice(None), Y, problem.dtype)
            logp = (self.solution.f[:, :, None] + self.solution.g[:, None, :] - C) / self.eps
            P = torch.exp(logp + X.logw[:, :, None] + Y.logw[:, None, :])
        return problem.unbatch(P)

    def __repr__(self) -> str:
        # only what is already known: printing never launches a pass over the plan
        return summary(self)
