"""Do the cached solve graphs hit under the bench's calling pattern? (development probe, CUDA)

The batched training shape (64 × 1024², d = 3, 10 iterations, "tf32", fwd+bwd as in
bench/providers/ours.py), with and without random weights, with the previous call's outputs
held or dropped. For each: the CUDA-event median of one call on an idle device (the bench's
protocol), the pipelined wall time per call, and the graph cache's counters.

    python bench/dev/graph_hit_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch

import flashsinkhorn as fs
from flashsinkhorn.solvers import graphs


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    B, n, d = 64, 1024, 3
    x = torch.rand(B, n, d, device="cuda", generator=g)
    y = torch.rand(B, n, d, device="cuda", generator=g)
    a = torch.rand(B, n, device="cuda", generator=g) + 0.5
    b = torch.rand(B, n, device="cuda", generator=g) + 0.5
    a, b = a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)
    xg = x.clone().requires_grad_(True)
    for use in (True, False):
        graphs.USE_SOLVE_GRAPHS = use
        for sched in ("symmetric", "alternating"):
            for weights in (True, False):
                for hold in (True, False):
                    graphs.clear()
                    wa, wb = (a, b) if weights else (None, None)

                    def fn(wa=wa, wb=wb, sched=sched):
                        loss = fs.ot_cost(xg, y, wa, wb, eps=0.1, n_iters=10, tol=None,
                                          schedule=sched, precision="tf32")  # fmt: skip
                        (gx,) = torch.autograd.grad(loss.sum(), xg)
                        return loss.detach(), gx

                    out = None
                    for _ in range(10):
                        out = fn() if hold else (fn(), None)[1]
                    times = []
                    for _ in range(100):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                        s.record()
                        out = fn() if hold else (fn(), None)[1]
                        e.record()
                        e.synchronize()
                        times.append(s.elapsed_time(e))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(100):
                        out = fn() if hold else (fn(), None)[1]
                    torch.cuda.synchronize()
                    wall = (time.perf_counter() - t0) * 10
                    del out
                    print(
                        f"graphs={use!s:5s} {sched:11s} weights={weights!s:5s} "
                        f"hold={hold!s:5s} events {statistics.median(times):.3f} ms "
                        f"(min {min(times):.3f}) pipelined {wall:.3f} ms/call {graphs.stats()}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
