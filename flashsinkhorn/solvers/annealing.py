"""eps annealing (eps-scaling) schedules and the diameter estimate."""

from __future__ import annotations

import math

import numpy as np
import torch


def estimate_diameter(x: torch.Tensor, y: torch.Tensor) -> float:
    """Diagonal of the bounding box of both clouds (all batches): an upper bound on ‖x − y‖.

    Args:
        x: (B, n, d) points.
        y: (B, m, d) points.
    """
    lo = torch.minimum(x.amin(dim=(0, 1)), y.amin(dim=(0, 1))).double()
    hi = torch.maximum(x.amax(dim=(0, 1)), y.amax(dim=(0, 1))).double()
    return float((hi - lo).norm())


def geometric_ladder(
    start: float, stop: float, ratio: float, *, keep_start: bool = False
) -> list[float]:
    """GeomLoss-style ladder: ``[start] + exp(arange(log start, log stop, log ratio)) + [stop]``.

    The first value appears twice, as in GeomLoss, so that a drop-in reproduces its iterations.
    With ``start <= stop`` the ladder is just ``[stop]``, or ``[start, stop]`` with
    ``keep_start`` (GeomLoss's own list when the diameter is below the blur).
    """
    if not (start > stop):
        return [start, stop] if keep_start else [stop]
    steps = np.arange(math.log(start), math.log(stop), math.log(ratio))
    return [start] + [float(math.exp(e)) for e in steps] + [stop]


def eps_schedule(
    eps: float,
    scaling: float | None,
    diameter: float | None,
    power: int = 2,
    offset: float = 0.0,
) -> list[float]:
    """The eps value of every iteration before the solve settles at ``eps``.

    For the cost ‖x − y‖², annealing starts at the largest cost, ``diameter²``, and divides eps
    by ``scaling²`` each iteration (``scaling`` acts on the length scale sqrt(eps), as GeomLoss's
    ``scaling`` acts on its blur). ``scaling=None`` gives ``[eps]``.

    Other costs: ``power=1`` for the euclidean cost (start at ``diameter``, ratio ``scaling``,
    as GeomLoss's p = 1), and ``offset`` (the largest label term) is added to the start.
    """
    if scaling is None or diameter is None or diameter <= 0:
        return [eps]
    return geometric_ladder(diameter**power + offset, eps, scaling**power)
