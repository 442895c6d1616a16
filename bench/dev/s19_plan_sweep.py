"""Session-19 plan-kernel sweep (development): tile shapes and column splits at 10k, timed
without host work (10 plan steps captured in a CUDA graph, replayed under CUDA events).

    python bench/dev/s19_plan_sweep.py --out DIR      # DIR/s19_plan_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _cuda_timing import graph_ms

import flashsinkhorn as fs
from flashsinkhorn.backends.triton import configs, lse, plan
from flashsinkhorn.problem import prepare

# (rows, columns, warps, stages[, maxnreg])
SHAPES = {
    64: [(128, 128, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3),
         (128, 256, 8, 3), (64, 256, 4, 3)],
    128: [(256, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 3), (128, 128, 4, 2),
          (256, 64, 8, 3), (128, 128, 8, 3)],
}  # fmt: skip
SPLITS = [None, 2, 3, 4, 6, 8, 12]
if os.environ.get("S19_SWEEP") == "regs":
    # session 19, after ncu (registers limit the plan kernel to 3 / 1 blocks per SM at 10k)
    SHAPES = {
        64: [
            (128, 128, 4, 3, 128),
            (128, 128, 4, 3, 120),
            (128, 128, 4, 2),
            (128, 128, 4, 2, 128),
            (128, 64, 4, 3, 128),
        ],
        128: [
            (256, 128, 8, 3, 128),
            (256, 128, 8, 2, 128),
            (128, 128, 4, 3, 128),
            (128, 128, 4, 2, 128),
            (128, 64, 4, 3, 128),
        ],
    }
    SPLITS = [None, 4, 5, 6, 8]


def main(out_dir: str, sizes) -> None:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    real_cfg = plan.plan_config
    for n, d in sizes:
        x = torch.rand(n, d, device="cuda", generator=gen)
        y = torch.rand(n, d, device="cuda", generator=gen)
        a = torch.rand(n, device="cuda", generator=gen) + 0.5
        b = torch.rand(n, device="cuda", generator=gen) + 0.5
        a, b = a / a.sum(), b / b.sum()
        res = fs.sinkhorn(x, y, a, b, eps=0.1, n_iters=10, tol=None, precision="tf32")
        p = prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")
        f, g = res.f[None].contiguous(), res.g[None].contiguous()
        for shape in [None] + SHAPES[d]:
            for split in SPLITS:
                if shape is None:
                    plan.plan_config = real_cfg
                else:
                    bm, bn, w, st = shape[:4]
                    mr = shape[4] if len(shape) > 4 else None

                    def cfg(dd, half, bm=bm, bn=bn, w=w, st=st, mr=mr):
                        bd = max(16, 1 << (dd - 1).bit_length())
                        return configs.LSEConfig(bm, bn, bd, 1, w, st, mr)

                    plan.plan_config = cfg
                lse.FORCE_SPLIT = split

                def steps():
                    ff, gg = f, g
                    for _ in range(10):
                        ff, gg, _, _ = plan.symmetric_step(
                            p.X, p.Y, ff, gg, 0.1, 0.5, 0.5, 0.5, False, "tf32", "iterate"
                        )
                    return ff

                try:
                    ms = graph_ms(steps)
                    row = dict(n=n, d=d, shape=shape or "rule", split=split, ms10=ms)
                except Exception as e:  # noqa: BLE001 - a shape that does not fit is a row too
                    row = dict(n=n, d=d, shape=shape or "rule", split=split, error=str(e)[:160])
                rows.append(row)
                print(json.dumps(row), flush=True)
        plan.plan_config = real_cfg
        lse.FORCE_SPLIT = None
    with open(os.path.join(out_dir, "s19_plan_sweep.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--sizes", default="10000x64,10000x128")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    main(args.out, sizes)
