"""What the potentials' dtype can represent: range checks, the float32 floor of eps and the
choice of the large-eps soft-min.

A prepared problem carries host statistics read back in ``prepare``'s one synchronisation
(``Problem.stats``: largest centred coordinate, bounding-box diagonal², largest mass). From
them, before any iteration:

- :func:`check_range` refuses a problem whose numbers do not fit the dtype: squared distances
  or masses that overflow, an eps whose scores cost/eps overflow (or that is itself out of
  range), a KL strength rho below the smallest normal number or above the largest;
- :func:`check_plan` refuses plan-derived outputs (gradients, marginals, transports, the
  convergence test) when eps is below :data:`PLAN_FLOOR_ULPS` machine epsilons of the cost's
  range: the plan exp((f + g − C)/eps) depends on f + g − C to a fraction of eps, and float32
  potentials and costs of size diameter² carry rounding of u·diameter² (docs/precision.md);
- :func:`large_eps_sides` marks the sides whose soft-min must use the expansion about the mean
  score at large eps, where exp of scores within a few ulps of each other loses every digit of
  the cost (docs/precision.md, "Large eps").

Only the rare cases synchronise again (the exact largest squared norm, when the cheap bound
from the largest coordinate cannot decide).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .backends import kernel_costs
from .problem import Problem

#: Plan-derived outputs need eps >= PLAN_FLOOR_ULPS · machine epsilon · cost range (diameter²
#: for the squared Euclidean cost): 1.2e-5 in float32, 2.2e-14 in float64. At the floor the
#: float32 gradient is within 4e-3 of float64 (measured worst case, docs/precision.md); below
#: it the error grows as u·diameter²/eps and the plan overflows near 1e-9.
PLAN_FLOOR_ULPS = 100.0

#: The soft-min switches to the expansion about the mean score for eps >= LARGE_EPS_RATIO ·
#: (largest cost bound 4·max‖x‖², or 2·max‖x‖ for the euclidean cost, plus the largest label
#: cost): the scores then differ by less than 1/LARGE_EPS_RATIO·2 and the plain log-sum-exp
#: keeps only u·eps of the cost.
LARGE_EPS_RATIO = 4.0

#: Factor of headroom below the dtype's largest number kept for sums and products.
HEADROOM = 16.0


def _finfo(problem: Problem) -> torch.finfo:
    return torch.finfo(problem.dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _or_float64(problem: Problem) -> str:
    """The advice to switch to float64, where it is not the dtype already."""
    if problem.dtype == torch.float64:
        return ""
    return " or pass C in float64" if problem.cost == "matrix" else " or pass float64 points"


def _live(problem: Problem) -> bool:
    """Some points carry no mass: the statistics of ``prepare`` (over every point) overstate
    the scale of the plan, and :func:`_scales` recomputes them over the others."""
    return problem.X.has_null or problem.Y.has_null


def _scales(problem: Problem) -> tuple[float, float | None]:
    """(bounding-box diagonal², largest squared norm or None) of the points with mass."""
    st = problem.stats
    if st is not None and not _live(problem):
        return st.box2, st.sq_max
    if st is not None and st.live is not None:
        return st.live
    lo, hi, sq = [], [], []
    for side in (problem.X, problem.Y):
        live = (side.w > 0)[..., None]
        x = side.x.to(problem.dtype)
        lo.append(torch.where(live, x, math.inf).amin(1))
        hi.append(torch.where(live, x, -math.inf).amax(1))
        sq.append(torch.where(side.w > 0, side.sq, 0.0).amax(1))
    box2 = ((torch.maximum(*hi) - torch.minimum(*lo)) ** 2).sum(-1).max()
    vals = torch.stack([box2, torch.maximum(*sq).max()]).tolist()
    return vals[0], vals[1]


def _sq_max(problem: Problem) -> float:
    """Largest squared norm of a centred point with mass, from the statistics or one
    synchronisation."""
    sq = _scales(problem)[1]
    if sq is not None:
        return sq
    return float(torch.maximum(problem.X.sq.max(), problem.Y.sq.max()))


def _label_max(problem: Problem) -> float:
    return float(problem.X.lcost.abs().max()) if problem.has_labels else 0.0


def cost_range(problem: Problem) -> float:
    """The range of the cost that eps is compared with: diameter^p (p = 2 for the squared
    Euclidean cost, 1 for the euclidean one; diameter the bounding-box diagonal of the points
    of both clouds that carry mass) plus the largest label cost; for a given cost matrix
    (``flashsinkhorn.solve``), the spread max C − min C of its entries."""
    if problem.cost == "matrix":
        if problem.stats is not None:
            return problem.stats.box2  # read with C's value checks (backends/matrix.py)
        C = problem.X.x  # the rows of C
        return float(C.amax() - C.amin())
    box2 = _scales(problem)[0]
    power = kernel_costs.power(problem.cost)
    return (box2 if power == 2 else math.sqrt(max(box2, 0.0))) + _label_max(problem)


def plan_floor(problem: Problem) -> float:
    """Smallest eps at which the potentials' dtype resolves the transport plan."""
    return PLAN_FLOOR_ULPS * _finfo(problem).eps * cost_range(problem)


