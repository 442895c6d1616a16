"""NumPy in, NumPy out for :func:`~flashsinkhorn.sinkhorn` and :func:`~flashsinkhorn.solve`.

A call whose points (or cost matrix) are NumPy arrays is solved on the CPU with tensors that
share the arrays' memory (nothing the caller owns is written to), in the arrays' own dtype
(float64 stays float64), and returns a :class:`NumpyResult`: the same result whose arrays are
NumPy (docs/conventions.md lists them). Every array argument of such a call must be a NumPy
array: a torch tensor among NumPy arrays, or an array among tensors, is a ``TypeError`` that
names it, rather than a silent copy to one side.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ._validation import describe
from .result import SinkhornResult


def _tensor(name: str, v: np.ndarray) -> torch.Tensor:
    if not v.flags.writeable:
        v = v.copy()  # torch.from_numpy warns on read-only memory; the solve never writes
    try:
        return torch.from_numpy(v)
    except TypeError as e:  # object, string, complex-with-odd-layout arrays …
        raise TypeError(f"{name} must be a numeric array, got dtype {v.dtype}") from e


def _array(t: torch.Tensor, scalar: bool = False):
    out = t.detach().cpu().numpy()
    return out[()] if scalar and out.ndim == 0 else out


def _check_array(name: str, v: object, kind: str) -> None:
    mixed = isinstance(v, torch.Tensor) if kind == "numpy" else isinstance(v, np.ndarray)
    if mixed:
        other = "a torch.Tensor" if kind == "numpy" else "a NumPy array"
        first = "NumPy arrays" if kind == "numpy" else "torch tensors"
        raise TypeError(
            f"{name} is {other} while the other arrays of the call are {first}: pass all of "
            "them as torch tensors (any device) or all as NumPy arrays (solved on the CPU)"
        )


def numpy_io(names: Sequence[str]) -> Callable:
    """Decorator: converts the NumPy array arguments ``names`` (the first decides the call's
    kind) to tensors and the result to a :class:`NumpyResult`; a call without NumPy arrays
    runs unchanged."""

    def wrap(fn):
        import inspect

        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not any(isinstance(v, np.ndarray) for v in (*args, *kwargs.values())):
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            given = bound.arguments
            kind = "numpy" if isinstance(given.get(names[0]), np.ndarray) else "torch"
            for name in names:
                v = given.get(name)
                if v is not None:
                    _check_array(name, v, kind)
                    if kind == "numpy":
                        given[name] = _tensor(name, v)
            if kind == "torch":
                return fn(*bound.args, **bound.kwargs)  # (no array left: _check_array)
            return NumpyResult.of(fn(*bound.args, **bound.kwargs))

        return wrapper

    return wrap


class NumpyResult(SinkhornResult):
    """A :class:`~flashsinkhorn.SinkhornResult` of NumPy inputs, with NumPy arrays.

    ``f`` and ``g`` are ``numpy.ndarray``; ``value`` and ``marginal_error`` a NumPy scalar
    (``numpy.float64`` for float64 inputs), or a (B,) array for a batch; ``marginals()``,
    ``apply(V)``, ``apply_T(U)``, ``barycentric_map()`` and ``plan()`` return arrays and
    take ``V`` and ``U`` as arrays. The dtype is that of the potentials: the inputs' own for
    float32 and float64. ``errors`` and the other attributes are as in the base class, and
    ``solution`` (what the operators read) keeps its tensors.
    """

    @classmethod
    def of(cls, res: SinkhornResult) -> NumpyResult:
        """The NumPy view of a result (its tensors converted once, on the CPU)."""
        out = cls.__new__(cls)
        out.__dict__.update(res.__dict__)
        scalar = res.f.dim() == 1
        out._arrays = (_array(res.f), _array(res.g))
        out.value = _array(res.value, scalar)
        return out

    @property
    def f(self):
        return self._arrays[0]

    @property
    def g(self):
        return self._arrays[1]

    @property
    def marginal_error(self):
        return _array(SinkhornResult.marginal_error.fget(self), self.f.ndim == 1)

    def marginals(self):
        ra, rb = super().marginals()
        return _array(ra), _array(rb)

    def apply(self, V):
        return _array(super().apply(self._values_in("V", V)))

    def apply_T(self, U):
        return _array(super().apply_T(self._values_in("U", U)))

    def barycentric_map(self):
        return _array(super().barycentric_map())

    def plan(self, max_elements: int = 1 << 26):
        return _array(super().plan(max_elements))

    @staticmethod
    def _values_in(name: str, v: object) -> torch.Tensor:
        if not isinstance(v, np.ndarray):
            raise TypeError(
                f"{name} must be a NumPy array (this result is of NumPy inputs), got {describe(v)}"
            )
        return _tensor(name, v)
