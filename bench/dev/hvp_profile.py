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

import torch
from _cuda_timing import events_ms, kernel_table, wall_ms

import flashsinkhorn as fs
from flashsinkhorn.hessian import TransportHessian, cg


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
        row["pass_w1_ms"] = events_ms(one_pass, 20)
        for graphs in (False, True):
            cg.USE_CUDA_GRAPHS = graphs
            hvp()
            hvp()
            row[f"hvp_ms_graphs_{graphs}"] = wall_ms(hvp, 5)
        cg.USE_CUDA_GRAPHS = False
        row["profile_eager"] = kernel_table(hvp)
        cg.USE_CUDA_GRAPHS = True
        fwd()
        row["fwd10_ms"] = wall_ms(fwd, 7)
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
