"""GPU time of the fused symmetric soft-min per tile config and split rule (development probe).

The forward profile (docs/performance.md, entry 11) showed the 10k, d = 64 solve bound by the
kernel (10 launches queue back to back), so configs are compared by the CUDA-event time of 10
``symmetric_step`` calls on prepared sides, not by the wall time of a solve. Sizes: the fwd
goals of issue 9 with d <= 128 (10k/64, 50k/64, 40k/128), precision "tf32".

    python bench/dev/sym_sweep.py --out DIR        # writes DIR/sym_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from _cuda_timing import events_ms

from flashsinkhorn.backends import resolve_backend
from flashsinkhorn.backends.triton import configs, lse
from flashsinkhorn.problem import prepare

CONFIGS = [  # (BLOCK_M, BLOCK_N, warps, stages)
    (128, 64, 8, 3),  # the rule before entry 12 (and still for d <= 32)
    (128, 64, 8, 2),
    (128, 64, 8, 4),
    (128, 128, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 3),
    (64, 128, 4, 3),
    (128, 64, 4, 3),
    (256, 64, 8, 3),
    (128, 32, 4, 3),
    (64, 64, 2, 3),
    (64, 32, 2, 3),
]
SPLITS = [None, 1, 2, 6, 8]  # None: the rule (about 4 programs per SM)
SIZES = [(1, 10_000, 64), (1, 50_000, 64), (1, 40_000, 128)]  # (B, n = m, d)
SMALL_D = [(64, 1024, 3), (64, 1024, 16)]  # the batched training shape of issue 9


def _steps_ms(be, X, Y, reps=7):
    def run():
        f, g = torch.zeros_like(X.sq), torch.zeros_like(Y.sq)
        for k in range(10):
            al, w = (0.0, 1.0) if k == 0 else (0.5, 0.5)
            f, g, _, _ = be.symmetric_step(X, Y, f, g, 0.1, al, w, w, False, "tf32")

    run()
    return events_ms(run, reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--small-d", action="store_true", help="the batched small-d shapes, no splits")
    ap.add_argument("--sizes", default=None, help="B:n:d,... instead of the built-in shapes")
    ap.add_argument("--configs", default=None, help="indices into CONFIGS, comma separated")
    args = ap.parse_args()
    sizes = SMALL_D if args.small_d else SIZES
    if args.sizes:
        sizes = [tuple(int(v) for v in t.split(":")) for t in args.sizes.split(",")]
    cfgs = CONFIGS if not args.configs else [CONFIGS[int(i)] for i in args.configs.split(",")]
    os.makedirs(args.out, exist_ok=True)
    orig = lse.lse_config
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    be = resolve_backend("triton", torch.device("cuda"), torch.float32)
    for B, n, d in sizes:
        x = torch.rand(B, n, d, device="cuda", generator=g)
        y = torch.rand(B, n, d, device="cuda", generator=g)
        p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
        for cfg in cfgs:
            lse.lse_config = lambda dd, half=True, c=cfg: configs.LSEConfig(
                c[0], c[1], max(16, triton.next_power_of_2(dd)), 1, c[2], c[3]
            )
            for split in SPLITS if (B, n) == (1, 10_000) else [None]:
                lse.FORCE_SPLIT = split
                try:
                    ms = _steps_ms(be, p.X, p.Y)
                except Exception as exc:  # out of resources for this shape
                    ms = float("nan")
                    print("ERR", cfg, repr(exc)[:160], flush=True)
                row = {"B": B, "n": n, "d": d, "cfg": cfg, "split": split,
                       "ms_10_steps": round(ms, 4)}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
        lse.lse_config, lse.FORCE_SPLIT = orig, None
    name = "sym_sweep_small_d.json" if args.small_d else "sym_sweep.json"
    with open(os.path.join(args.out, name), "w") as fh:
        json.dump(rows, fh, indent=1)
    for B, n, d in sizes:
        mine = [r for r in rows if (r["B"], r["n"], r["d"]) == (B, n, d)]
        best = min((r for r in mine if r["ms_10_steps"] == r["ms_10_steps"]),
                   key=lambda r: r["ms_10_steps"])  # fmt: skip
        first = next(r for r in mine if r["cfg"] == cfgs[0] and r["split"] is None)
        print(f"{B}x{n}x{d}: {first['cfg']} {first['ms_10_steps']:.3f} ms, best "
              f"{best['ms_10_steps']:.3f} ms {best['cfg']} split={best['split']}")  # fmt: skip


if __name__ == "__main__":
    main()
