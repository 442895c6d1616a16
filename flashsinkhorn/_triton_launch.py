"""Compile options that every Triton launch of the library passes explicitly.

FMA contraction: Triton 3.9 warns when a kernel is compiled without an explicit
``enable_fp_fusion`` and announces that its default turns off in Triton 3.10. Every kernel here
was tuned (instruction counts, register budgets) and validated with a·b + c contracted to one
FFMA, so the option is pinned rather than left to the installed Triton's default.
``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns it off for debugging.

Also the host-side arithmetic of launch grids (cheaper than Triton's constexpr functions), and
the parallel compilation of a step's kernels on first use.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

import torch

FP_FUSION = {"enable_fp_fusion": True}


# Host-side grid arithmetic. Since Triton 3.5 ``triton.cdiv`` and ``triton.next_power_of_2`` are
# constexpr functions (usable inside kernels); called from the host they go through that
# wrapper at ~5 µs a call, and one solve makes about a hundred of them.


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative a and positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_SMS: dict[int, int] = {}


def cuda_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, cached (``get_device_properties`` costs
    ~10 µs, and launches plan their grids with it)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(idx)
    if sms is None:
        sms = _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return sms


# Parallel compilation. A step's kernels are compiled on first use, one after the other, and
# the plan step (four kernels) made the first call of a process 2-4 s slower. Triton releases
# the GIL in its LLVM passes and runs ptxas as a subprocess, so compiles of different kernels
# overlap in threads (bench/results/dev/s18_compile_h200.jsonl: 4.6 s one after the other,
# 2.9 s in two threads). ``precompile_once`` runs a launching function once in a recording
# mode, compiles what it would launch in a thread pool (``JITFunction.warmup``: compile, no
# launch), and the real call that follows finds every kernel compiled.

_RECORDING: ContextVar[list | None] = ContextVar("flashsinkhorn_recording", default=None)
_PRECOMPILED: set = set()


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or only recorded inside :func:`precompile_once`."""
    pending = _RECORDING.get()
    if pending is None:
        kernel[grid](*args, **kwargs)
    else:
        pending.append((kernel, grid, args, kwargs))


def precompile_once(key, fn, *args, **kwargs) -> None:
    """On the first call with ``key`` (per process), compiles the kernels that ``fn(*args,
    **kwargs)`` launches through :func:`launch`, in parallel threads; later calls return at
    once. ``fn`` runs once with its launches recorded, not executed: its other work (output
    allocations) must be side-effect free. Does nothing under the interpreter."""
    if key in _PRECOMPILED or os.environ.get("TRITON_INTERPRET") == "1":
        return
    pending: list = []
    token = _RECORDING.set(pending)
    try:
        fn(*args, **kwargs)
    finally:
        _RECORDING.reset(token)
    if pending:
        with ThreadPoolExecutor(max_workers=min(8, len(pending))) as pool:
            futures = [
                pool.submit(lambda k=k, g=g, a=a, kw=kw: k.warmup(*a, grid=g, **kw))
                for k, g, a, kw in pending
            ]
            for fut in futures:
                fut.result()
    _PRECOMPILED.add(key)
