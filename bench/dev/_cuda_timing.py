"""Timing helpers shared by the development probes in bench/dev (CUDA only)."""

from __future__ import annotations

import statistics
import time

import torch


def wall_ms(fn, reps: int = 20) -> float:
    """Median host wall time of ``fn()`` between two synchronisations, in ms."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def events_ms(fn, reps: int = 20) -> float:
    """Median CUDA-event time of ``fn()`` started on an idle device, in ms."""
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def graph_ms(fn, reps: int = 20) -> float:
    """Median CUDA-event time of ``fn``'s launches replayed from a CUDA graph (no host work),
    in ms."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def kernel_table(fn, top: int = 14) -> dict:
    """One profiled call of ``fn``: wall ms, total device ms and the heaviest kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t0)
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0.0)
        if dev_us > 0:
            rows.append({"name": ev.key[:80], "calls": ev.count, "ms": dev_us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return {"wall_ms_profiled": wall, "kernel_ms": sum(r["ms"] for r in rows), "top": rows[:top]}
