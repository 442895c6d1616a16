"""Where the host time of the batched training shape goes (development probe, CUDA only).

64 problems of 1024², d = 3, eps = 0.1, 10 symmetric iterations, "tf32": ``ot_cost`` forward and
its gradient with respect to x (the bench's ``batched`` case). Prints wall and CUDA-event times
of fwd+bwd, forward alone and ``prepare`` alone, with and without ``check_finite``, then the
profiler's CPU table (self CPU time) of three fwd+bwd calls and the number of device
synchronisations per call.

    python bench/dev/batched_host_profile.py --out DIR    # writes DIR/batched_host_profile.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from _cuda_timing import events_ms, wall_ms

import flashsinkhorn as fs
from flashsinkhorn.problem import prepare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    B, n, d = 64, 1024, 3
    x = torch.rand(B, n, d, device="cuda", generator=g)
    y = torch.rand(B, n, d, device="cuda", generator=g)
    xg = x.clone().requires_grad_(True)
    rows = {}
    for cf in (True, False):
        kw = dict(eps=0.1, n_iters=10, tol=None, precision="tf32", check_finite=cf)

        def fwd_bwd(kw=kw):
            loss = fs.ot_cost(xg, y, schedule="symmetric", **kw)
            torch.autograd.grad(loss.sum(), xg)

        def fwd(kw=kw):
            with torch.no_grad():
                fs.ot_cost(x, y, schedule="symmetric", **kw)

        def prep(cf=cf):
            prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32", check_finite=cf)

        for f in (fwd_bwd, fwd, prep):
            f()
        r = {
            "fwd_bwd_wall": wall_ms(fwd_bwd, 50),
            "fwd_bwd_events": events_ms(fwd_bwd, 50),
            "fwd_wall": wall_ms(fwd, 50),
            "prepare_wall": wall_ms(prep, 50),
        }
        rows[f"check_finite={cf}"] = r
        print(f"check_finite={cf}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in r.items()))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            loss = fs.ot_cost(xg, y, schedule="symmetric", eps=0.1, n_iters=10, tol=None)
            torch.autograd.grad(loss.sum(), xg)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    table = ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=50)
    print(table)
    syncs = sum(e.count for e in ka if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
    scalars = sum(e.count for e in ka if e.key == "aten::_local_scalar_dense")
    launches = sum(
        e.count
        for e in ka
        if e.key
        in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    )
    print(
        f"per call: {syncs / 3:.1f} stream syncs, {scalars / 3:.1f} scalar reads, "
        f"{launches / 3:.1f} kernel launches"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "batched_host_profile.json"), "w") as fh:
            json.dump(
                dict(
                    gpu=torch.cuda.get_device_name(),
                    rows=rows,
                    table=table,
                    syncs_per_call=syncs / 3,
                    scalar_reads_per_call=scalars / 3,
                    launches_per_call=launches / 3,
                ),
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
