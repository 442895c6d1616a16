"""Session-19 host probe (development): where the host time of one 10k call goes.

For fwd 10k, d = 64 (``sinkhorn``) and fwd+bwd 10k, d = 128 (``ot_cost`` and its gradient),
given weights, "tf32", symmetric, 10 iterations, solve graphs warm: the event time of a call,
the host time until it returns (synchronised before), the host time until the solve graph is
launched, then cProfile's functions by own and cumulative time over 100 calls.

    python bench/dev/s19_host.py --out DIR      # DIR/s19_host.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
from _cuda_timing import events_ms

import flashsinkhorn as fs
from flashsinkhorn import problem as P
from flashsinkhorn.solvers import graphs

MARK = {}


def main(out: str) -> None:
    real_run = graphs.run

    def run(*a, **k):
        MARK["graph"] = time.perf_counter()
        return real_run(*a, **k)

    graphs.run = run
    gen = torch.Generator(device="cuda").manual_seed(0)
    buf = io.StringIO()
    for kind, n, d in [("fwd", 10_000, 64), ("fwdbwd", 10_000, 128)]:
        x = torch.rand(n, d, device="cuda", generator=gen)
        y = torch.rand(n, d, device="cuda", generator=gen)
        a = torch.rand(n, device="cuda", generator=gen) + 0.5
        b = torch.rand(n, device="cuda", generator=gen) + 0.5
        a, b = a / a.sum(), b / b.sum()
        kw = dict(eps=0.1, n_iters=10, tol=None, schedule="symmetric", precision="tf32")
        xg = x.clone().requires_grad_(True)
        keep = []

        def call():
            if kind == "fwd":
                r = fs.sinkhorn(x, y, a, b, **kw)
            else:
                loss = fs.ot_cost(xg, y, a, b, **kw)
                (gx,) = torch.autograd.grad(loss.sum(), xg)
                r = (loss.detach(), gx)
            keep[:] = [r]

        for _ in range(8):
            call()
        for kind_p in ("torch", "auto"):
            P.PREPARE_PATH = kind_p
            prep = lambda: P.prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")  # noqa: E731
            prep()
            line = f"  prepare path {kind_p}: events {events_ms(prep, 40):.3f} ms"
            print(line, flush=True)
            buf.write(line + "\n")
        P.PREPARE_PATH = "auto"
        ev = events_ms(call, 40)
        host, to_graph = [], []
        for _ in range(40):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            host.append(1e3 * (time.perf_counter() - t0))
            to_graph.append(1e3 * (MARK["graph"] - t0))
        torch.cuda.synchronize()
        line = (
            f"{kind} {n} d={d}: events {ev:.3f} ms; host until return "
            f"{statistics.median(host):.3f} ms; host until the graph launch "
            f"{statistics.median(to_graph):.3f} ms; graphs {graphs.stats()}"
        )
        print(line, flush=True)
        buf.write(line + "\n")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            call()
        torch.cuda.synchronize()
        prof.disable()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(45)
    with open(os.path.join(out, "s19_host.txt"), "w") as fh:
        fh.write(buf.getvalue())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    main(args.out)
