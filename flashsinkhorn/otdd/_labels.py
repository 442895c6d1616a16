"""Checks and grouping of labelled datasets for OTDD.

A labelled dataset is a cloud ``x`` (n, d), integer labels ``l`` (n,) in ``0 .. V-1`` and
optional weights ``a`` (n,). Classes are grouped into a padded (V, N) index table: row k lists
the points of class k, padded up to N (the largest class) by repeating the class's last point
with weight 0, so that the bounding box of each class — and the annealing diameter — is
unchanged by the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _validation as V


def check_cloud(name: str, x: object) -> torch.Tensor:
    """A non-empty real floating (n, d) tensor (OTDD works on unbatched datasets)."""
    V.check_points(name, x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (n, d), got shape {tuple(x.shape)}")
    return x


def check_pair(n1: str, x1: torch.Tensor, n2: str, x2: torch.Tensor) -> None:
    """The two datasets agree in feature size, dtype and device."""
    if x1.shape[-1] != x2.shape[-1]:
        raise ValueError(
            f"{n1} and {n2} must have the same feature dimension d, got {x1.shape[-1]} and "
            f"{x2.shape[-1]}"
        )
    if x1.dtype != x2.dtype:
        raise TypeError(f"{n1} and {n2} must have the same dtype, got {x1.dtype} and {x2.dtype}")
    if x1.device != x2.device:
        raise ValueError(
            f"{n1} and {n2} must be on the same device, got {x1.device} and {x2.device}"
        )


def check_labels(name: str, l: object, x: torch.Tensor | None, num_classes: int | None) -> int:
    """Checks integer labels (n,) in 0 .. V-1 for the cloud ``x`` (any 1-D length if None).

    Returns V: ``num_classes`` when given, else ``max(l) + 1`` (labels are class indices).
    """
    if not isinstance(l, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integer class labels, got {type(l)}")
    if l.dtype == torch.bool or l.is_floating_point() or l.is_complex():
        raise TypeError(f"{name} must have an integer dtype (e.g. torch.int64), got {l.dtype}")
    if l.device.type == "meta":
        raise ValueError(
            f"{name} is a meta tensor (a shape without data): class labels are read, pass a "
            "tensor on the CPU or a CUDA device"
        )
    if x is None:
        if l.dim() != 1 or l.numel() == 0:
            raise ValueError(f"{name} must be 1-D (n,) and non-empty, got shape {tuple(l.shape)}")
    elif l.shape != (x.shape[0],):
        raise ValueError(
            f"{name} must have shape (n,) = ({x.shape[0]},) matching its points of shape "
            f"{tuple(x.shape)}, got {tuple(l.shape)}"
        )
    elif l.device != x.device:
        raise ValueError(f"{name} must be on the device of its points ({x.device}), got {l.device}")
    lo, hi = (int(v) for v in torch.stack([l.min(), l.max()]).tolist())
    if lo < 0:
        raise ValueError(f"{name} must hold class indices >= 0, got {lo}")
    if num_classes is None:
        return hi + 1
    if hi >= num_classes:
        raise ValueError(
            f"{name} holds class index {hi}, out of range for num_classes={num_classes} "
            "(labels must be in 0 .. num_classes - 1)"
        )
    return num_classes


def check_num_classes(num_classes: object) -> tuple[int | None, int | None]:
    """``None`` or a pair of ints >= 1 (V1, V2)."""
    if num_classes is None:
        return None, None
    if not isinstance(num_classes, (tuple, list)) or len(num_classes) != 2:
        raise TypeError(f"num_classes must be None or a pair (V1, V2) of ints, got {num_classes!r}")
    v1 = V.check_int("num_classes[0]", num_classes[0], 1)
    v2 = V.check_int("num_classes[1]", num_classes[1], 1)
    return v1, v2


@dataclass(frozen=True)
class Classes:
    """The classes of one dataset as a padded index table.

    Attributes:
        index: (V, N) long, row k = indices of the points of class k, padded with its last one.
        weight: (V, N) weights of those points, normalised to 1 per class; 0 on the padding.
        counts: the number of points of each class (host list).
    """

    index: torch.Tensor
    weight: torch.Tensor
    counts: list[int]

    @property
    def V(self) -> int:
        return self.index.shape[0]

    @property
    def N(self) -> int:
        return self.index.shape[1]


def group_classes(
    name: str,
    l: torch.Tensor,
    a: torch.Tensor | None,
    V_: int,
    wdtype: torch.dtype,
    weight_name: str = "a",
) -> Classes:
    """Groups points by label into the padded table; every class must hold mass.

    Args:
        name: name of the label argument, for error messages.
        l: (n,) labels in 0 .. V_-1 (checked).
        a: (n,) non-negative weights or None for uniform within each class.
        V_: number of classes.
        wdtype: dtype of the returned weights.
        weight_name: name of the weight argument, for error messages.
    """
    counts_t = torch.bincount(l.long(), minlength=V_)
    counts = counts_t.tolist()
    empty = [k for k, c in enumerate(counts) if c == 0]
    if empty:
        raise ValueError(
            f"{name} has empty classes {empty[:10]}{' ...' if len(empty) > 10 else ''}: every "
            f"class in 0 .. {V_ - 1} needs at least one point (labels are class indices; remap "
            f"sparse labels with torch.unique({name}, return_inverse=True))"
        )
    order = torch.argsort(l, stable=True)
    starts = torch.cumsum(counts_t, 0) - counts_t
    N = max(counts)
    j = torch.arange(N, device=l.device)
    last = (counts_t - 1)[:, None]
    index = order[starts[:, None] + torch.minimum(j[None, :], last)]
    valid = j[None, :] <= last
    if a is None:
        weight = valid.to(wdtype) / counts_t.to(wdtype)[:, None]
    else:
        w = a.to(wdtype)[index] * valid
        mass = w.sum(1, keepdim=True)
        bad = (mass[:, 0] <= 0).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"{weight_name} is zero on every point of classes {bad[:10]} of {name}: each "
                "class needs a positive total mass"
            )
        weight = w / mass
    return Classes(index, weight, counts)


def check_finite_clouds(*named: tuple[str, torch.Tensor]) -> None:
    """Raises for NaN or inf points, naming the dataset (one synchronisation for all)."""
    flags = torch.stack([~torch.isfinite(x.detach()).all() for _, x in named]).tolist()
    for (name, _), bad in zip(named, flags, strict=True):
        if bad:
            raise ValueError(f"{name} must not contain NaN or inf (or pass check_finite=False)")


def check_class_weights(name: str, a: object, x: torch.Tensor) -> torch.Tensor | None:
    """Per-point weights (n,) of a dataset: non-negative and finite (None: uniform per class)."""
    a = V.check_weights(name, a, x)
    if a is None:
        return None
    flags = torch.stack([(a < 0).any(), ~torch.isfinite(a).all()]).tolist()
    if flags[0]:
        raise ValueError(f"{name} must be non-negative")
    if flags[1]:
        raise ValueError(f"{name} must be finite")
    return a
