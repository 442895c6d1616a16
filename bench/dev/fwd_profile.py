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

import torch
from _cuda_timing import events_ms, kernel_table, wall_ms

import flashsinkhorn as fs
from flashsinkhorn.problem import prepare


def run(out_dir: str, n: int, d: int, precisions: list[str]) -> dict:
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
            "solve_wall_ms": wall_ms(solve),
            "prepare_wall_ms": wall_ms(prep),
            "steps_wall_ms": wall_ms(steps),
            "steps_events_ms": events_ms(steps),
        }
        table = kernel_table(solve, top=12)
        row["kernel_ms"], row["kernels"] = table["kernel_ms"], table["top"]
        rows = table["top"]
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
