"""Implementation switches: one object that holds every choice a user never needs to make.

Each field selects between two implementations that give the same numbers (up to rounding):
the default is the faster one measured on Hopper GPUs; the other is kept because tests pin both
(and a kernel engineer may want to compare them). Nothing here changes the mathematics of a
solve. Read the fields as ``TUNING.<name>``; change them for a block with :func:`override`,
which restores the previous values on exit, also on error.

The switches in force live in a context variable, not in a process global: an override holds
in the thread (or asyncio task) that set it and in the backward passes that thread runs,
also on an autograd worker thread (PyTorch hands the context that called ``backward`` to its
device threads); another thread keeps its own switches (the defaults unless it overrides
them).

>>> from flashsinkhorn import tuning
>>> with tuning.override(solve_graphs=False):
...     pass  # fixed-iteration solves launch from Python here
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ._compile_marks import assume_constant_result


@dataclass
class Tuning:
    """The switches, with their defaults.

    Attributes:
        solve_graphs: capture fixed-iteration solves on CUDA as graphs and replay them
            (solvers/graphs.py). False: every launch from Python.
        max_solve_graphs: graphs kept by that cache (least recently used evicted).
        tolerance_graphs: with a tolerance on CUDA, replay the blocks of iterations between
            two convergence tests from a CUDA graph captured once per solve
            (solvers/blocks.py). False: every launch from Python.
        cg_graphs: capture the conjugate-gradient blocks of the HVP as CUDA graphs.
        prepare_path: where the canonical problem is computed: "auto" (Triton launches for
            float32 CUDA clouds, torch otherwise), "triton" (also on CPU under the
            interpreter) or "torch".
        prepare_graphs: replay the Triton prepare launches from a CUDA graph.
        plan_step: the symmetric step reads both soft-mins off one plan sweep where eligible
            (backends/triton/plan.py). False: two soft-min sweeps (one fused launch).
        plan_half: the alternating half-steps from an iterate read the soft-min off the row
            sums of the plan, shifted by the old potential (plan.py ``half_step``). False:
            the online-LSE sweep.
        hopper_half: on Hopper GPUs that half-step's sweep runs as the Gluon kernel that
            overlaps each tile's tensor-core product with the previous tile's exponentials
            (backends/triton/half_hopper.py). Off by default: on the H200 it was 4-25 % slower
            than the plain sweep at d = 64 and 128 (the sweep is bound by instruction issue,
            not by the product; docs/performance.md).
        softmin_split: force the number of column chunks of a split soft-min sweep; None lets
            the occupancy policy decide.
        transport_split: the same for the transport (P @ V) sweeps.
        wave_split: the soft-min, plan half-step and transport sweeps are split to fill whole
            waves of resident blocks. False: about four programs per SM.
        inplace_merge: split transport sweeps merge their partials into the output in chunk
            order. False: per-chunk partial buffers and a combine launch.
        fp16_grad: at precision "tf32" the envelope gradient multiplies the probability tile
            by the column points as a float16 tensor-core dot. False: a TF32 dot.
        pv16: at precision "tf32" P·V multiplies the probability tile (float16 times 2^15) by
            V split into float16 hi and lo parts per column scale, for whole value tiles (p a
            power of two from 16). False: a TF32 dot.
        global_labels: read the label cost from global memory even when it fits on chip.
        mhc_fused_dx: the mHC layer's backward fuses the residual input gradient.
        mhc_gemm_phi_t: the mHC layer's projection GEMM reads the transposed weight.
        mhc_small_bwd: generator options of the mHC projection backward (see mhc/docs).
        mhc_gen_hs_max: largest half-block of the generated mHC kernels.
    """

    solve_graphs: bool = True
    max_solve_graphs: int = 16
    tolerance_graphs: bool = True
    cg_graphs: bool = True
    prepare_path: str = "auto"
    prepare_graphs: bool = True
    plan_step: bool = True
    plan_half: bool = True
    hopper_half: bool = False
    softmin_split: int | None = None
    transport_split: int | None = None
    wave_split: bool = True
    inplace_merge: bool = True
    fp16_grad: bool = True
    pv16: bool = True
    global_labels: bool = False
    mhc_fused_dx: bool = True
    mhc_gemm_phi_t: bool = True
    mhc_small_bwd: tuple = (20, True, False, 1, False, True, True, 10)
    mhc_gen_hs_max: int = 64


_FIELDS = frozenset(f.name for f in dataclasses.fields(Tuning))

_DEFAULTS = Tuning()
#: The switches of this context (unset: the defaults).
_SWITCHES: contextvars.ContextVar[Tuning] = contextvars.ContextVar("flashsinkhorn_tuning")
#: Weak references (by ``id``) to every switches object set in a context and still alive. A
#: context that holds switches keeps their object alive, so while this is empty no context
#: anywhere (a backward's launching context included) holds any, and a read in a context
#: without switches of its own needs no look-up of a launching context. After a ``with
#: override(...)`` block it empties again, where a flag that only ever turned on had made
#: every later read pay for the look-up.
_LIVE: dict[int, weakref.ref] = {}


def _no_key(key: str) -> bool:
    return False


#: Whether PyTorch keeps an object under ``key`` in this thread's state (a launching context:
#: an autograd worker thread running a backward); a torch without it keeps none.
_IN_TLS = getattr(torch._C, "_is_key_in_tls", _no_key)


def _launching_context() -> contextvars.Context | None:
    """The context of the thread that called ``backward``, which PyTorch keeps in the thread
    state of its autograd worker threads (torch 2.13 does), or None."""
    c = torch._C
    try:
        if c._is_key_in_tls("context"):
            return c._get_obj_in_tls("context")
    except (AttributeError, RuntimeError):  # a torch without it
        pass
    return None


def current() -> Tuning:
    """The switches in force here: this context's, else (on an autograd worker thread) those
    of the context that called ``backward``, else the defaults. Treat it as read-only."""
    got = _SWITCHES.get(None)
    if got is not None:
        return got
    if not (_LIVE and _IN_TLS("context")):
        return _DEFAULTS
    launch = _launching_context()
    got = None if launch is None else launch.get(_SWITCHES)
    return _DEFAULTS if got is None else got


def _set(switches: Tuning) -> contextvars.Token:
    key = id(switches)
    _LIVE[key] = weakref.ref(switches, lambda _, key=key: _LIVE.pop(key, None))
    return _SWITCHES.set(switches)


class _InForce:
    """``TUNING``: attribute reads give the switches in force in the calling context
    (:func:`current`); an attribute write sets one for the rest of this context (what
    ``monkeypatch.setattr`` does; :func:`override` scopes a change to a block)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        if name not in _FIELDS:
            raise AttributeError(f"unknown tuning switch {name!r}; known: {sorted(_FIELDS)}")
        _set(replace(current(), **{name: _checked(name, value)}))

    def __repr__(self) -> str:
        return repr(current())


