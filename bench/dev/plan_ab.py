"""A/B of the plan step (docs/performance.md entry 16): solves with and without it.

For each shape, CUDA-event medians of ``fs.sinkhorn`` (symmetric, "tf32", 10 iterations,
graphs off so that both arms do the same host work) with ``USE_PLAN_STEP`` on and off, the
largest potential difference between the arms, and how many plan steps fell back.

    python bench/dev/plan_ab.py --out DIR          # DIR/plan_ab.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _cuda_timing import events_ms

import flashsinkhorn as fs
from flashsinkhorn.backends import triton as tri_pkg
from flashsinkhorn.backends.triton import lse, plan
from flashsinkhorn.solvers import graphs

SHAPES = [(1, 10_000, 64), (1, 50_000, 64), (1, 10_000, 128), (1, 40_000, 128), (64, 1024, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    graphs.USE_SOLVE_GRAPHS = False
    guards = []
    real = lse.symmetric_step

    def spy(*a, **kw):
        if kw.get("guard") is not None:
            guards.append(kw["guard"])
        return real(*a, **kw)

    plan.lse.symmetric_step = spy
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B, n, d in SHAPES:
        x = torch.rand(B, n, d, device="cuda", generator=gen)
        y = torch.rand(B, n, d, device="cuda", generator=gen)
        res = {}
        for use in (False, True, False, True):
            tri_pkg.USE_PLAN_STEP = use

            def run():
                return fs.sinkhorn(
                    x, y, eps=0.1, n_iters=10, schedule="symmetric", precision="tf32"
                )

            r = run()
            guards.clear()
            r = run()
            torch.cuda.synchronize()
            fell = sum(int(gd.item()) for gd in guards)
            t = events_ms(run, 9)
            res.setdefault(use, []).append(t)
            res[("f", use)] = r.f
            res[("fell", use)] = (fell, len(guards))
        diff = float((res[("f", True)] - res[("f", False)]).abs().max())
        row = dict(B=B, n=n, d=d, two_sweeps_ms=res[False], plan_ms=res[True], max_f_diff=diff,
                   fallbacks=res[("fell", True)][0], plan_steps=res[("fell", True)][1])  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    with open(os.path.join(args.out, "plan_ab.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
