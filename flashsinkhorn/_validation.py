"""Argument checks shared by the public entry points.

Every check raises a ``ValueError`` or ``TypeError`` that names the argument and says what is
allowed, before any kernel is launched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Integral, Real

import numpy as np
import torch

SCHEDULES = ("auto", "symmetric", "alternating")
ACCELERATIONS = ("auto", "none", "overrelax", "anderson")
BACKENDS = ("auto", "torch", "triton")
PRECISIONS = ("auto", "ieee", "tf32", "tf32x3")
PATHS = ("auto", "streaming", "dense", "multiscale")


def _check_array(name: str, x: object, lead: str, tail: str) -> torch.Tensor:
    """A non-empty real floating tensor of shape (lead, tail) or (B, lead, tail) with data."""
    shapes = f"({lead}, {tail}) or (B, {lead}, {tail})"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shapes}, got {type(x).__name__}")
    if x.is_complex() or not x.is_floating_point():
        raise TypeError(
            f"{name} must have a real floating dtype (float16, bfloat16, float32, float64), "
            f"got {x.dtype}"
        )
    if x.dim() not in (2, 3):
        raise ValueError(
            f"{name} must be 2-D ({lead}, {tail}) or 3-D (B, {lead}, {tail}), got shape "
            f"{tuple(x.shape)}"
        )
    if any(s == 0 for s in x.shape):
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    if x.device.type == "meta":
        raise ValueError(
            f"{name} is a meta tensor (a shape without data): the solvers compute values, "
            "pass a tensor on the CPU or a CUDA device"
        )
    return x


def check_points(name: str, x: object) -> torch.Tensor:
    """Checks that ``x`` is a non-empty real floating tensor of shape (n, d) or (B, n, d)."""
    return _check_array(name, x, "n", "d")


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


def describe(v: object) -> str:
    """A short description of a value's type for error messages (dtype and shape of arrays)."""
    if isinstance(v, (torch.Tensor, np.ndarray)):
        return f"a {type(v).__name__} of dtype {v.dtype} and shape {tuple(v.shape)}"
    return type(v).__name__


def as_real(name: str, v: object, allowed: str) -> float:
    """``v`` as a Python float: an int or float, a NumPy scalar or a 0-d real tensor.

    ``bool`` (Python, NumPy or a bool tensor) is refused: ``True`` is not a number here.
    Integers too large for a float become ``inf`` (the caller's range check rejects them).

    Args:
        name: the argument's name, for the message.
        v: the value.
        allowed: what the argument accepts, e.g. "a finite positive number".

    Raises:
        TypeError: not a real number.
        ValueError: a tensor or array with more than zero dimensions.
    """
    if isinstance(v, (torch.Tensor, np.ndarray)):
        if v.ndim != 0:
            raise ValueError(
                f"{name} must be {allowed} (a number or a 0-d tensor), got a "
                f"{type(v).__name__} of shape {tuple(v.shape)}"
            )
        if isinstance(v, torch.Tensor):
            if v.dtype == torch.bool or v.is_complex():
                raise TypeError(f"{name} must be {allowed}, got a tensor of dtype {v.dtype}")
            if v.device.type == "meta":
                raise ValueError(f"{name} must be {allowed}, got a meta tensor (it has no value)")
        v = v.item()
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, Real):
        raise TypeError(f"{name} must be {allowed}, got {type(v).__name__}")
    try:
        return float(v)
    except OverflowError:  # an int beyond the float range
        return math.inf if v > 0 else -math.inf


def check_positive(name: str, v: object, *, allow_none: bool = False) -> float | None:
    """Checks that ``v`` is a finite positive real number (or None when allowed)."""
    if v is None and allow_none:
        return None
    allowed = "a finite positive number" + (" or None" if allow_none else "")
    v = as_real(name, v, allowed)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {v}")
    return v


def check_nonnegative(name: str, v: object) -> float:
    """Checks that ``v`` is a finite real number >= 0."""
    v = as_real(name, v, "a finite number >= 0")
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {v}")
    return v


def check_finite(name: str, v: object) -> float:
    """Checks that ``v`` is a finite real number (any sign)."""
    v = as_real(name, v, "a finite number")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def check_int(name: str, v: object, minimum: int) -> int:
    """Checks that ``v`` is an integer >= ``minimum``: a Python or NumPy integer, or a 0-d
    integer tensor (``bool`` and floats, even integral ones, are refused)."""
    if isinstance(v, torch.Tensor) and v.ndim == 0 and v.device.type != "meta":
        integral = not (v.dtype == torch.bool or v.is_floating_point() or v.is_complex())
        v = v.item() if integral else v
    elif isinstance(v, np.ndarray) and v.ndim == 0 and np.issubdtype(v.dtype, np.integer):
        v = v.item()
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {describe(v)}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def check_bool(name: str, v: object) -> bool:
    """Checks that ``v`` is ``True`` or ``False`` (a Python or NumPy bool); a truthy value of
    another type (``'no'``, ``None``, ``1``) is refused rather than read as a flag."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool (True or False), got {describe(v)}")
    return bool(v)


def check_divergence_rho(rho_x: float | None, rho_y: float | None) -> None:
    """A Sinkhorn divergence needs the same relaxation on both marginals (checked values).

    With rho_x != rho_y, OT(a, b) != OT(b, a) and no combination of the self terms gives both
    S(a, a) = 0 and S >= 0 (docs/transport.md, "Unbalanced divergences"), so it is refused.
    """
    if rho_x != rho_y:
        raise ValueError(
            "a Sinkhorn divergence needs rho_x == rho_y: both None (balanced) or the same "
            f"number (unbalanced), got rho_x={rho_x!r} and rho_y={rho_y!r}; with a relaxation "
            "on one side only (or two different ones) the debiased loss is neither zero at "
            "a = b nor nonnegative. Use ot_cost for semi-unbalanced or asymmetric OT"
        )


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
    return _check_array(name, C, "n", "m")


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


def check_progress(progress: object) -> bool | Callable | None:
    """``progress``: None/False (off), True (a progress bar) or a callable(iteration, error).

    The report comes at the convergence tests, so it needs a tolerance: the refusal of
    ``tol=None`` with it is ``option_table.check_combination``'s.
    """
    if progress is None or progress is False:
        return None
    if progress is not True and not callable(progress):
        raise TypeError(
            "progress must be None, a bool, or a callable progress(iteration, error); got "
            f"{describe(progress)}"
        )
    return progress
