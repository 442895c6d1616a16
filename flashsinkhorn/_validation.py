"""Argument checks shared by the public entry points.

Every check raises a ``ValueError`` or ``TypeError`` that names the argument and says what is
allowed, before any kernel is launched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import torch

SCHEDULES = ("auto", "symmetric", "alternating")
ACCELERATIONS = ("auto", "none", "overrelax", "anderson")
BACKENDS = ("auto", "torch", "triton")
PRECISIONS = ("auto", "ieee", "tf32", "tf32x3")
PATHS = ("auto", "streaming", "dense")


def check_points(name: str, x: object) -> torch.Tensor:
    """Checks that ``x`` is a non-empty real floating tensor of shape (n, d) or (B, n, d)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape (n, d) or (B, n, d), got {type(x)}"
        )
    if x.is_complex() or not x.is_floating_point():
        raise TypeError(
            f"{name} must have a real floating dtype (float16, bfloat16, float32, float64), "
            f"got {x.dtype}"
        )
    if x.dim() not in (2, 3):
        raise ValueError(f"{name} must be 2-D (n, d) or 3-D (B, n, d), got shape {tuple(x.shape)}")
    if any(s == 0 for s in x.shape):
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    return x


def check_pair(x: torch.Tensor, y: torch.Tensor) -> None:
    """Checks that the two clouds agree in rank, batch size, feature size, dtype and device."""
    if x.dim() != y.dim():
        raise ValueError(
            f"x and y must both be 2-D (n, d) or both 3-D (B, n, d), got shapes "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"x and y must have the same feature dimension d, got {x.shape[-1]} and {y.shape[-1]}"
        )
    if x.dim() == 3 and x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x and y must have the same batch size B, got {x.shape[0]} and {y.shape[0]}"
        )
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must have the same dtype, got {x.dtype} and {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"x and y must be on the same device, got {x.device} and {y.device}")


def check_weights(name: str, w: object, points: torch.Tensor) -> torch.Tensor | None:
    """Checks a weight vector against its cloud; returns it reshaped to (n,) or (B, n).

    Accepted shapes: (n,) or (n, 1) for a 2-D cloud; (B, n), (B, n, 1) or a shared (n,) for a
    batched cloud. Negativity and finiteness are checked later in one device synchronisation.
    """
    if w is None:
        return None
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of weights or None, got {type(w)}")
    if w.is_complex() or not w.is_floating_point():
        raise TypeError(f"{name} must have a real floating dtype, got {w.dtype}")
    if w.device != points.device:
        raise ValueError(
            f"{name} must be on the device of its points ({points.device}), got {w.device}"
        )
    n = points.shape[-2]
    if w.dim() >= 1 and w.shape[-1] == 1 and w.dim() == points.dim():
        w = w[..., 0]
    if points.dim() == 2:
        ok = w.shape == (n,)
    else:
        ok = w.shape in ((n,), (points.shape[0], n))
    if not ok:
        allowed = "(n,)" if points.dim() == 2 else "(B, n) or (n,)"
        raise ValueError(
            f"{name} must have shape {allowed} matching its points of shape "
            f"{tuple(points.shape)}, got {tuple(w.shape)}"
        )
    return w


def check_positive(name: str, v: object, *, allow_none: bool = False) -> float | None:
    """Checks that ``v`` is a finite positive real number (or None when allowed)."""
    if v is None and allow_none:
        return None
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(
                f"{name} must be a positive number, got a tensor of shape {tuple(v.shape)}"
            )
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, Real):
        allowed = "a finite positive number" + (" or None" if allow_none else "")
        raise TypeError(f"{name} must be {allowed}, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {v}")
    return v


def check_int(name: str, v: object, minimum: int) -> int:
    """Checks that ``v`` is an integer >= ``minimum``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def check_choice(name: str, v: object, choices: Sequence[str]) -> str:
    """Checks that ``v`` is one of ``choices``."""
    if not isinstance(v, str) or v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {v!r}")
    return v


def check_scaling(scaling: object, allow_auto: bool = False) -> float | str | None:
    """Checks the annealing factor: None (fixed eps), a number in (0, 1), or "auto" where
    allowed (chosen with the schedule)."""
    if scaling is None:
        return None
    if allow_auto and isinstance(scaling, str):
        if scaling != "auto":
            raise ValueError(f"scaling must be 'auto', None or a number in (0, 1), got {scaling!r}")
        return scaling
    s = check_positive("scaling", scaling)
    if s >= 1:
        raise ValueError(f"scaling must be in (0, 1) or None, got {s}")
    return s


def check_cost_matrix(name: str, C: object) -> torch.Tensor:
    """Checks that ``C`` is a non-empty real floating tensor of shape (n, m) or (B, n, m).

    Its values (NaN/inf) are checked later, with the weights', in one device synchronisation.
    """
    if not isinstance(C, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape (n, m) or (B, n, m), got {type(C).__name__}"
        )
    if C.is_complex() or not C.is_floating_point():
        raise TypeError(
            f"{name} must have a real floating dtype (float16, bfloat16, float32, float64), "
            f"got {C.dtype}"
        )
    if C.dim() not in (2, 3):
        raise ValueError(f"{name} must be 2-D (n, m) or 3-D (B, n, m), got shape {tuple(C.shape)}")
    if any(s == 0 for s in C.shape):
        raise ValueError(f"{name} must not be empty, got shape {tuple(C.shape)}")
    return C


def check_matrix_weights(name: str, w: object, C: torch.Tensor, dim: int) -> torch.Tensor | None:
    """Checks the weights of the rows (``dim=-2``, ``a``) or columns (``dim=-1``, ``b``) of a
    cost matrix: (k,) for a 2-D C, (B, k) or a shared (k,) for a batched one, with k = C's size
    along ``dim``. Negativity and finiteness are checked later with C's values."""
    if w is None:
        return None
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of weights or None, got {type(w).__name__}")
    if w.is_complex() or not w.is_floating_point():
        raise TypeError(f"{name} must have a real floating dtype, got {w.dtype}")
    if w.device != C.device:
        raise ValueError(f"{name} must be on the device of C ({C.device}), got {w.device}")
    k = C.shape[dim]
    what = "rows" if dim == -2 else "columns"
    if C.dim() == 2:
        ok, allowed = w.shape == (k,), f"({k},)"
    else:
        ok = w.shape in ((k,), (C.shape[0], k))
        allowed = f"({C.shape[0]}, {k}) or ({k},)"
    if not ok:
        raise ValueError(
            f"{name} must have shape {allowed}, one weight per {what[:-1]} of C of shape "
            f"{tuple(C.shape)}, got {tuple(w.shape)}"
        )
    return w
