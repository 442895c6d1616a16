"""The validated options of a solve: built once at the public boundary, read everywhere below.

The public functions (:func:`flashsinkhorn.sinkhorn`, :func:`~flashsinkhorn.ot_cost`,
:func:`~flashsinkhorn.sinkhorn_divergence`, the distributed and OTDD entry points, the Hessian
operator) keep their explicit keyword arguments; each turns them into one
:class:`SinkhornOptions` with :meth:`SinkhornOptions.build`, which checks every value and
raises a ``ValueError`` or ``TypeError`` naming the argument. The engine, the solver loop and
the operators only ever receive that object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace

import torch

from . import _validation as V
from .costs import COST_DEFAULTS, CostSpec, check_cost
from .option_table import OPTIONS, REQUIRED, check_combination, defaults

#: Schur-solve defaults of second derivatives. tau is *relative*: S + tau·diag(b̂), the same
#: damping for any n, m and mass; 1e-5 bounds the condition number of the
#: Jacobi-preconditioned system by about 1e5 (docs/hvp.md).
DEFAULT_TAU = 1e-5
DEFAULT_CG_TOL = 1e-6
DEFAULT_CG_MAX_ITER = 500


@dataclass(frozen=True)
class HVPOptions:
    """Settings of the Schur solve behind a Hessian–vector product.

    Attributes:
        tau: relative damping >= 0 of the Schur complement (0: the exact pseudo-inverse).
        cg_tol: true relative residual at which CG stops.
        cg_max_iter: CG iteration cap.
        cg_check_every: CG iterations between two host-side residual tests.
    """

    tau: float = DEFAULT_TAU
    cg_tol: float = DEFAULT_CG_TOL
    cg_max_iter: int = DEFAULT_CG_MAX_ITER
    cg_check_every: int = 10

    @classmethod
    def build(cls, options: object = None, name: str = "hvp_options", **kw) -> HVPOptions:
        """Validates a dict of settings (``options``) or keyword settings.

        Raises:
            TypeError: ``options`` is not a dict or None; a value of the wrong type.
            ValueError: an unknown key or a value out of range, naming it.
        """
        if options is None:
            options = {}
        if isinstance(options, HVPOptions):
            return options
        if not isinstance(options, dict):
            raise TypeError(
                f"{name} must be a dict with keys among tau, cg_tol, cg_max_iter, "
                f"cg_check_every, or None; got {type(options).__name__}"
            )
        values = {**options, **kw}
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in values:
            if key not in allowed:
                raise ValueError(f"{name}: unknown key {key!r} (allowed: {', '.join(allowed)})")
        out = {f: values.get(f, getattr(cls, f)) for f in allowed}
        return cls(
            tau=V.check_nonnegative("tau", out["tau"]),
            cg_tol=V.check_positive("cg_tol", out["cg_tol"]),
            cg_max_iter=V.check_int("cg_max_iter", out["cg_max_iter"], 1),
            cg_check_every=V.check_int("cg_check_every", out["cg_check_every"], 1),
        )


#: Scores per half-step from which the "auto" acceleration of a GPU solve is Anderson mixing:
#: there an iteration takes about 2 ms on an H100 and hides the ~1 ms of the mixing's small
#: launches (measured: 50k² 3-D clouds 307 ms against 598 ms over-relaxed).
ANDERSON_MIN_WORK = 10**9

#: Solver options and their defaults (the keyword arguments of :func:`flashsinkhorn.sinkhorn`
#: other than ``eps`` and the cost arguments of ``costs.COST_DEFAULTS``), from the option table.
SOLVER_DEFAULTS = defaults("solver")


def _table_fields(cls):
    """The dataclass of ``cls`` with a field per solver option of the table (its type and
    default; ``eps`` first, without one) before the fields ``cls`` declares itself."""
    own = dict(cls.__annotations__)
    cls.__annotations__ = {o.name: o.type for o in OPTIONS if o.group == "solver"}
    cls.__annotations__.update(own)
    for o in OPTIONS:
        if o.group == "solver" and o.default is not REQUIRED:
            setattr(cls, o.name, o.default)
    return dataclass(frozen=True)(cls)


@_table_fields
class SinkhornOptions:
    """Every setting of a solve, validated (see :func:`flashsinkhorn.sinkhorn` for meanings).

    Attributes:
        eps, n_iters, tol, check_every, schedule, acceleration, omega, anderson_memory,
        scaling, diameter, rho_x, rho_y, backend, precision, check_finite, path, progress:
            the solver options of the table (``option_table.OPTIONS``), one field each.
        cost: the validated cost description (:class:`~flashsinkhorn.costs.CostSpec`).
        hvp: Schur-solve settings of second derivatives.
    """

    cost: CostSpec = field(default_factory=CostSpec)
    hvp: HVPOptions = field(default_factory=HVPOptions)

    @classmethod
    def build(
        cls,
        x: torch.Tensor | None = None,
        y: torch.Tensor | None = None,
        *,
        hvp_options: object = None,
        **kw: object,
    ) -> SinkhornOptions:
        """Validates keyword options; the cost arguments are checked against ``x`` and ``y``.

        Args:
            x: source points (already checked by ``_validation.check_points``), needed when
                cost arguments are given; None for options without a cost.
            y: target points, likewise.
            hvp_options: dict of Schur-solve settings (:class:`HVPOptions`), or None.
            **kw: ``eps`` and any key of ``SOLVER_DEFAULTS`` or ``costs.COST_DEFAULTS``.

        Raises:
            TypeError: an unknown keyword, or a value of the wrong type (naming it).
            ValueError: a value out of range (naming it).
        """
        unknown = sorted(set(kw) - set(SOLVER_DEFAULTS) - set(COST_DEFAULTS) - {"eps"})
        if unknown:
            raise TypeError(f"unexpected option(s) {unknown}")
        if "eps" not in kw:
            raise TypeError("eps is required")
        solver = {
            o.name: o.check(kw.get(o.name, o.default)) for o in OPTIONS if o.group == "solver"
        }
        check_combination(solver)
        cost_kw = {k: kw[k] for k in COST_DEFAULTS if k in kw}
        if cost_kw and x is None:
            raise TypeError("cost options need the point clouds to be checked against")
        if x is None or all(_is_default(k, v) for k, v in cost_kw.items()):
            spec = _DEFAULT_COST  # nothing to check against the clouds
        else:
            spec = check_cost(x, y, **cost_kw)
        if solver["path"] == "multiscale" and x is not None:
            from .multiscale.inputs import check_options

            check_options(x, spec.is_default, solver["precision"])
        hvp = HVPOptions.build(hvp_options)
        if hvp_options is not None and (not spec.is_default or solver["path"] == "multiscale"):
            why = "path='multiscale'" if spec.is_default else "this cost"
            raise ValueError(
                "hvp_options sets the Schur solve of second derivatives, which "
                f"{why} does not have (the plain squared Euclidean cost on the streaming or "
                "dense path only); leave hvp_options out"
            )
        return cls(**solver, cost=spec, hvp=hvp)

    def resolve(self, scale: float | None, work: int | None = None) -> SinkhornOptions:
        """The options with every "auto" replaced by a concrete choice for this problem.

        The rule (docs/convergence.md): a fixed number of iterations (``tol=None``) keeps the
        plain symmetric schedule, so that benchmarks measure the same work as always. With a
        tolerance, the alternating schedule, over-relaxed with a factor adapted per problem
        (the fastest to the tolerance of the settings measured on an H100), or mixed by
        Anderson acceleration where one iteration's soft-mins are long enough to hide its
        bookkeeping (``work`` >= ``ANDERSON_MIN_WORK`` scores per half-step: it needs fewer
        iterations, about half as many on large 3-D clouds), and eps annealing only for small
        eps relative to the cost's range ``scale`` (diameter² for the squared Euclidean
        cost): none for eps/scale >= 1e-3, scaling 0.5 down to 1e-5, 0.7 below.

        Args:
            scale: largest cost of the problem (None: unknown, no annealing is chosen).
            work: scores per half-step, B·n·m, of a backend that streams them on a GPU;
                None elsewhere (no Anderson by default).
        """
        if "auto" not in (self.schedule, self.acceleration, self.scaling):
            return self
        fixed = self.tol is None
        schedule = self.schedule
        if schedule == "auto":
            schedule = "symmetric" if fixed else "alternating"
        accel = self.acceleration
        if accel == "auto":
            if fixed or schedule == "symmetric":
                accel = "none"
            elif work is not None and work >= ANDERSON_MIN_WORK:
                accel = "anderson"
            else:
                accel = "overrelax"
        scaling = self.scaling
        if scaling == "auto":
            scaling = None
            if not fixed and scale is not None and scale > 0:
                ratio = self.eps / scale
                if ratio < 1e-5:
                    scaling = 0.7
                elif ratio < 1e-3:
                    scaling = 0.5
        return replace(self, schedule=schedule, acceleration=accel, scaling=scaling)

    def for_self_transport(self) -> SinkhornOptions:
        """The options of a self term OT(a, a) (debiasing, OTDD's class self terms).

        With "auto" schedule and acceleration it runs the symmetric schedule: from zero
        potentials its iterates stay symmetric (f = g), which is the averaged self update, and
        converges in a few iterations, while the alternating schedule breaks the symmetry and
        crawls (more than 20,000 iterations short of 1e-8 on 11 points at eps = 0.1, against
        10 to 1e-15). An explicit choice is kept.
        """
        if self.schedule != "auto" or self.acceleration != "auto":
            return self
        return replace(self, schedule="symmetric", acceleration="none")

    def replace(self, **changes) -> SinkhornOptions:
        """A copy with some fields changed (the new values are trusted: validate first)."""
        return replace(self, **changes)

    def solver_kwargs(self) -> dict:
        """The solver settings as keyword arguments (``SOLVER_DEFAULTS`` keys and ``eps``)."""
        return {"eps": self.eps, **{k: getattr(self, k) for k in SOLVER_DEFAULTS}}


_DEFAULT_COST = CostSpec()


def _is_default(key: str, value: object) -> bool:
    default = COST_DEFAULTS[key]
    if default is None:
        return value is None
    return type(value) is type(default) and value == default


def public_options(scope: dict) -> dict:
    """The option keywords among a public function's arguments (its ``locals()``).

    Public functions spell out their keyword arguments for users and IDEs; this collects them
    for :meth:`SinkhornOptions.build` without writing the list again.
    """
    names = {"eps", *SOLVER_DEFAULTS, *COST_DEFAULTS}
    return {k: v for k, v in scope.items() if k in names}
