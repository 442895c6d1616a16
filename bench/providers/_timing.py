"""Timing and memory helpers shared by the PyTorch-based providers.

Protocol (bench/README.md): the first call (compilation, autotuning) is timed on its own and
reported as ``first_call_s``; then warm-up calls; then ``reps`` calls, each timed with CUDA
events (wall clock on CPU) and synchronised; the median is reported. Peak memory is
``torch.cuda.max_memory_allocated`` over one extra call after the timed ones.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    """Repetition policy: at least ``min_reps`` and at most ``max_reps`` timed calls,
    aiming for ``target_s`` seconds of timed work, after ``warmup`` warm-up calls."""

    warmup: int = 3
    min_reps: int = 5
    max_reps: int = 50
    target_s: float = 1.0

    @staticmethod
    def quick() -> Timing:
        """Fewer repetitions, for smoke tests."""
        return Timing(warmup=1, min_reps=3, max_reps=10, target_s=0.3)


def is_cuda(device) -> bool:
    """True when ``device`` names a CUDA device."""
    return str(device).startswith("cuda")


def sync(device) -> None:
    """Wait for all queued work on ``device``."""
    if is_cuda(device):
        torch.cuda.synchronize()


def reps_for(estimate_s: float, timing: Timing) -> int:
    """Number of timed repetitions for a call that takes about ``estimate_s`` seconds."""
    if estimate_s <= 0:
        return timing.max_reps
    return int(min(timing.max_reps, max(timing.min_reps, math.ceil(timing.target_s / estimate_s))))


def measure_torch(fn, device, timing: Timing):
    """Time ``fn`` (no arguments; returns its outputs) with the protocol of bench/README.md.

    Returns ``(stats, out)`` where ``stats`` holds ``ms`` (median), ``ms_min``, ``reps``,
    ``first_call_s``, ``peak_mb`` (peak allocated during one call, inputs included) and
    ``work_mb`` (peak above what was allocated before the call), and ``out`` is the
    output of the last call.
    """
    cuda = is_cuda(device)
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    first = time.perf_counter() - t0

    t0 = time.perf_counter()
    out = fn()
    sync(device)
    est = time.perf_counter() - t0
    for _ in range(max(0, timing.warmup - 1)):
        out = fn()
    sync(device)
    reps = reps_for(est, timing)

    times_ms = []
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times_ms.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            times_ms.append((time.perf_counter() - t0) * 1e3)

    peak_mb = work_mb = None
    if cuda:
        del out
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        sync(device)
        peak = torch.cuda.max_memory_allocated()
        peak_mb = peak / 2**20
        work_mb = (peak - base) / 2**20

    stats = {
        "ms": statistics.median(times_ms),
        "ms_min": min(times_ms),
        "reps": reps,
        "first_call_s": first,
        "peak_mb": peak_mb,
        "work_mb": work_mb,
    }
    return stats, out


def release(device) -> None:
    """Free cached device memory between sizes."""
    import gc

    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


def allow_tf32() -> None:
    """Allow TF32 in PyTorch matmuls (protocol: TF32 allowed)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def _cache_entries() -> int | None:
    """Number of entries in the Triton cache folder (``TRITON_CACHE_DIR``), if set."""
    import os

    path = os.environ.get("TRITON_CACHE_DIR")
    if not path or not os.path.isdir(path):
        return None
    return len(os.listdir(path))


def measure_first_call(import_lib, make_fn, size, device, timing: Timing, second_factor=1.5):
    """First-call protocol, meant for a fresh worker process with an empty Triton cache.

    ``import_lib()`` imports the library (timed as ``import_s``); ``make_fn(lib, x, y, a, b)``
    returns a no-argument callable doing one solve. Measures the first solve at ``size``
    (``first_call_s`` = import + first solve), then the first solve at a new ``n = m``
    (``second_n``, same d) in the same process (``second_call_s``), and counts new Triton
    cache entries after each (``compiled_first``, ``compiled_second``: 0 for the second
    means no recompilation). Finally the steady-state median ``ms`` at ``size``.
    """
    from cases import Size, make_inputs

    torch.zeros(1, device=device)  # create the CUDA context before the clock starts
    sync(device)
    c0 = _cache_entries()
    t0 = time.perf_counter()
    lib = import_lib()
    import_s = time.perf_counter() - t0

    x, y, a, b = make_inputs(size, device)
    fn = make_fn(lib, x, y, a, b)
    sync(device)
    t1 = time.perf_counter()
    fn()
    sync(device)
    solve_first = time.perf_counter() - t1
    c1 = _cache_entries()

    n2 = int(size.n * second_factor)
    size2 = Size(n2, int(size.m * second_factor), size.d, size.B)
    x2, y2, a2, b2 = make_inputs(size2, device)
    fn2 = make_fn(lib, x2, y2, a2, b2)
    sync(device)
    t2 = time.perf_counter()
    fn2()
    sync(device)
    second = time.perf_counter() - t2
    c2 = _cache_entries()
    del fn2, x2, y2, a2, b2

    stats, _ = measure_torch(fn, device, timing)
    stats.update(
        {
            "first_call_s": import_s + solve_first,
            "import_s": import_s,
            "first_solve_s": solve_first,
            "second_n": n2,
            "second_call_s": second,
            "compiled_first": None if c0 is None or c1 is None else c1 - c0,
            "compiled_second": None if c1 is None or c2 is None else c2 - c1,
        }
    )
    return stats
