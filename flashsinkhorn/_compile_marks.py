"""``torch.compile`` markers that do not import ``torch._dynamo`` when they are applied.

``torch.compiler.disable`` and ``torch.compiler.assume_constant_result`` import
``torch._dynamo`` (and with it most of ``torch.fx``, ``torch.distributed`` and sympy) when
they decorate a function: 1.8 s of the 2.3 s that ``import flashsinkhorn`` took after
``import torch`` on a 2-core CPU (docs/performance.md). Dynamo reads both markers as plain
attributes of the function object when it traces a call to it (``_torchdynamo_disable`` and
``_torchdynamo_disable_msg`` on a disabled function, ``_dynamo_marked_constant`` on a constant
one; ``tests/test_compile_marks.py`` compares them with what the real decorators set). So the
functions here set those attributes at definition, and a disabled function applies the real
``torch.compiler.disable`` at its first call after Dynamo was imported. Before that nothing
can be compiling (only Dynamo's Python package installs a frame-evaluation callback), so the
function runs as it is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

_DYNAMO = "torch._dynamo"


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: a traced call of ``fn`` runs while
    Dynamo traces and its result is compiled in as a constant. Returns ``fn``, marked."""
    fn._dynamo_marked_constant = True
    return fn


def disable(fn: F, reason: str) -> F:
    """``torch.compiler.disable(fn, reason=reason)``: a compiled function breaks its graph at
    a call to the result (``fullgraph=True`` raises, naming ``reason``), and ``fn`` runs
    eagerly, with every function it calls.

    Returns:
        A function with ``fn``'s name and signature. Until ``torch._dynamo`` is imported it
        calls ``fn``; from its first call after that, the function that
        ``torch.compiler.disable`` makes of ``fn``.
    """
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if _DYNAMO not in sys.modules:
                return fn(*args, **kwargs)
            disabled = _disabled(fn, reason)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True
    call._torchdynamo_disable_msg = reason
    return call


def _disabled(fn: Callable, reason: str) -> Callable:
    import torch._dynamo.eval_frame

    for code in _UNTRACED:  # a no-op where _skip_frames could mark them
        torch._dynamo.eval_frame.skip_code(code)
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # older torch: no ``reason`` argument
        return torch.compiler.disable(fn)


#: Code that Dynamo's frame callback must not trace: a compiled function runs ``call`` after
#: its graph break, with the callback still installed (``torch.compiler.disable``'s own
#: wrapper lives in ``torch/_dynamo``, whose frames Dynamo skips by file). Traced, ``call``
#: would compile a frame for each entry point called and count every one as a recompilation
#: of one code object.
_UNTRACED = (disable(lambda: None, "").__code__, _disabled.__code__)


def _skip_frames() -> None:
    """Marks :data:`_UNTRACED` as ``torch._dynamo.eval_frame.skip_code`` does, through
    PyTorch's C extension (loaded with ``torch``); where this torch lacks those names,
    :func:`_disabled` marks them when Dynamo is loaded."""
    try:
        from torch._C._dynamo import eval_frame as C

        if hasattr(C, "set_code_exec_strategy"):
            strategy = C._FrameExecStrategy(C._FrameAction.SKIP, C._FrameAction.DEFAULT)
            for code in _UNTRACED:
                C.set_code_exec_strategy(code, strategy)
        else:  # torch < 2.7: the C extension marks a code object directly
            for code in _UNTRACED:
                C.skip_code(code)
    except (ImportError, AttributeError, TypeError, RuntimeError):
        pass


_skip_frames()
