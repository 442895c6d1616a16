"""Ground costs beyond ‖x − y‖² and the OTDD label-augmented cost (docs/costs.md).

Every supported cost is reduced to one of two *kernel costs* on transformed points:

- ``"sqeuclidean"``: C = w ‖L(x − y)‖², points x ↦ sqrt(w) L x;
- ``"euclidean"``: C = w ‖L(x − y)‖, points x ↦ w L x (the kernels take the square root);
- ``"cosine"``: C = w (1 − cos(Lx, Ly)) = (w/2) ‖x̂ − ŷ‖² for unit vectors x̂ = Lx / ‖Lx‖,
  i.e. the squared Euclidean kernel cost on sqrt(w/2) x̂.

The transforms are plain differentiable PyTorch ops applied before the solve, so gradients
w.r.t. the caller's points follow by autograd through them; all the kernel costs are
translation invariant, so ``problem.prepare`` still centres the transformed clouds.

The label term of OTDD (Alvarez-Melis & Fusi; FlashSinkhorn paper §4.2, H.3) adds
``label_weight · W[l_i, l_j]`` to every entry; the kernels read it from a V × V table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from . import _validation as V
from .option_table import defaults

#: Public cost name → the kernel cost of its transformed points (backends/kernel_costs.py
#: holds each kernel cost's kind and formulas).
KERNEL_COST_OF = {"sqeuclidean": "sqeuclidean", "euclidean": "euclidean", "cosine": "sqeuclidean"}

COSTS = tuple(KERNEL_COST_OF)

#: Keyword arguments of the cost and their defaults (the API of ``sinkhorn`` and the losses).
COST_DEFAULTS = defaults("cost")

SECOND_ORDER_COST_MESSAGE = (
    "flashsinkhorn: second derivatives (hvp, HessianOperator, double backward) are implemented "
    "for the squared Euclidean cost only; cost={cost!r}, a feature_map, a feature_weight != 1 "
    "or labels are not supported there"
)


@dataclass(frozen=True)
class CostSpec:
    """A validated cost description.

    Attributes:
        cost: "sqeuclidean", "euclidean" or "cosine" (the caller's choice).
        feature_map: (k, d) matrix or (d,) diagonal applied to both clouds, or None.
        feature_weight: factor of the feature cost (>= 0).
        label_x: (n,) or (B, n) integer labels of x, or None.
        label_y: (m,) or (B, m) integer labels of y, or None.
        label_cost: (V, V) label-to-label cost W, or None.
        label_weight: factor of the label term (>= 0).
    """

    cost: str = "sqeuclidean"
    feature_map: torch.Tensor | None = None
    feature_weight: float = 1.0
    label_x: torch.Tensor | None = None
    label_y: torch.Tensor | None = None
    label_cost: torch.Tensor | None = None
    label_weight: float = 1.0

    @property
    def kernel_cost(self) -> str:
        """The cost the backends compute on the transformed points.

        Raises:
            ValueError: a cost name without a kernel cost (never one ``check_cost`` passed).
        """
        try:
            return KERNEL_COST_OF[self.cost]
        except KeyError:
            raise ValueError(
                f"cost {self.cost!r} has no kernel cost; known: {', '.join(KERNEL_COST_OF)}"
            ) from None

    @property
    def has_labels(self) -> bool:
        return self.label_cost is not None

    @property
    def is_default(self) -> bool:
        """Plain ‖x − y‖² (the only cost with second derivatives)."""
        return (
            self.cost == "sqeuclidean"
            and self.feature_map is None
            and self.feature_weight == 1.0
            and not self.has_labels
        )

    def with_labels(self, label_x, label_y) -> CostSpec:
        """The same cost with another pair of label vectors (self terms of a divergence)."""
        return replace(self, label_x=label_x, label_y=label_y)

    def labels_for_prepare(self):
        """``(label_x, label_y, label_weight · W)`` for :func:`~.problem.prepare`, or None."""
        if not self.has_labels:
            return None
        return (self.label_x, self.label_y, self.label_weight * self.label_cost.detach())


def _check_labels(name: str, lab: object, points: torch.Tensor) -> torch.Tensor:
    if not isinstance(lab, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer labels, got {type(lab)}")
    if lab.is_floating_point() or lab.is_complex() or lab.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype (e.g. torch.int64), got {lab.dtype}")
    if lab.device != points.device:
        raise ValueError(
            f"{name} must be on the device of its points ({points.device}), got {lab.device}"
        )
    n = points.shape[-2]
    if points.dim() == 2:
        ok = tuple(lab.shape) == (n,)
        allowed = f"({n},)"
    else:
        ok = tuple(lab.shape) in ((n,), (points.shape[0], n))
        allowed = f"({points.shape[0]}, {n}) or ({n},)"
    if not ok:
        raise ValueError(
            f"{name} must have shape {allowed} matching its points of shape "
            f"{tuple(points.shape)}, got {tuple(lab.shape)}"
        )
    return lab


def check_cost(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    cost: str = "sqeuclidean",
    feature_map: torch.Tensor | None = None,
    label_x: torch.Tensor | None = None,
    label_y: torch.Tensor | None = None,
    label_cost: torch.Tensor | None = None,
    feature_weight: float = 1.0,
    label_weight: float = 1.0,
) -> CostSpec:
    """Validates the cost arguments against the (already checked) clouds.

    Raises:
        TypeError: wrong types or dtypes (non-integer labels, non-floating W or map).
        ValueError: unknown cost, wrong shapes, labels outside [0, V), negative or non-finite
            W, weights or map entries, label arguments given without the others.
    """
    if not isinstance(cost, str) or cost not in COSTS:
        raise ValueError(f"cost must be one of {', '.join(map(repr, COSTS))}, got {cost!r}")
    feature_weight = V.check_nonnegative("feature_weight", feature_weight)
    label_weight = V.check_nonnegative("label_weight", label_weight)
    d = x.shape[-1]
    if feature_map is not None:
        L = feature_map
        if not isinstance(L, torch.Tensor):
            raise TypeError(f"feature_map must be a torch.Tensor or None, got {type(L)}")
        if L.is_complex() or not L.is_floating_point():
            raise TypeError(f"feature_map must have a real floating dtype, got {L.dtype}")
        if not ((L.dim() == 1 and L.shape[0] == d) or (L.dim() == 2 and L.shape[1] == d)):
            raise ValueError(
                f"feature_map must be a (k, {d}) matrix or a ({d},) diagonal, got shape "
                f"{tuple(L.shape)}"
            )
        if L.numel() == 0:
            raise ValueError("feature_map must not be empty")
        if L.device != x.device:
            raise ValueError(f"feature_map must be on {x.device}, got {L.device}")
        if not bool(torch.isfinite(L).all()):
            raise ValueError("feature_map must not contain NaN or inf")
    given = [t is not None for t in (label_x, label_y, label_cost)]
    if any(given) and not all(given):
        raise ValueError(
            "label_x, label_y and label_cost must be given together (or none of them); got "
            + ", ".join(
                n for n, g in zip(("label_x", "label_y", "label_cost"), given, strict=True) if g
            )
        )
    if all(given):
        W = label_cost
        if not isinstance(W, torch.Tensor):
            raise TypeError(f"label_cost must be a torch.Tensor (V, V), got {type(W)}")
        if W.is_complex() or not W.is_floating_point():
            raise TypeError(f"label_cost must have a real floating dtype, got {W.dtype}")
        if W.dim() != 2 or W.shape[0] != W.shape[1] or W.shape[0] == 0:
            raise ValueError(
                f"label_cost must be a non-empty square (V, V) matrix, got shape {tuple(W.shape)}"
            )
        if W.device != x.device:
            raise ValueError(f"label_cost must be on {x.device}, got {W.device}")
        label_x = _check_labels("label_x", label_x, x)
        label_y = _check_labels("label_y", label_y, y)
        nv = W.shape[0]
        Wd = W.detach()
        flags = torch.stack(
            [
                ~torch.isfinite(Wd).all(),
                (Wd < 0).any(),
                (label_x < 0).any() | (label_x >= nv).any(),
                (label_y < 0).any() | (label_y >= nv).any(),
            ]
        ).tolist()
        if flags[0]:
            raise ValueError("label_cost must be finite (no NaN or inf)")
        if flags[1]:
            raise ValueError("label_cost must be non-negative")
        for flag, name, lab in ((flags[2], "label_x", label_x), (flags[3], "label_y", label_y)):
            if flag:
                raise ValueError(
                    f"{name} must hold labels in [0, V) = [0, {nv}) (V = label_cost.shape[0]), "
                    f"got values in [{int(lab.min())}, {int(lab.max())}]"
                )
    return CostSpec(cost, feature_map, feature_weight, label_x, label_y, label_cost, label_weight)


def transform_points(x: torch.Tensor, spec: CostSpec) -> torch.Tensor:
    """Maps a cloud to the space where the spec's kernel cost applies (differentiable).

    Zero vectors under ``cost="cosine"`` (after the feature map) are mapped to the origin,
    not to the unit sphere: their cost to any point is w/2 (and 0 to another zero vector),
    and their gradient is 0. Returns ``x`` itself for the default cost.
    """
    L = spec.feature_map
    scale = {
        "sqeuclidean": math.sqrt(spec.feature_weight),
        "euclidean": spec.feature_weight,
        "cosine": math.sqrt(spec.feature_weight / 2.0),
    }[spec.cost]
    if L is None and spec.cost != "cosine" and scale == 1.0:
        return x
    # Half inputs are transformed in float32 and rounded once back.
    ct = torch.promote_types(x.dtype, torch.float32)
    z = x.to(ct)
    if L is not None:
        L = L.to(ct)
        z = z * L if L.dim() == 1 else z @ L.transpose(0, 1)
    if spec.cost == "cosine":
        nrm = torch.linalg.vector_norm(z, dim=-1, keepdim=True)
        nz = nrm > 0
        z = torch.where(nz, z / torch.where(nz, nrm, torch.ones_like(nrm)), torch.zeros_like(z))
    if scale != 1.0:
        z = z * scale
    return z.to(x.dtype)


#: Second derivatives of a multiscale solve (its plan is block-sparse; the Schur solve of the
#: HVP is not implemented on it).
SECOND_ORDER_MULTISCALE_MESSAGE = (
    "flashsinkhorn: second derivatives (hvp, HessianOperator, double backward) are not "
    "available on path='multiscale'; solve with path='streaming' (or 'auto') to differentiate "
    "twice"
)


class _RefuseSecondOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad, *anchors):
        ctx.cost = getattr(_RefuseSecondOrder, "_cost", "?")
        ctx.message = getattr(_RefuseSecondOrder, "_message", None)
        return grad.clone()

    @staticmethod
    def backward(ctx, *grad_outputs):
        if ctx.message is not None:
            raise ValueError(ctx.message)
        raise ValueError(SECOND_ORDER_COST_MESSAGE.format(cost=ctx.cost))


def refuse_second_order(grads, anchors, cost: str, message: str | None = None):
    """Like :func:`~.autograd.guard.guard_second_order`, for costs without second derivatives:
    a further differentiation of ``grads`` raises a ValueError (``message``, or the one that
    names the cost)."""
    if not torch.is_grad_enabled():
        return grads
    live = [t for t in anchors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not live:
        return grads
    _RefuseSecondOrder._cost = cost
    _RefuseSecondOrder._message = message
    return tuple(None if g is None else _RefuseSecondOrder.apply(g, *live) for g in grads)


def check_default_cost(options: dict, where: str) -> None:
    """Raises a ValueError when ``options`` select anything but the plain ‖x − y‖² cost."""
    for key, default in COST_DEFAULTS.items():
        v = options.get(key, default)
        if isinstance(default, float):  # a weight: any real number type, compared by value
            same = V.check_nonnegative(key, v) == default
        else:
            same = v is None if default is None else (isinstance(v, type(default)) and v == default)
        if not same:
            raise ValueError(
                f"{key}: {where} is implemented for the squared Euclidean cost only "
                "(cost='sqeuclidean', no feature_map, feature_weight=1, no labels)"
            )
