"""Dense path: the plan sweep over the stored Gram matrix against two soft-min sweeps.

For each size, a 10-iteration symmetric "tf32" solve on path="dense" with two dense sweeps per
iteration (``dense.USE_PLAN_STEP`` off), then the same solve with the plan step for each of a
few tile shapes (``plan.dense_plan_config`` patched); one JSON line per variant. Each timed
plan variant is first checked against the two-sweep potentials. Usage: python bench/dev/s22_dense_plan.py [--out FILE].
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import flashsinkhorn as fs  # noqa: E402
from _cuda_timing import events_ms  # noqa: E402
from flashsinkhorn.backends.triton import configs, dense, plan  # noqa: E402

TILES = [(64, 128, 4, 3), (32, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4)]


def clouds(n: int, d: int):
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.rand(n, d, generator=g).cuda(), torch.rand(n, d, generator=g).cuda()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sizes", default="10000x512,20000x1024")
    args = ap.parse_args()
    lines = []

    def emit(row):
        lines.append(row)
        print(json.dumps(row), flush=True)

    for s in args.sizes.split(","):
        n, d = map(int, s.split("x"))
        x, y = clouds(n, d)

        def solve(x=x, y=y):
            return fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None, schedule="symmetric",
                               path="dense", precision="tf32")  # fmt: skip

        dense.USE_PLAN_STEP = False
        ref = solve()
        t_two = events_ms(solve, reps=10)
        emit({"n": n, "d": d, "variant": "two sweeps", "ms": t_two, "path": ref.path})
        for bm, bn, warps, stages in TILES:
            cfg = configs.LSEConfig(bm, bn, 16, 1, warps, stages)
            plan.dense_plan_config = lambda cfg=cfg: cfg
            dense.USE_PLAN_STEP = True
            try:
                got = solve()
                err = float((got.f - ref.f).abs().max() / ref.f.abs().max())
                t = events_ms(solve, reps=10)
                emit({"n": n, "d": d, "variant": f"plan {bm}x{bn} w{warps} s{stages}", "ms": t,
                      "rel_err_f": err, "value_diff": float(got.value - ref.value)})  # fmt: skip
            except Exception as e:  # a tile shape that does not compile is a row, not a stop
                emit({"n": n, "d": d, "variant": f"plan {bm}x{bn} w{warps} s{stages}",
                      "error": repr(e)[:200]})  # fmt: skip
        dense.USE_PLAN_STEP = False
        ref = got = None
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in lines) + "\n")


if __name__ == "__main__":
    main()
