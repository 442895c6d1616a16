"""Kernel launches that skip Triton's argument binding once a kernel is compiled.

``kernel[grid](*args, **meta)`` spends most of its host time before the launch itself: Triton's
``JITFunction.run`` binds and specialises every argument, builds its cache key (a string of the
specialisation and of the options), looks the compiled kernel up, checks the kernel's globals
and assembles the launch metadata for the launch hooks. For a kernel that takes a few
microseconds on the GPU (the mHC projection of a small batch) this host path, about 28 µs a
call on an H100 host, is the whole cost. :class:`DirectLaunch` goes through that path once per
specialisation, keeps the ``CompiledKernel`` that Triton returns, and afterwards calls the
kernel's low-level launcher itself, as ``JITFunction.run`` does after its lookup::

    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *all_arguments)

with ``all_arguments`` every parameter of the kernel in declaration order, constexprs included
(the launcher skips them itself), and the hooks read from ``triton.knobs.runtime``. Releases
with ``triton.knobs`` share this convention (Triton 3.6 and 3.9 were read for this module);
older ones passed only the non-constexpr arguments and read the hooks from
``CompiledKernel``: without ``triton.knobs`` every launch takes the normal path.

What selects the compiled kernel, and how the direct path keeps it the same:

* compile-time arguments (constexprs, ``num_warps`` and the other options) are fixed when the
  :class:`DirectLaunch` is built and passed by keyword; the run-time arguments are positional;
* Triton specialises the run-time arguments on their type (tensor dtype; int width: 32-bit,
  64-bit or unsigned 64-bit; float; bool), on an int being 1 (made a constant), and on ints and
  tensor addresses being multiples of 16. The direct path computes a signature at least as fine
  as that on every call and keeps one compiled kernel per signature;
* the current device (a compiled kernel is loaded per device) and the Triton settings that
  ``JITFunction.run`` folds into the compile options (``knobs.runtime.debug``,
  ``knobs.compilation.instrumentation_mode``, ``knobs.compilation.fpsan_homomorphic_casts``)
  are part of that key too.

A signature seen for the first time is launched the normal way and its compiled kernel
adopted. The normal path is also taken, call by call, while Triton launch hooks are installed
(``knobs.runtime.launch_enter_hook``/``launch_exit_hook``, a profiler's), while a pre-run hook
or a pipeline-stages hook is set, inside :func:`._triton_launch.precompile_once`'s recording,
for a grid that is not a tuple, and for arguments other than plain device tensors, ints,
floats and bools. It is taken for good, for one :class:`DirectLaunch`, under the interpreter,
when the kernel or its compiled form lacks what the direct path uses, when Triton's binder
does not bind the arguments to exactly the objects the direct path would pass, and after a
direct launch raises ``TypeError``. Unlike ``JITFunction.run`` the direct path does not check
that the globals a kernel reads kept their values since it was compiled.
"""

from __future__ import annotations

import os
from operator import attrgetter
from typing import Any

import torch

from ._triton_launch import _RECORDING, launch

try:
    from triton import knobs as _knobs
except ImportError:  # no Triton, or one older than 3.4 (no knobs, other launcher convention)
    _knobs = None

__all__ = ["DirectLaunch"]

# Whether a tensor is on the device whose pointers the direct launcher takes; any other tensor
# sends the call through the normal path (which raises for it on a GPU backend). ``is_cuda``
# costs a sixth of ``device.type``.
_on_device = attrgetter("is_cuda")
_Tensor = torch.Tensor

_I32_MIN, _I32_MAX, _I64_MIN, _I64_MAX = -(2**31), 2**31 - 1, -(2**63), 2**63 - 1


def _cuda_queries():
    """(current device, current stream of a device) getters: Triton's own, so that the direct
    path launches on the device and stream the normal path would (Triton 3.6 and 3.9 read the
    stream with ``torch._C._cuda_getCurrentRawStream``, a C call, and fall back to
    ``torch.cuda.current_stream(device).cuda_stream``, which builds a Stream object)."""
    from triton.runtime import driver

    active = driver.active
    device = active.get_current_device
    if device is torch.cuda.current_device and torch.cuda.is_initialized():
        # the same value without current_device's lazy-initialisation wrapper (a third of a
        # microsecond per launch); CUDA is initialised, as a kernel was launched through Triton
        device = torch._C._cuda_getDevice
    return device, active.get_current_stream


def _hook_set(hook) -> bool:
    # Triton 3.6+ keeps an empty HookChain in the knob (truthy ``calls`` once a hook is added);
    # a callable assigned in its place, or an older Triton's hook, is not None.
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_state() -> tuple | None:
    """The Triton settings that ``JITFunction.run`` folds into the compiled kernel's key, or
    None while a hook wants to see (or reshape) every launch."""
    rt = _knobs.runtime
    if (
        _hook_set(rt.launch_enter_hook)
        or _hook_set(rt.launch_exit_hook)
        or getattr(rt, "add_stages_inspection_hook", None) is not None
    ):
        return None
    comp = _knobs.compilation
    return (
        rt.debug,
        getattr(comp, "instrumentation_mode", None),
        getattr(comp, "fpsan_homomorphic_casts", None),
    )


