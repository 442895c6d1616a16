"""The kernel costs: the one registry of ``Side.cost`` names, their kinds and their formulas.

Every ground cost reaches the backends as a *kernel cost* (flashsinkhorn/costs.py maps the
public names onto them, with a point transform). Its :class:`KernelCost` says how the
kernels and the gradient read it; three kinds exist:

- ``"dot-product"``: ‖r − c‖² in the shifted form: the scores are the dot products r·c
  plus column and row terms (docs/kernels.md), no distance is formed; the envelope gradient
  is 2 (diag(â) r − P c). ``"sqeuclidean"`` (kernel id 0).
- ``"radial"``: a function of the clamped squared distance
  ``D2 = max(‖r‖² + ‖c‖² − 2 r·c, sq_floor)``: the tiles form D2 and apply the formula of
  the id (``triton/tiles.py``, :func:`cost_from_sq` here); the envelope gradient is
  Σ_j P_ij w_ij (r_i − c_j) with w from :func:`grad_weight`. ``"euclidean"`` (id 1) is
  sqrt(D2).
- ``"matrix"``: a given cost matrix (backends/matrix.py), each side's rows of C in place of
  points; no kernel id, no point gradient (the value is differentiated w.r.t. C).

The integer ids are the ``COST`` constexpr of the Triton kernels. This module imports no
Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Kernel cost ids (the ``COST`` constexpr of the Triton kernels).
SQEUCLIDEAN = 0
EUCLIDEAN = 1

#: The kinds of :class:`KernelCost`.
KINDS = ("dot-product", "radial", "matrix")


@dataclass(frozen=True)
class KernelCost:
    """The contract of one kernel cost.

    Attributes:
        name: the ``Side.cost`` name.
        kind: one of :data:`KINDS`: how the kernels and the gradient read it (module
            docstring).
        id: the ``COST`` constexpr of the Triton kernels; None for a cost no kernel streams.
        power: the exponent p of the cost as a power of the distance (C = D^p; the eps
            ladder starts from diameter^p); None where it is not a function of a distance.
    """

    name: str
    kind: str
    id: int | None
    power: int | None


#: ``Side.cost`` → its contract.
CONTRACTS = {
    c.name: c
    for c in (
        KernelCost("sqeuclidean", "dot-product", SQEUCLIDEAN, 2),
        KernelCost("euclidean", "radial", EUCLIDEAN, 1),
        KernelCost("matrix", "matrix", None, None),
    )
}

#: ``Side.cost`` → kernel cost id, for the costs the kernels stream.
KERNEL_COSTS = {name: c.id for name, c in CONTRACTS.items() if c.id is not None}


def contract(name: str) -> KernelCost:
    """The :class:`KernelCost` of a ``Side.cost`` name.

    Raises:
        ValueError: for a name that is not a kernel cost.
    """
    try:
        return CONTRACTS[name]
    except KeyError:
        raise ValueError(f"unknown kernel cost {name!r}; known: {sorted(CONTRACTS)}") from None


def cost_id(name: str) -> int:
    """The kernel id of a ``Side.cost`` name.

    Raises:
        ValueError: for a name that is not a kernel cost, or one no kernel streams.
    """
    cid = contract(name).id
    if cid is None:
        raise ValueError(f"kernel cost {name!r} is not streamed by the kernels")
    return cid


def power(name: str) -> int:
    """The exponent p of the cost as a power of the distance (C = D^p): the ε-scaling schedule
    starts from diameter^p."""
    p = contract(name).power
    if p is None:
        raise ValueError(f"kernel cost {name!r} is not a power of a distance")
    return p


def shifted(name: str) -> bool:
    """True for a dot-product cost, whose scores use the shifted form."""
    return contract(name).kind == "dot-product"


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
