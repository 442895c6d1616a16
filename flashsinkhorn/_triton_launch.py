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
# overlap in threads (measured on an H200: 4.6 s one after the other,
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
    main thread: measured 1.3-1.7 s for the three prepare kernels of a fresh process on an
    H200)."""
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


# Resident blocks per SM of a compiled kernel. Grids are planned to fill whole waves of the
# GPU (a 4.2-wave grid runs as 5 waves); how many blocks of a kernel fit on an SM at once
# depends on the registers ptxas gave it, which only the compiled kernel knows and which one
# Triton release may change from the next.

_RESIDENT: dict = {}
_SM_LIMITS: dict[int, tuple[int, int, int]] = {}


def _sm_limits(device: torch.device) -> tuple[int, int, int]:
    """(registers, shared-memory bytes, threads) of one SM, cached."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    got = _SM_LIMITS.get(idx)
    if got is None:
        p = torch.cuda.get_device_properties(idx)
        got = _SM_LIMITS[idx] = (
            int(getattr(p, "regs_per_multiprocessor", 65536)),
            int(getattr(p, "shared_memory_per_multiprocessor", 233472)),
            int(getattr(p, "max_threads_per_multi_processor", 2048)),
        )
    return got


def blocks_per_sm(n_regs: int, shared: int, num_warps: int, limits: tuple[int, int, int]) -> int:
    """Blocks of a kernel resident on one SM: registers are allocated per warp in units of 256,
    each block also reserves 1 KB of shared memory, and an SM holds at most 32 blocks."""
    regs, smem, threads = limits
    per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = (regs // per_warp) // num_warps
    by_smem = smem // (shared + 1024)
    by_threads = threads // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads, 32))


def resident_blocks(key, kernel, grid, *args, **kwargs) -> int | None:
    """Blocks per SM of the kernel that ``kernel[grid](*args, **kwargs)`` would run, cached
    under ``key`` (which must fix every compile-time choice of that launch). The first call
    compiles and loads it if needed. None under the interpreter, while launches are only being
    recorded (:func:`precompile_once`), or when this Triton does not report registers."""
    got = _RESIDENT.get(key)
    if got is not None or key in _RESIDENT:
        return got
    if _RECORDING.get() is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    dev = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    blocks = None
    if dev is not None:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        with torch.cuda.device(dev):
            init = getattr(compiled, "_init_handles", None)
            if callable(init):
                init()
        n_regs = getattr(compiled, "n_regs", None)
        meta = getattr(compiled, "metadata", None)
        if isinstance(n_regs, int) and n_regs > 0 and meta is not None:
            shared = int(getattr(meta, "shared", 0))
            warps = int(getattr(meta, "num_warps", kwargs.get("num_warps", 4)))
            blocks = blocks_per_sm(n_regs, shared, warps, _sm_limits(dev))
    _RESIDENT[key] = blocks
    return blocks
