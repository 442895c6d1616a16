"""The one table of solve options: name, type, default, check and docstring of each.

Every public entry point spells its keyword arguments out (for users, IDEs and
``inspect.signature``); this table is what they are checked against. From it come the fields
and defaults of :class:`~flashsinkhorn.options.SinkhornOptions`, the validation in
:meth:`~flashsinkhorn.options.SinkhornOptions.build`, the defaults of the cost arguments
(``costs.COST_DEFAULTS``) and the shared ``Args`` text of the public docstrings
(:func:`document_options`). ``tests/test_option_table.py`` compares every public signature
and docstring with it.

An option whose value does nothing in a combination (``omega`` without over-relaxation, a
``check_every`` without a convergence test, …) is refused by :func:`check_combination`, never
silently ignored.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from . import _validation as V

#: Marks an option without a default (``eps``).
REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Option:
    """One keyword argument of the solves.

    Attributes:
        name: the keyword.
        type: its annotation, as written in the public signatures.
        default: its default (:data:`REQUIRED` for none).
        check: value -> validated value, raising a ValueError/TypeError naming the option;
            None for the cost options, checked together against the clouds
            (``costs.check_cost``), and ``hvp_options`` (``options.HVPOptions.build``).
        doc: the ``Args`` entry of the public docstrings (without the name).
        group: "solver", "cost" or "hvp".
    """

    name: str
    type: str
    default: object
    check: Callable[[object], object] | None
    doc: str
    group: str = "solver"


def _positive(name: str, allow_none: bool = False) -> Callable[[object], object]:
    return lambda v: V.check_positive(name, v, allow_none=allow_none)


def _int(name: str, minimum: int) -> Callable[[object], int]:
    return lambda v: V.check_int(name, v, minimum)


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[object], str]:
    return lambda v: V.check_choice(name, v, choices)


def check_omega(omega: object) -> float | None:
    """A fixed over-relaxation factor in (0, 2), or None (adaptive)."""
    if omega is None:
        return None
    w = V.check_positive("omega", omega)
    if w >= 2.0:
        raise ValueError(f"omega must be in (0, 2) or None (adaptive), got {w}")
    return w


OPTIONS: tuple[Option, ...] = (
    Option("eps", "float", REQUIRED, _positive("eps"),
           "entropic regularisation, > 0, in units of the cost (squared distance by "
           "default)."),
    Option("n_iters", "int", 1000, _int("n_iters", 1),
           "iterations at the target eps (the maximum when ``tol`` is set). Default 1000."),
    Option("tol", "float | None", 1e-3, _positive("tol", allow_none=True),
           "stop when ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ <= tol for every problem of the batch; None "
           "runs exactly ``n_iters`` iterations (benchmark mode). Default 1e-3."),
    Option("check_every", "int", 10, _int("check_every", 1),
           "iterations between two convergence tests (the only host synchronisations of "
           "the loop); needs ``tol``. Default 10."),
    Option("schedule", "str", "auto", _choice("schedule", V.SCHEDULES),
           '"auto" (default), "symmetric" (averaged Jacobi updates, one fused launch per '
           'iteration) or "alternating" (Gauss–Seidel). "auto" is "alternating" when ``tol`` '
           'is set and "symmetric" for a fixed number of iterations (docs/convergence.md).'),
    Option("acceleration", "str", "auto", _choice("acceleration", V.ACCELERATIONS),
           '"auto" (default), "none", "overrelax" (f ← (1 − ω) f + ω T(g), ω from '
           '``omega``) or "anderson" (Anderson mixing of the potentials, with a safeguard '
           'that takes the plain step when a mixed iterate raises the error). "auto" is '
           '"overrelax" for the alternating schedule with a tolerance ("anderson" for GPU '
           'solves of at least 1e9 scores per half-step) and "none" otherwise.'),
    Option("omega", "float | None", None, check_omega,
           'over-relaxation factor in (0, 2), only with ``acceleration="overrelax"``; None '
           "(default) estimates it per problem from the observed error decay."),
    Option("anderson_memory", "int", 5, _int("anderson_memory", 1),
           'past iterates mixed by Anderson acceleration (>= 1); a value other than the '
           'default needs ``acceleration="anderson"``. Default 5.'),
    Option("scaling", "float | str | None", "auto",
           lambda v: V.check_scaling(v, allow_auto=True),
           '"auto" (default), None or a value in (0, 1). A value first anneals eps from '
           "``diameter²`` down to ``eps``, dividing it by ``scaling²`` each iteration; None "
           'keeps eps fixed; "auto" anneals (0.5, or 0.7 below eps/diameter² = 1e-5) only '
           "when ``tol`` is set and eps/diameter² < 1e-3."),
    Option("diameter", "float | None", None, _positive("diameter", allow_none=True),
           "largest distance between points, where the annealing starts; estimated from "
           "the bounding box of both clouds when None (default). Refused where no "
           'annealing reads it (``scaling=None``, or "auto" with ``tol=None``).'),
    Option("rho_x", "float | None", None, _positive("rho_x", allow_none=True),
           "KL relaxation strength of the x marginal (unbalanced OT); None (default) is a "
           "hard constraint."),
    Option("rho_y", "float | None", None, _positive("rho_y", allow_none=True),
           "the same for the y marginal; one of the two alone gives semi-unbalanced OT."),
    Option("backend", "str", "auto", _choice("backend", V.BACKENDS),
           '"auto" (default: Triton for CUDA tensors, torch otherwise), "torch" or '
           '"triton". On CPU tensors "auto" stores the stabilised kernel exp((f + g − C)/eps) '
           "once per eps and iterates matrix–vector products where it fits 1 GiB "
           '(``result.path == "kernel"``, docs/cpu.md); "torch" is the log-domain soft-min.'),
    Option("precision", "str", "auto", _choice("precision", V.PRECISIONS),
           'dot-product precision of the kernels: "ieee" (exact fp32), "tf32" (points '
           "rounded to TF32, then exact products: a 2^-11 relative perturbation of the "
           'centred coordinates), "tf32x3" (fp32-accurate: float16 hi/lo parts of the '
           'points, three exact tensor-core products per score), or "auto" (default; '
           '"tf32" for fp32 Triton solves, "ieee" otherwise).'),
    Option("check_finite", "bool", True, lambda v: V.check_bool("check_finite", v),
           "check the inputs for NaN/inf (one synchronisation). Default True."),
    Option("path", "str", "auto", _choice("path", V.PATHS),
           'how the Triton backend reads the cost: "streaming" (x·yᵀ tiles recomputed each '
           'half-step, O((n + m) d) memory), "dense" (K = x yᵀ built once, then only '
           'streamed: faster at large d, O(B n m) memory) or "auto" (default: dense for '
           'd >= 256 when K fits in memory; "multiscale" for d <= 3, B·n·m >= 1e10 and '
           "eps <= 1e-3·diameter² with a tolerance). ``result.path`` says which ran. "
           "Non-default costs and labels use the streaming kernels only (``path=\"dense\"`` "
           'is then a ValueError). "multiscale" (any backend, d <= 3, float32/float64, the '
           "plain squared Euclidean cost): Morton clustering, a coarse annealed solve on cell "
           "centroids and block-sparse fine soft-mins that skip tile pairs whose bound of the "
           "plan's mass is negligible; ``marginal_error`` is then an upper bound of the "
           "untruncated plan's error (docs/multiscale.md)."),
    Option("progress", "bool | Callable[[int, float], object] | None", None, V.check_progress,
           "None (default), True or a callable. True shows a progress bar on stderr (``tqdm`` "
           "when installed, else a line a second) with the marginal error at each convergence "
           "test; a callable is called there as ``progress(iteration, error)`` (``iteration`` "
           "counts annealing steps, as ``result.errors`` does; ``error`` is the worst over a "
           "batch). Needs ``tol`` (a ValueError with ``tol=None``)."),
    Option("hvp_options", "dict | None", None, None,
           "Schur-solve settings of second derivatives (``create_graph=True``, then grad "
           "again): keys ``tau``, ``cg_tol``, ``cg_max_iter``, ``cg_check_every`` (defaults "
           "1e-5, 1e-6, 500, 10; docs/hvp.md). Default None.", "hvp"),
    Option("cost", "str", "sqeuclidean", None,
           'ground cost c(x, y): "sqeuclidean" (‖x − y‖², default), "euclidean" (‖x − y‖) '
           'or "cosine" (1 − cos(x, y); a zero vector is mapped to the origin, so its cost '
           "to any point is feature_weight/2). ``eps`` is in units of this cost "
           "(docs/costs.md).", "cost"),
    Option("feature_map", "torch.Tensor | None", None, None,
           "linear map applied to the features of both clouds before the cost: a (k, d) "
           'matrix L (x ↦ L x) or a (d,) diagonal (for "sqeuclidean" the Mahalanobis cost '
           "with M = LᵀL). Default None.", "cost"),
    Option("label_x", "torch.Tensor | None", None, None,
           "(n,) or (B, n) integer labels of x in [0, V) (OTDD label-augmented cost); give "
           "``label_y`` and ``label_cost`` with it. Default None.", "cost"),
    Option("label_y", "torch.Tensor | None", None, None,
           "(m,) or (B, m) integer labels of y in [0, V). Default None.", "cost"),
    Option("label_cost", "torch.Tensor | None", None, None,
           "(V, V) non-negative finite label-to-label cost W; the cost becomes "
           "``feature_weight · c(x_i, y_j) + label_weight · W[label_x_i, label_y_j]``. "
           "Default None.", "cost"),
    Option("feature_weight", "float", 1.0, None,
           "factor >= 0 of the feature cost. Default 1.", "cost"),
    Option("label_weight", "float", 1.0, None,
           "factor >= 0 of the label term. Default 1.", "cost"),
)  # fmt: skip

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def defaults(group: str) -> dict[str, object]:
    """{name: default} of the options of one group ("solver" without ``eps``, "cost")."""
    return {o.name: o.default for o in OPTIONS if o.group == group and o.default is not REQUIRED}


def may_anneal(scaling: object, tol: object) -> bool:
    """Whether a solve with these (validated) ``scaling`` and ``tol`` can anneal eps, so that
    a ``diameter`` is read: a factor, or "auto" with a tolerance."""
    return scaling is not None and not (scaling == "auto" and tol is None)


def check_combination(values: dict[str, object]) -> None:
    """Refuses option values that would do nothing together with the others.

    Args:
        values: validated solver options by name (every key of the "solver" group).

    Raises:
        ValueError: naming the option that has no effect and what it needs.
    """
    acc = values["acceleration"]
    if values["omega"] is not None and acc != "overrelax":
        raise ValueError(
            f"omega={values['omega']} is the factor of acceleration='overrelax' and does "
            f"nothing with acceleration={acc!r}; pass acceleration='overrelax' with it, or "
            "omega=None"
        )
    if values["anderson_memory"] != BY_NAME["anderson_memory"].default and acc != "anderson":
        raise ValueError(
            f"anderson_memory={values['anderson_memory']} is read by Anderson mixing only and "
            f"does nothing with acceleration={acc!r}; pass acceleration='anderson' with it"
        )
    if values["tol"] is None and values["check_every"] != BY_NAME["check_every"].default:
        raise ValueError(
            f"check_every={values['check_every']} spaces the convergence tests, and tol=None "
            "runs none (exactly n_iters iterations); pass a tol, or leave check_every out"
        )
    if values["tol"] is None and values["progress"] is not None:
        raise ValueError(
            "progress reports the marginal error at each convergence test, and tol=None runs "
            "without tests: give a tolerance (e.g. tol=1e-6) or leave progress=None"
        )
    scaling = values["scaling"]
    if values["diameter"] is not None and not may_anneal(scaling, values["tol"]):
        why = "scaling=None" if scaling is None else "scaling='auto' with tol=None"
        raise ValueError(
            f"diameter={values['diameter']} is where eps annealing starts, and {why} anneals "
            "nothing; pass a scaling (or 'auto' with a tol), or leave diameter out"
        )


def document_options(**own: str) -> Callable:
    """Decorator: fills the line ``{options}`` of a public docstring's ``Args`` with the
    table's entries for the function's option parameters that its docstring does not
    document itself; ``own`` replaces an entry's text for this function.

    The entries are indented like the ``{options}`` line and wrapped at 92 columns.
    """

    def wrap(fn: Callable) -> Callable:
        doc = fn.__doc__ or ""
        lines = doc.splitlines()
        at = [i for i, line in enumerate(lines) if line.strip() == "{options}"]
        if len(at) != 1:
            raise RuntimeError(f"{fn.__qualname__}: its docstring needs one '{{options}}' line")
        indent = lines[at[0]][: len(lines[at[0]]) - len(lines[at[0]].lstrip())]
        written = {line.strip().split(":", 1)[0] for line in lines if ":" in line}
        params = inspect.signature(fn).parameters
        entries = []
        for name in params:
            if name not in BY_NAME or name in written:
                continue
            text = own.get(name, BY_NAME[name].doc)
            entries += textwrap.wrap(
                f"{name}: {text}", 92, initial_indent=indent, subsequent_indent=indent + "    ",
                break_on_hyphens=False,
            )  # fmt: skip
        fn.__doc__ = "\n".join(lines[: at[0]] + entries + lines[at[0] + 1 :])
        return fn

    return wrap


def option_parameters(fn: Callable) -> dict[str, inspect.Parameter]:
    """The parameters of ``fn`` that are options of the table, by name."""
    return {k: p for k, p in inspect.signature(fn).parameters.items() if k in BY_NAME}
