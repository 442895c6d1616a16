"""eps annealing (eps-scaling) schedules and the diameter estimate.

Ladders are computed from logarithms, so a start beyond the float range (a diameter of 1e200
squared) neither overflows nor becomes inf, and their length is known before any list is
built: a ladder longer than :data:`MAX_ANNEALING_STEPS` is refused.
"""

from __future__ import annotations

import math

import torch

#: Most annealing steps (eps values above the target) that a ladder may have. Annealing is a
#: warm start: with a scaling of 0.5 to 0.9 even a cost range of 10³⁰⁰ takes a few thousand
#: steps, and more would cost more iterations than a solve at the target eps.
MAX_ANNEALING_STEPS = 10_000


def ladder_cap(dtype: torch.dtype | None) -> float:
    """Largest eps a ladder starts from for potentials of ``dtype`` (None: float64): the
    square root of the largest finite value, so that eps times the logarithms and ratios the
    soft-min forms stays finite. Annealing is a warm start: where the costs exceed the cap,
    the ladder starts lower, and the problem solved at the target eps is the same."""
    return math.sqrt(torch.finfo(torch.float64 if dtype is None else dtype).max)


def estimate_diameter(x: torch.Tensor, y: torch.Tensor) -> float:
    """Diagonal of the bounding box of both clouds (all batches): an upper bound on ‖x − y‖.

    Args:
        x: (B, n, d) points.
        y: (B, m, d) points.
    """
    lo = torch.minimum(x.amin(dim=(0, 1)), y.amin(dim=(0, 1))).double()
    hi = torch.maximum(x.amax(dim=(0, 1)), y.amax(dim=(0, 1))).double()
    return float((hi - lo).norm())


def log_cost_range(diameter: float, power: int = 2, offset: float = 0.0) -> float:
    """log(diameter^power + offset), without forming a power that could overflow."""
    log_d = power * math.log(diameter)
    if offset <= 0:
        return log_d
    log_o = math.log(offset)
    hi, lo = max(log_d, log_o), min(log_d, log_o)
    return hi + math.log1p(math.exp(lo - hi))


def cost_range(diameter: float | None, power: int = 2, offset: float = 0.0) -> float | None:
    """diameter^power + offset, the largest cost; ``inf`` where it exceeds the float range,
    None without a (positive, finite) diameter."""
    if diameter is None or not (diameter > 0 and math.isfinite(diameter)):
        return None
    log_r = log_cost_range(diameter, power, offset)
    return math.exp(log_r) if log_r < math.log(torch.finfo(torch.float64).max) else math.inf


def geometric_ladder(
    start: float,
    stop: float,
    ratio: float,
    *,
    keep_start: bool = False,
    log_start: float | None = None,
    log_ratio: float | None = None,
    cap: float | None = None,
    scaling: float | None = None,
) -> list[float]:
    """GeomLoss-style ladder: ``[start] + exp(arange(log start, log stop, log ratio)) + [stop]``.

    The first value appears twice, as in GeomLoss, so that a drop-in reproduces its iterations.
    With ``start <= stop`` the ladder is just ``[stop]``, or ``[start, stop]`` with
    ``keep_start`` (GeomLoss's own list when the diameter is below the blur).

    Args:
        start: first eps (ignored when ``log_start`` is given).
        stop: the target eps.
        ratio: factor between successive values, in (0, 1) (ignored when ``log_ratio`` is
            given).
        keep_start: keep ``[start, stop]`` when start <= stop.
        log_start: log of the first eps, for starts beyond the float range.
        log_ratio: log of the ratio, for ratios below the float range.
        cap: the ladder starts at min(start, cap); default :func:`ladder_cap` of float64.
        scaling: the caller's ``scaling``, named in the error (default: ``ratio``).

    Raises:
        ValueError: the ladder would have more than :data:`MAX_ANNEALING_STEPS` steps.
    """
    if log_start is None:
        log_start = math.log(start) if start > 0 else -math.inf
    if log_ratio is None:
        log_ratio = math.log(ratio)
    cap = ladder_cap(torch.float64) if cap is None else cap
    log_start = min(log_start, math.log(cap))
    log_stop = math.log(stop)
    start = math.exp(log_start)
    if not (log_start > log_stop):
        return [start, stop] if keep_start else [stop]
    # np.arange's length and values, without allocating before the length is checked.
    count = math.ceil((log_stop - log_start) / log_ratio)
    if count > MAX_ANNEALING_STEPS:
        shown = math.exp(log_ratio) if scaling is None else scaling
        raise ValueError(
            f"scaling={shown!r} would anneal eps from {start:.3g} down to {stop:.3g} in "
            f"{count:,} steps, more than the {MAX_ANNEALING_STEPS:,} allowed "
            "(flashsinkhorn.solvers.MAX_ANNEALING_STEPS); use a smaller scaling (0.5 to 0.9 "
            "are typical) or scaling=None"
        )
    steps = [math.exp(log_start + k * log_ratio) for k in range(count)]
    return [start, *steps, stop]


def eps_schedule(
    eps: float,
    scaling: float | None,
    diameter: float | None,
    power: int = 2,
    offset: float = 0.0,
    *,
    dtype: torch.dtype | None = None,
) -> list[float]:
    """The eps value of every iteration before the solve settles at ``eps``.

    For the cost ‖x − y‖², annealing starts at the largest cost, ``diameter²``, and divides eps
    by ``scaling²`` each iteration (``scaling`` acts on the length scale sqrt(eps), as GeomLoss's
    ``scaling`` acts on its blur). ``scaling=None`` gives ``[eps]``.

    Other costs: ``power=1`` for the euclidean cost (start at ``diameter``, ratio ``scaling``,
    as GeomLoss's p = 1), and ``offset`` (the largest label term) is added to the start.
    ``dtype``: the potentials' dtype, which caps the start (:func:`ladder_cap`).

    Raises:
        ValueError: more than :data:`MAX_ANNEALING_STEPS` steps (naming ``scaling``).
    """
    if scaling is None or diameter is None or not (diameter > 0 and math.isfinite(diameter)):
        return [eps]
    return geometric_ladder(
        0.0, eps, 0.0, log_start=log_cost_range(diameter, power, offset),
        log_ratio=power * math.log(scaling), cap=ladder_cap(dtype), scaling=scaling,
    )  # fmt: skip
