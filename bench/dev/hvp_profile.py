"""Where the HVP's time goes (development probe, not a bench case).

At n = m = 10,000, d = 64, eps = 0.1, 50 CG iterations, tau = 1e-5, per precision:
- one width-1 transport pass (the CG matvec is two of them), CUDA-event median;
- the HVP from potentials as the bench times it (TransportHessian built inside the call), with
  the CG blocks replayed from CUDA graphs and without;
- a torch.profiler table of one eager HVP: CUDA time per kernel, total kernel time, wall;
- a 10-iteration symmetric solve (fwd) at the same size, for the soft-min at that precision.

    python bench/dev/hvp_profile.py --out DIR     # writes DIR/hvp_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import flashsinkhorn as fs
from flashsinkhorn.hessian import TransportHessian, cg


def _events_ms(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def _wall_ms(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def _kernel_table(fn) -> dict:
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
    return {"wall_ms_profiled": wall, "kernel_ms": sum(r["ms"] for r in rows), "top": rows[:14]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--precisions", default="tf32,tf32x3,ieee")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    n, d, eps = args.n, args.d, 0.1
    x = torch.rand(n, d, generator=g).cuda()
    y = torch.rand(n, d, generator=g).cuda()
    A = torch.randn(n, d, generator=g).cuda()
    report = {"n": n, "d": d, "eps": eps, "gpu": torch.cuda.get_device_name(), "rows": []}
    for precision in args.precisions.split(","):
        res = fs.sinkhorn(x, y, eps=eps, tol=1e-5, n_iters=2000, precision=precision)
        pr, be = res._problem, res._backend
        v = torch.randn(1, n, 1, generator=g).cuda()

        def one_pass(pr=pr, be=be, res=res, v=v, precision=precision):
            be.transport(pr.X, pr.Y, res._f, res._g, eps, v, None, None, precision)

        def hvp(res=res):
            th = TransportHessian(res)
            return th.apply(A[None], None, want_y=False, tau=1e-5, cg_tol=1e-30, cg_max_iter=50)

        def fwd(precision=precision):
            fs.sinkhorn(x, y, eps=eps, n_iters=10, tol=None, precision=precision)

        row = {"precision": precision}
        one_pass()
        row["pass_w1_ms"] = _events_ms(one_pass, 20)
        for graphs in (False, True):
            cg.USE_CUDA_GRAPHS = graphs
            hvp()
            hvp()
            row[f"hvp_ms_graphs_{graphs}"] = _wall_ms(hvp, 5)
        cg.USE_CUDA_GRAPHS = False
        row["profile_eager"] = _kernel_table(hvp)
        cg.USE_CUDA_GRAPHS = True
        fwd()
        row["fwd10_ms"] = _wall_ms(fwd, 7)
        report["rows"].append(row)
        print(
            f"{precision:7s} pass {row['pass_w1_ms']:.3f} ms | HVP eager "
            f"{row['hvp_ms_graphs_False']:.1f} ms, graphs {row['hvp_ms_graphs_True']:.1f} ms | "
            f"profiled kernels {row['profile_eager']['kernel_ms']:.1f} of "
            f"{row['profile_eager']['wall_ms_profiled']:.1f} ms | fwd10 {row['fwd10_ms']:.2f} ms",
            flush=True,
        )
        for r in row["profile_eager"]["top"][:8]:
            print(f"    {r['ms']:8.2f} ms {r['calls']:5d}x {r['name']}")
    with open(os.path.join(args.out, "hvp_profile.json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
