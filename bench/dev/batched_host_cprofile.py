"""Python-level host profile of the batched training shape (development probe, CUDA only).

64 problems of 1024², d = 3, eps = 0.1, 10 symmetric iterations, "tf32": ``ot_cost`` and its
gradient with respect to x (the bench's ``batched`` case), as in ``batched_host_profile.py``.
Prints the wall time per call, then cProfile's functions by own time and by cumulative time
over 200 calls.

    python bench/dev/batched_host_cprofile.py --out DIR   # writes DIR/batched_host_cprofile.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch

import flashsinkhorn as fs
from flashsinkhorn.solvers import graphs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    B, n, d = 64, 1024, 3
    x = torch.rand(B, n, d, device="cuda", generator=g).requires_grad_(True)
    y = torch.rand(B, n, d, device="cuda", generator=g)

    def call():
        loss = fs.ot_cost(x, y, eps=0.1, n_iters=10, tol=None, precision="tf32")
        torch.autograd.grad(loss.sum(), x)

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.calls * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    buf.write(
        f"wall per fwd+bwd call (no profiler): {wall:.3f} ms; solve graphs {graphs.stats()}\n\n"
    )
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
    text = buf.getvalue()
    print(text)
    if args.out:
        with open(os.path.join(args.out, "batched_host_cprofile.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