def _signature(args: tuple) -> tuple | None:
    """Per run-time argument, what Triton specialises the compiled kernel on (or finer); None
    for an argument the direct path does not pass."""
    sig = []
    for a in args:
        t = type(a)
        if t is _Tensor:
            if not _on_device(a):
                return None
            sig.append((a.dtype, a.data_ptr() & 15 == 0))
        elif t is int:
            if a == 1:
                sig.append(1)  # Triton makes it a constant
            else:
                # Triton's int types: i32, i64, and u64 above the i64 range
                wide = 0 if _I32_MIN <= a <= _I32_MAX else (1 if _I64_MIN <= a <= _I64_MAX else 2)
                sig.append((wide, a & 15 == 0))
        elif t is float or t is bool:
            sig.append(t)
        else:
            return None
    return tuple(sig)


class DirectLaunch:
    """``kernel[grid](*args, **meta)`` with ``meta`` fixed, launched without Triton's binder
    after the first call of each argument signature (see the module docstring).

    Args:
        kernel: A ``triton.jit`` function whose compile-time parameters (constexprs) are its
            last ones, all given in ``meta``; the run-time parameters are passed positionally
            to each call.
        **meta: Constexpr values and launch options (``num_warps``, ``enable_fp_fusion``, ...),
            copied: they fix every compile-time choice of the launches.
    """

    def __init__(self, kernel: Any, **meta: Any) -> None:
        self.kernel = kernel
        self.meta = dict(meta)
        # Under the interpreter a kernel is an InterpretedFunction, with no compiled form.
        self.enabled = (
            _knobs is not None
            and os.environ.get("TRITON_INTERPRET") != "1"
            and hasattr(kernel, "pre_run_hooks")
        )
        # (device, launch state, signature) ->
        #     (launcher, function, packed metadata, constexpr values, compiled kernel)
        self._launchers: dict = {}
        self._queries = None

    def __call__(self, grid: tuple, *args: Any) -> None:
        """Launches the kernel on ``grid`` (a tuple of 1 to 3 ints) with run-time ``args``."""
        if not self.enabled or _RECORDING.get() is not None or type(grid) is not tuple:
            launch(self.kernel, grid, *args, **self.meta)
            return
        state = _launch_state()
        sig = _signature(args)
        if state is None or sig is None or self.kernel.pre_run_hooks:
            self.kernel[grid](*args, **self.meta)
            return
        queries = self._queries
        if queries is None:
            self._launch_and_adopt(grid, args, state, sig)
            return
        device = queries[0]()
        hit = self._launchers.get((device, state, sig))
        if hit is None:
            self._launch_and_adopt(grid, args, state, sig)
            return
        run, function, packed, consts, _ = hit
        n = len(grid)
        try:
            # launch metadata and hooks: None, as JITFunction.run passes them with no hook set
            run(
                grid[0],
                grid[1] if n > 1 else 1,
                grid[2] if n > 2 else 1,
                queries[1](device),
                function,
                packed,
                None,
                None,
                None,
                *args,
                *consts,
            )
        except TypeError:
            # The launchers parse their arguments before launching: nothing ran. A calling
            # convention other than the one assumed here is not retried.
            self.enabled = False
            self.kernel[grid](*args, **self.meta)

    def _launch_and_adopt(self, grid: tuple, args: tuple, state: tuple, sig: tuple) -> None:
        """Launches the normal way and keeps the compiled kernel Triton chose for ``sig``."""
        compiled = self.kernel[grid](*args, **self.meta)
        try:
            if self._queries is None:
                self._queries = _cuda_queries()
            device = self._queries[0]()
            parts = self._parts(compiled, args, device)
        except Exception:  # a probe of Triton internals must not fail a launch that ran
            parts = None
        if parts is None:
            self.enabled = False
            return
        self._launchers[(device, state, sig)] = parts

    def _parts(self, compiled: Any, args: tuple, device: int) -> tuple | None:
        """(launcher, function, packed metadata, constexpr values, compiled kernel), or None
        when the direct arguments cannot be matched with Triton's own binding of them. The
        compiled kernel is kept: freeing it unloads the module that ``function`` lives in."""
        params = self.kernel.params
        n_run = len(args)
        if len(params) != n_run + sum(p.name in self.meta for p in params):
            return None
        if any(p.is_constexpr or p.name in self.meta for p in params[:n_run]):
            return None
        if not all(p.is_constexpr and p.name in self.meta for p in params[n_run:]):
            return None
        consts = tuple(self.meta[p.name] for p in params[n_run:])
        # Triton's binder (last entry of the per-device cache) gives the arguments in the
        # order the launcher receives them: they must be the very objects passed here.
        binder = self.kernel.device_caches[device][-1]
        bound = list(binder(*args, **self.meta)[0].values())
        direct = [*args, *consts]
        if len(bound) != len(direct) or any(b is not d for b, d in zip(bound, direct, strict=True)):
            return None
        run = compiled.run
        function = compiled.function
        if not callable(run) or not function:
            return None
        return run, function, compiled.packed_metadata, consts, compiled
