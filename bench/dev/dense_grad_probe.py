"""Tiles and block budget of the dense envelope gradient (dense_grad.py), per orientation.

Times DenseTritonBackend.transport_grad at n = m = 10k, d = 512 (the solve's potentials) for
each (BLOCK_M, BLOCK_N, warps, chunk_elements) candidate and checks it against the default.
"""

from __future__ import annotations

import json
import sys

import torch

import flashsinkhorn as fs
from flashsinkhorn.backends.triton import dense, dense_grad
from flashsinkhorn.problem import prepare

CANDS = {
    False: [(16, 256, 4, 24), (16, 256, 4, 26), (8, 256, 2, 25), (8, 512, 4, 25),
            (16, 128, 4, 26), (32, 256, 8, 26), (8, 256, 4, 26)],
    True: [(64, 128, 8, 24), (64, 128, 8, 26), (32, 128, 4, 26), (16, 256, 4, 26),
           (32, 256, 8, 26), (16, 128, 4, 25), (16, 64, 2, 26)],
}  # fmt: skip


def _time(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[reps // 2]


def main(out):
    torch.manual_seed(0)
    x = torch.randn(10000, 512, device="cuda") / 512**0.5
    y = torch.randn(10000, 512, device="cuda") / 512**0.5 + 0.1
    res = fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None, precision="tf32")
    f, g = res._f, res._g
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
    be = dense.DenseTritonBackend(p)
    rows = []
    for tr in (False, True):
        R, C, rp, cp = (p.Y, p.X, g, f) if tr else (p.X, p.Y, f, g)
        ref = None
        for bm, bn, w, ch in CANDS[tr]:
            dense_grad.SOFTMAX_TILES[tr] = (bm, bn, w)
            be.chunk_elements = 1 << ch
            torch.cuda.reset_peak_memory_stats()
            G, _ = be.transport_grad(R, C, rp, cp, 0.1, "tf32")
            ref = G if ref is None else ref
            err = float((G - ref).abs().max() / ref.abs().max())
            ms = _time(lambda: be.transport_grad(R, C, rp, cp, 0.1, "tf32"))
            peak = torch.cuda.max_memory_allocated() / 2**20
            row = dict(transposed=tr, tiles=[bm, bn, w], chunk_log2=ch, ms=ms, rel_err=err,
                       peak_mb=peak)  # fmt: skip
            rows.append(row)
            print(f"{'y' if tr else 'x'} side {bm:3d}x{bn:3d} w{w} chunk 2^{ch}: {ms:.3f} ms "
                  f"err {err:.1e} peak {peak:.0f} MB", flush=True)  # fmt: skip
    if out:
        with open(out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