def _eps_label(eps: float, eps_name: str) -> str:
    """How a message names eps: ``eps=…``, or the caller's own argument (``SamplesLoss``'s
    ``blur``) with the eps it sets."""
    return f"eps={eps:.3g}" if eps_name == "eps" else f"{eps_name} (setting eps={eps:.3g})"


def check_plan(problem: Problem, eps: float, what: str, eps_name: str = "eps") -> None:
    """Raises when the plan of this problem at ``eps`` is below the dtype's resolution.

    Args:
        problem: the prepared problem.
        eps: the eps of the plan.
        what: what needs the plan, for the message ("gradients", "marginals", …).

    Raises:
        ValueError: eps < :func:`plan_floor`.
    """
    floor = plan_floor(problem)
    if eps >= floor or not math.isfinite(floor):
        return
    name = _name(problem.dtype)
    ratio = PLAN_FLOOR_ULPS * _finfo(problem).eps
    scale = "(max C − min C)" if problem.cost == "matrix" else "diameter²"
    raise ValueError(
        f"{_eps_label(eps, eps_name)} is too small for {what} in {name}: {name} potentials "
        f"resolve the "
        f"transport plan only for eps >= {ratio:.2g}·{scale} = {floor:.3g} here (rounding "
        f"of the potentials and costs enters the plan as exp(±u·{scale}/eps)); pass a "
        f"larger {eps_name}{_or_float64(problem)} (docs/precision.md)"
    )


def check_range(
    problem: Problem, eps_list: list[float], names=("rho_x", "rho_y"), eps_name: str = "eps"
) -> None:
    """Raises when the problem's numbers do not fit the potentials' dtype.

    Args:
        problem: the prepared problem (``problem.stats`` set by ``prepare``).
        eps_list: every eps the solve will use.
        names: the public names of the two KL strengths, for the messages.

    Raises:
        ValueError: squared distances or masses that overflow, an eps or rho out of range.
    """
    st = problem.stats
    fi = _finfo(problem)
    name = _name(problem.dtype)
    if st is None or not (math.isfinite(st.amax) and math.isfinite(st.mass)):
        return  # non-finite input passed with check_finite=False: the caller opted out
    top = fi.max / HEADROOM
    if problem.cost == "matrix":
        cost_max = st.amax  # largest |C_ij| (backends/matrix.py)
        if not 2.0 * cost_max <= top:
            raise ValueError(
                f"C is too large for {name}: its entries reach {cost_max:.3g}, and potentials "
                f"minus costs must stay below {top:.3g}; rescale C (the value scales with "
                f"it){_or_float64(problem)}"
            )
    else:
        d = problem.X.x.shape[-1]
        sq = st.sq_max if st.sq_max is not None else d * st.amax**2
        if not 4.0 * sq <= top and st.sq_max is None:
            sq = _sq_max(problem)
        if not 4.0 * sq <= top:
            raise ValueError(
                f"x and y are too large for {name}: squared distances reach {4.0 * sq:.3g} "
                f"(largest centred coordinate {st.amax:.3g}), above {top:.3g}; rescale the "
                f"points (the cost scales with their square){_or_float64(problem)}"
            )
        cost_max = 4.0 * sq
    mass = max(st.mass, 1.0)
    if not mass * mass <= top:
        raise ValueError(
            f"a and b are too large for {name}: a total mass of {st.mass:.3g} makes the plan's "
            f"mass a⊗b overflow ({mass * mass:.3g} > {top:.3g}); rescale the weights (the value "
            f"scales with them){_or_float64(problem)}"
        )
    lo = max(fi.tiny, HEADROOM * cost_max / top)
    hi = top / (mass * mass)
    for eps in (min(eps_list), max(eps_list)):
        if eps < lo:
            raise ValueError(
                f"{_eps_label(eps, eps_name)} is too small for {name}: the scores cost/eps "
                f"overflow below eps = {lo:.3g} for these points; pass a larger "
                f"{eps_name}{_or_float64(problem)}"
            )
        if eps > hi:
            raise ValueError(
                f"{_eps_label(eps, eps_name)} is too large for {name}: eps·mass² must stay "
                f"below {top:.3g} (largest eps here {hi:.3g}); pass a smaller "
                f"{eps_name}{_or_float64(problem)}"
            )
    eps_hi = max(eps_list)
    for side, nm in ((problem.X, names[0]), (problem.Y, names[1])):
        rho = side.rho
        if rho is None:
            continue
        lo_rho = max(fi.tiny, HEADROOM * eps_hi / top)
        if rho < lo_rho:
            raise ValueError(
                f"{nm} is too small for {name}: its KL strength rho = {rho:.3g} < {lo_rho:.3g} "
                f"(below the smallest normal number, or eps/rho overflows); pass a larger {nm} "
                f"or None for a hard marginal{_or_float64(problem)}"
            )
        if rho > top / mass:
            raise ValueError(
                f"{nm} is too large for {name}: its KL strength rho = {rho:.3g} > "
                f"{top / mass:.3g}; pass {nm}=None for a hard marginal (the limit of a large "
                f"rho)"
            )


