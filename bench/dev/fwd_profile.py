"""Where a small forward solve's time goes (development probe, not a bench case).

n = m = 10,000, d = 64, eps = 0.1, 10 symmetric iterations, tol=None (the bench's fwd case):
- wall time of ``fs.sinkhorn`` (median of 20), of ``prepare`` alone and of the 10 steps alone;
- CUDA-event time of the 10 steps queued back to back (the GPU's share);
- a torch.profiler table of one solve: CUDA time per kernel, total kernel time, wall.

    python bench/dev/fwd_profile.py --out DIR      # writes DIR/fwd_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import flashsinkhorn as fs
from flashsinkhorn.problem import prepare


def _wall(fn, reps=20):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def _events(fn, reps=20):
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


def run(out_dir: str, n: int, d: int, precisions: list[str]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, d, generator=g).cuda()
    y = torch.rand(n, d, generator=g).cuda()
    a = torch.rand(n, generator=g).cuda() + 0.1
    b = torch.rand(n, generator=g).cuda() + 0.1
    a, b = a / a.sum(), b / b.sum()
    report = {"n": n, "d": d, "gpu": torch.cuda.get_device_name(), "rows": []}
    for precision in precisions:
        kw = dict(eps=0.1, n_iters=10, tol=None, precision=precision, backend="triton")
        res = fs.sinkhorn(x, y, a, b, **kw)
        pr, be = res._problem, res._backend

        def solve(kw=kw):
            fs.sinkhorn(x, y, a, b, **kw)

        def prep(precision=precision):
            prepare(x, y, a, b, rho_x=None, rho_y=None, precision=precision)

        def steps(pr=pr, be=be, precision=precision):
            f, gg = torch.zeros_like(pr.X.sq), torch.zeros_like(pr.Y.sq)
            for k in range(10):
                al, w = (0.0, 1.0) if k == 0 else (0.5, 0.5)
                f, gg, _, _ = be.symmetric_step(pr.X, pr.Y, f, gg, 0.1, al, w, w, False, precision)

        row = {
            "precision": precision,
            "solve_wall_ms": _wall(solve),
            "prepare_wall_ms": _wall(prep),
            "steps_wall_ms": _wall(steps),
            "steps_events_ms": _events(steps),
        }
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            solve()
            torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            dev_us = getattr(ev, "self_device_time_total", None)
            if dev_us is None:
                dev_us = getattr(ev, "self_cuda_time_total", 0.0)
            if dev_us > 0:
                rows.append({"name": ev.key[:80], "calls": ev.count, "ms": dev_us / 1e3})
        rows.sort(key=lambda r: -r["ms"])
        row["kernel_ms"] = sum(r["ms"] for r in rows)
        row["kernels"] = rows[:12]
        report["rows"].append(row)
        print(
            f"{precision:7s} solve {row['solve_wall_ms']:.2f} ms | prepare {row['prepare_wall_ms']:.2f}"
            f" | 10 steps wall {row['steps_wall_ms']:.2f}, events {row['steps_events_ms']:.2f} |"
            f" kernels {row['kernel_ms']:.2f} ms",
            flush=True,
        )
        for r in rows[:6]:
            print(f"    {r['ms']:7.3f} ms {r['calls']:4d}x {r['name']}")
    with open(os.path.join(out_dir, "fwd_profile.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--precisions", default="tf32,tf32x3")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    run(args.out, args.n, args.d, args.precisions.split(","))