@assume_constant_result
def _traced_read(name: str):
    # Dynamo cannot trace ContextVar.get: under torch.compile a switch is read once, when the
    # code is traced, and compiled in as a constant (torch.compile(fullgraph=True) of the mHC
    # layer reads mhc_fused_dx in its forward).
    return getattr(current(), name)


def _reader(name: str) -> property:
    # A property per switch: a read costs one context-variable look-up, where a __getattr__
    # fallback first raised and caught an AttributeError (about 10x slower). A context without
    # switches of its own returns the default itself unless some context holds switches
    # (_LIVE) and PyTorch keeps a launching context here (a C call of 0.3 µs): once switches
    # had been set anywhere in the process, every such read had gone through current() and
    # _launching_context() (0.70 against 0.35 µs a read on a 2-core CPU).
    default = getattr(_DEFAULTS, name)

    def read(
        self,
        _get=_SWITCHES.get,
        _field=operator.attrgetter(name),
        _compiling=torch.compiler.is_compiling,
        _in_tls=_IN_TLS,
    ):
        if _compiling():
            return _traced_read(name)
        got = _get(None)
        if got is not None:
            return _field(got)
        if _LIVE and _in_tls("context"):
            return _field(current())
        return default

    return property(read)


for _name in _FIELDS:
    setattr(_InForce, _name, _reader(_name))

#: The switches in force (read ``TUNING.<name>``).
TUNING = _InForce()


def _checked(name: str, value: object) -> object:
    """A switch's value checked against the type of its default."""
    from . import _validation as V

    default = getattr(Tuning, name)
    if isinstance(default, bool):
        return V.check_bool(name, value)
    if isinstance(default, int) or name in ("softmin_split", "transport_split"):
        return None if value is None and default is None else V.check_int(name, value, 1)
    if name == "prepare_path":
        return V.check_choice(name, value, ("auto", "triton", "torch"))
    return value


def keep_for_backward(ctx) -> None:
    """Keeps on an ``autograd.Function``'s ``ctx`` the switches set in the forward's context:
    a torch that does not hand the context that called ``backward`` to its device threads
    (before 2.13) then runs the backward with them (:func:`in_backward`)."""
    if _LIVE:
        got = _SWITCHES.get(None)
        if got is not None:
            ctx.tuning_switches = got


@contextlib.contextmanager
def in_backward(ctx) -> Iterator[None]:
    """The switches of a backward: this thread's own, else the launching context's, else
    those :func:`keep_for_backward` kept at forward, else the defaults."""
    kept = getattr(ctx, "tuning_switches", None)
    launch = None if kept is None else _launching_context()
    if (
        kept is None
        or _SWITCHES.get(None) is not None
        or (launch is not None and launch.get(_SWITCHES) is not None)
    ):
        yield
        return
    token = _SWITCHES.set(kept)
    try:
        yield
    finally:
        _SWITCHES.reset(token)


@contextlib.contextmanager
def override(**changes) -> Iterator[_InForce]:
    """Sets some switches for the duration of a ``with`` block in this context (thread or
    task, and the backward passes it runs), then restores them.

    Raises:
        ValueError: for a name that is not a field of :class:`Tuning`, or a value out of range.
        TypeError: for a value of the wrong type (a switch is a bool, a count an int).
    """
    unknown = sorted(set(changes) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown tuning switch(es) {unknown}; known: {sorted(_FIELDS)}")
    changes = {k: _checked(k, v) for k, v in changes.items()}
    token = _set(replace(current(), **changes))
    try:
        yield TUNING
    finally:
        _SWITCHES.reset(token)
