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
import sys
import time
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


def _compile_and_load(kernel, grid, args, kwargs) -> None:
    """Compiles one recorded launch and, where Triton allows, builds its launcher and loads its
    binary too (``CompiledKernel._init_handles``, otherwise done by the first launch on the
    main thread: 1.3-1.7 s for the three prepare kernels of a fresh process on the H200,
    docs/performance.md entry 18)."""
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    init = getattr(compiled, "_init_handles", None)
    if not callable(init):
        return
    dev = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    if dev is None:
        return
    with torch.cuda.device(dev):
        init()


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
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(8, len(pending))) as pool:
            futures = [pool.submit(_compile_and_load, *job) for job in pending]
            for fut in futures:
                fut.result()
        if os.environ.get("FLASHSINKHORN_COMPILE_LOG") == "1":
            dt = time.perf_counter() - t0
            print(f"flashsinkhorn: compiled {len(pending)} kernels for {key[0]!r} in {dt:.2f} s",
                  file=sys.stderr)  # fmt: skip
    _PRECOMPILED.add(key)
