"""The kernel costs: the one registry of ``Side.cost`` names and their formulas off the kernels.

Every ground cost reaches the backends as a *kernel cost* on transformed points
(flashsinkhorn/costs.py). Two kinds exist:

- ``"sqeuclidean"`` (id 0): ‖r − c‖², computed in the shifted form (the scores are the dot
  products r·c plus column and row terms; docs/kernels.md) with no square distance formed;
- every other cost is a function of the clamped squared distance
  ``D2 = max(‖r‖² + ‖c‖² − 2 r·c, sq_floor)``: ``"euclidean"`` (id 1) is sqrt(D2).

This module holds the name → integer id map that the Triton kernels receive as their
``COST`` constexpr (their tile formulas for each id live in ``triton/tiles.py``), and the same
formulas in PyTorch for the torch backend. It imports no Triton.
"""

from __future__ import annotations

import torch

#: Kernel cost ids (the ``COST`` constexpr of the Triton kernels).
SQEUCLIDEAN = 0
EUCLIDEAN = 1

#: ``Side.cost`` → kernel cost id.
KERNEL_COSTS = {"sqeuclidean": SQEUCLIDEAN, "euclidean": EUCLIDEAN}


def cost_id(name: str) -> int:
    """The kernel id of a ``Side.cost`` name.

    Raises:
        ValueError: for a name that is not a kernel cost.
    """
    try:
        return KERNEL_COSTS[name]
    except KeyError:
        raise ValueError(f"unknown kernel cost {name!r}; known: {sorted(KERNEL_COSTS)}") from None


def power(name: str) -> int:
    """The exponent p of the cost as a power of the distance (C = D^p): the ε-scaling schedule
    starts from diameter^p."""
    return {SQEUCLIDEAN: 2, EUCLIDEAN: 1}[cost_id(name)]


def shifted(name: str) -> bool:
    """True for the squared Euclidean cost, whose scores use the shifted (dot-product) form."""
    return cost_id(name) == SQEUCLIDEAN


def cost_from_sq(name: str, d2: torch.Tensor, sq_floor: float) -> torch.Tensor:
    """The cost of a non-shifted kernel cost from the squared distances ``d2`` (any shape).

    ``d2`` is clamped at ``sq_floor`` first (rounding of the expansion may make it < 0).
    """
    cid = cost_id(name)
    if cid == EUCLIDEAN:
        return d2.clamp_min(sq_floor).sqrt()
    raise ValueError(f"kernel cost {name!r} has no squared-distance form")


def grad_weight(name: str, soft: torch.Tensor, C: torch.Tensor, sq_floor: float) -> torch.Tensor:
    """``soft`` times the weight w_ij of the envelope gradient Σ_j P_ij w_ij (r_i − c_j) of a
    non-shifted kernel cost, from the cost block ``C`` (:func:`cost_from_sq`).

    Euclidean: w = 1 / D, and the subgradient 0 where the distance is at or below the floor.
    """
    cid = cost_id(name)
    if cid == EUCLIDEAN:
        floor = max(sq_floor, 0.0) ** 0.5
        return torch.where(C > floor, soft / torch.where(C > 0, C, 1.0), 0.0)
    raise ValueError(f"kernel cost {name!r} has no squared-distance form")
