"""GPU time of the plan step per tile config (development probe, docs/performance.md entry 16).

CUDA-event time of 10 plan steps from an iterate (3 two-sweep steps from zero first, so no
step falls back), against 10 two-sweep online-LSE steps on the same potentials, precision
"tf32". Prints and writes DIR/plan_sweep.json.

    python bench/dev/plan_sweep.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _cuda_timing import events_ms

from flashsinkhorn.backends.triton import configs, lse, plan
from flashsinkhorn.problem import prepare

CONFIGS = [  # (BLOCK_M, BLOCK_N, warps, stages)
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (256, 64, 8, 3),
    (64, 128, 4, 3),
    (128, 128, 8, 3),
    (64, 64, 4, 3),
    (128, 32, 4, 3),
    (128, 128, 4, 3),
]
SHAPES = [(1, 10_000, 64), (1, 50_000, 64), (1, 10_000, 128), (1, 40_000, 128), (64, 1024, 3)]
if os.environ.get("PLAN_SWEEP_QUICK"):  # the shapes' leaders of the first sweep only
    CONFIGS = [(128, 64, 4, 3), (128, 128, 4, 3), (256, 64, 8, 3), (256, 128, 8, 3)]
    SHAPES = SHAPES[:4]
GROUPS = [int(v) for v in os.environ.get("PLAN_SWEEP_GROUPS", "").split(",") if v]
if GROUPS:  # row-block groups per SM (plan.GROUPS_PER_SM), the adopted tiles only
    CONFIGS = []
    SHAPES = [SHAPES[1], SHAPES[3], SHAPES[2]]
if os.environ.get("PLAN_SWEEP_STAGES"):  # pipeline depth of the adopted tiles
    CONFIGS = [(128, 128, 4, 2), (128, 128, 4, 4), (256, 128, 8, 2), (256, 128, 8, 4),
               (128, 64, 4, 4), (128, 256, 8, 3)]  # fmt: skip
    SHAPES = [SHAPES[1], SHAPES[2], SHAPES[3]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    real_cfg = plan.plan_config
    for B, n, d in SHAPES:
        x = torch.rand(B, n, d, device="cuda", generator=gen)
        y = torch.rand(B, n, d, device="cuda", generator=gen)
        p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
        X, Y = p.X, p.Y
        f, g = torch.zeros_like(X.sq), torch.zeros_like(Y.sq)
        for k in range(3):
            al, w = (0.0, 1.0) if k == 0 else (0.5, 0.5)
            f, g, _, _ = lse.symmetric_step(X, Y, f, g, 0.1, al, w, w, False, "tf32")

        def two():
            for _ in range(10):
                lse.symmetric_step(X, Y, f, g, 0.1, 0.5, 0.5, 0.5, False, "tf32")

        two()
        t2 = events_ms(two, 7)
        print(f"B={B} n={n} d={d} two sweeps {t2:.3f} ms / 10 steps", flush=True)
        rows.append(dict(B=B, n=n, d=d, variant="two_sweeps", ms=t2))
        for c, gps in [(c, None) for c in CONFIGS] + [(None, gp) for gp in GROUPS or [None]]:
            if gps is not None:
                plan.GROUPS_PER_SM = gps
            if c is None:
                plan.plan_config = real_cfg
            else:
                plan.plan_config = lambda dd, half, c=c: configs.LSEConfig(
                    c[0], c[1], max(16, 1 << (dd - 1).bit_length()), 1, c[2], c[3]
                )

            def run():
                for _ in range(10):
                    plan.symmetric_step(X, Y, f, g, 0.1, 0.5, 0.5, 0.5, False, "tf32")

            try:
                run()
                t = events_ms(run, 7)
            except Exception as e:  # noqa: BLE001 - a probe: report and go on
                t = float("nan")
                print("failed", c, repr(e)[:160])
            name = "rule" if c is None else "x".join(map(str, c))
            name += f" groups/SM {plan.GROUPS_PER_SM}"
            rows.append(dict(B=B, n=n, d=d, variant=f"plan {name}", ms=t))
            print(f"B={B} n={n} d={d} plan {name}: {t:.3f} ms ({t2 / t:.2f}x)", flush=True)
    plan.plan_config = real_cfg
    with open(os.path.join(args.out, "plan_sweep.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