def large_eps_sides(problem: Problem, eps_max: float) -> Problem:
    """The problem with ``Side.large_eps`` set when some eps up to ``eps_max`` needs it.

    The threshold is :data:`LARGE_EPS_RATIO` times a bound of the scores' spread; the largest
    squared norm is read back (one synchronisation) only when the cheap bound from the largest
    coordinate cannot rule the expansion out.
    """
    st = problem.stats
    if problem.cost == "matrix":
        # the scores p_j − C_ij of a row spread over about max C − min C
        th = LARGE_EPS_RATIO * cost_range(problem)
        return problem if eps_max < th else _with_large_eps(problem, th)
    if st is not None and math.isfinite(st.amax) and not _live(problem):
        if eps_max < LARGE_EPS_RATIO * _spread(problem, st.amax**2):
            return problem
    sq = _sq_max(problem)
    if not math.isfinite(sq):
        return problem
    th = LARGE_EPS_RATIO * _spread(problem, sq)
    if eps_max < th:
        return problem
    return _with_large_eps(problem, th)


def _with_large_eps(problem: Problem, th: float) -> Problem:
    X = replace(problem.X, large_eps=th)
    Y = X if problem.Y is problem.X else replace(problem.Y, large_eps=th)
    return replace(problem, X=X, Y=Y)


def _spread(problem: Problem, sq: float) -> float:
    """Bound of the cost given the largest squared norm: (2R)² or 2R, plus the labels."""
    power = kernel_costs.power(problem.cost)
    return (4.0 * sq if power == 2 else 2.0 * math.sqrt(sq)) + _label_max(problem)


def admit(
    problem: Problem, eps_list: list[float], *, tol, names=("rho_x", "rho_y"), eps_name="eps"
) -> Problem:
    """The range checks of a solve, and the problem with its large-eps sides marked.

    With a tolerance the convergence test reads the plan's marginals: it is refused below the
    plan floor like every plan-derived output (``tol=None`` still gives the value).
    ``names`` and ``eps_name``: the caller's names of rho_x, rho_y and eps, for the messages.
    """
    check_range(problem, eps_list, names, eps_name)
    if tol is not None:
        check_plan(problem, eps_list[-1], f"the convergence test (tol={tol:g})", eps_name)
    return large_eps_sides(problem, max(eps_list))


def check_divergence(problem: Problem, eps: float, tol: float | None) -> None:
    """Raises when the three terms of a balanced divergence cannot resolve their difference.

    Each term's value carries the mass term eps·M(M − 1) of weights of mass M (exactly 0 for
    uniform weights, whose nominal mass is 1); the divergence subtracts three such terms, so
    their rounding u·eps·M|M − 1| must stay below the solver's own accuracy tol·M·(cost
    range), or the result is rounding noise (it came out exactly 0 for weights of mass 2e19
    at eps = 0.5 in float64). Reads host statistics only.

    Raises:
        ValueError: naming a and b, eps and the dtype.
    """
    st = problem.stats
    X, Y = problem.X, problem.Y
    if st is None or X.rho is not None or (X.unit_mass and Y.unit_mass):
        return
    mass = st.mass
    lost = _finfo(problem).eps * eps * mass * abs(mass - 1.0)
    scale = st.box2 if kernel_costs.power(problem.cost) == 2 else math.sqrt(st.box2)
    resolved = (1e-3 if tol is None else tol) * mass * scale
    if lost <= resolved:
        return
    name = _name(problem.dtype)
    raise ValueError(
        f"a and b carry a total mass of {mass:.3g}: at eps={eps:.3g} the mass term eps·M(M − 1) "
        f"of each term of the divergence is rounded by {lost:.3g} in {name}, more than the "
        f"divergence resolves (tol·M·cost range = {resolved:.3g}); rescale the weights to "
        f"mass 1 or pass a smaller eps"
    )
