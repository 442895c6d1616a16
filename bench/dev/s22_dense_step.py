"""Dense path: the fused symmetric sweep over the Gram matrix against two soft-min sweeps.

For each size, a 10-iteration symmetric "tf32" solve on path="dense" with two dense sweeps per
iteration (``dense.USE_FUSED_STEP`` off), then the same solve with the fused step for each of
a few tile shapes (``dense.sym_tile`` patched); one JSON line per variant, each checked against
the two-sweep potentials. Then the step kernels alone (torch profiler, CUDA time per call).
Usage: python bench/dev/s22_dense_step.py [--out FILE] [--sizes 10000x512,...].
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
from flashsinkhorn.backends.triton import dense  # noqa: E402

TILES = [(64, 128, 8, 3), (32, 128, 8, 3), (32, 256, 8, 3), (16, 256, 4, 3), (64, 256, 8, 3),
         (32, 128, 4, 3), (128, 64, 8, 3)]  # fmt: skip


def clouds(n: int, d: int):
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.rand(n, d, generator=g).cuda(), torch.rand(n, d, generator=g).cuda()


def kernel_times(fn) -> dict:
    """CUDA time per call of each kernel of fn(), in microseconds (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            t = getattr(e, "device_time_total", None) or e.cuda_time_total
            out[e.key[:60]] = round(t / e.count, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sizes", default="10000x512,20000x1024")
    args = ap.parse_args()
    lines = []

    def emit(row):
        lines.append(row)
        print(json.dumps(row), flush=True)

    default = dense.sym_tile
    for s in args.sizes.split(","):
        n, d = map(int, s.split("x"))
        x, y = clouds(n, d)

        def solve(x=x, y=y):
            return fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None, schedule="symmetric",
                               path="dense", precision="tf32")  # fmt: skip

        dense.USE_FUSED_STEP = False
        ref = solve()
        t_two = events_ms(solve, reps=10)
        emit({"n": n, "d": d, "variant": "two sweeps", "ms": t_two, "path": ref.path,
              "kernels_us": kernel_times(solve)})  # fmt: skip
        dense.USE_FUSED_STEP = True
        for tile in TILES:
            dense.sym_tile = lambda tile=tile: tile
            name = "fused {}x{} w{} s{}".format(*tile)
            try:
                got = solve()
                err = float((got.f - ref.f).abs().max() / ref.f.abs().max())
                t = events_ms(solve, reps=10)
                row = {"n": n, "d": d, "variant": name, "ms": t, "rel_err_f": err,
                       "value_diff": float(got.value - ref.value)}  # fmt: skip
                if tile == TILES[0]:
                    row["kernels_us"] = kernel_times(solve)
                emit(row)
            except Exception as e:  # a tile shape that does not compile is a row, not a stop
                emit({"n": n, "d": d, "variant": name, "error": repr(e)[:200]})
        dense.sym_tile = default
        ref = got = None
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in lines) + "\n")


if __name__ == "__main__":
    main()
