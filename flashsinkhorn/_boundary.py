"""How the public entry points meet ``torch.compile`` and ``torch.autocast``.

**torch.compile.** A solve is host-driven: a Python loop whose length depends on convergence
tests read back from the device, cached CUDA graphs, Triton launchers and validation that
raises on values. Dynamo must not trace it, so every entry point is wrapped in
``torch.compiler.disable`` (applied once Dynamo is loaded, so that importing the library
does not import it: ``_compile_marks``): a compiled function breaks its graph at the call, the
solve runs eagerly (its ``autograd.Function`` backward too), and the code before and after the
call is compiled as usual. ``fullgraph=True`` therefore refuses a function that calls the library.

**autocast.** Autocast would run the solver's own matmuls (scores, centring) in float16 or
bfloat16 and ruin the potentials. The entry points behave like autocast's float32 ops
(``cdist``, ``mse_loss``): under an active autocast of a tensor's device type, its float16 and
bfloat16 inputs are cast to float32 (a differentiable cast: their gradients come back in their
own dtype), and the solve runs with autocast disabled. The result is what the same call gives
without autocast on the float32 inputs. Outside autocast, half-precision inputs keep their own
path (fp32 accumulation on half points; docs/conventions.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from . import _compile_marks, tuning

F = TypeVar("F", bound=Callable)

_HALF = (torch.float16, torch.bfloat16)
#: What Dynamo reports for the graph break (``fullgraph=True`` shows it).
_REASON = "flashsinkhorn solves run eagerly (host-driven convergence loop)"
#: Device types whose autocast the entry points turn off (the devices the library runs on).
_DEVICE_TYPES = ("cpu", "cuda")


def _autocast_on() -> list[str]:
    return [d for d in _DEVICE_TYPES if torch.is_autocast_enabled(d)]


@contextlib.contextmanager
def autocast_off():
    """Disables autocast on every device type where it is active, for the block."""
    on = _autocast_on()
    if not on:
        yield
        return
    with contextlib.ExitStack() as stack:
        for device_type in on:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def _to_float32(v, on: list[str]):
    if isinstance(v, torch.Tensor) and v.dtype in _HALF and v.device.type in on:
        return v.float()
    return v


def entry_point(fn: F) -> F:
    """Wraps a public function (or method) for torch.compile and autocast (module doc)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        on = _autocast_on()
        if not on:
            return fn(*args, **kwargs)
        args = tuple(_to_float32(v, on) for v in args)
        kwargs = {k: _to_float32(v, on) for k, v in kwargs.items()}
        with autocast_off():
            return fn(*args, **kwargs)

    return _compile_marks.disable(wrapper, _REASON)


def backward_autocast_off(backward: F) -> F:
    """Runs an ``autograd.Function.backward`` with autocast disabled (a backward called inside
    an autocast region would otherwise run the transport matmuls in half precision) and with
    the tuning switches of its forward where torch gives its device thread no others
    (``tuning.keep_for_backward``, called by the forward)."""

    @functools.wraps(backward)
    def wrapper(ctx, *args, **kwargs):
        with autocast_off(), tuning.in_backward(ctx):
            return backward(ctx, *args, **kwargs)

    return wrapper
