"""Session-19 probe (development): host cost of the steps of the fused prepare and of the call
around it (10k, d = 64, given weights, "tf32"), medians of 200 synchronised repetitions.

    python bench/dev/s19_prep_timing.py
"""

from __future__ import annotations

import statistics
import time

import torch

import flashsinkhorn as fs
from flashsinkhorn import functional
from flashsinkhorn import problem as P
from flashsinkhorn.backends.triton import prepare as tp
from flashsinkhorn.solvers import graphs


def med(fn, reps=200, sync_after=False):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync_after:
            torch.cuda.synchronize()
        out.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(out)


def main():
    n, d = 10_000, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(n, d, device="cuda", generator=gen)
    y = torch.rand(n, d, device="cuda", generator=gen)
    a = torch.rand(n, device="cuda", generator=gen) + 0.5
    b = torch.rand(n, device="cuda", generator=gen) + 0.5
    a, b = a / a.sum(), b / b.sum()
    X, Y = x[None], y[None]
    outs = tp.outputs(X, Y, a, b, "tf32")
    centre, st = tp.stats(X, Y, a, b, outs)
    tp.sides(X, Y, a, b, centre, "tf32", 1.0, outs)
    r = {}
    r["outputs (one allocation)"] = med(lambda: tp.outputs(X, Y, a, b, "tf32"))
    r["stats launches"] = med(lambda: tp.stats(X, Y, a, b, outs))
    r["stats + tolist"] = med(lambda: tp.stats(X, Y, a, b, outs)[1].tolist())
    r["tolist alone (idle GPU)"] = med(lambda: st.tolist())
    r["sides launch"] = med(lambda: tp.sides(X, Y, a, b, centre, "tf32", 1.0, outs))
    r["10 x torch.empty"] = med(lambda: [torch.empty(n, device="cuda") for _ in range(10)])
    r["one reduce-kernel launch"] = med(
        lambda: tp.launch(
            tp._prepare_reduce_kernel,
            (1,),
            *([st] * 6),
            d,
            1,
            1,
            BLOCK_P=32,
            BLOCK_D=64,
            **tp.FP_FUSION,
        )  # fmt: skip
    )
    kw = dict(rho_x=None, rho_y=None, precision="tf32")
    r["prepare host"] = med(lambda: P.prepare(x, y, a, b, **kw))
    r["prepare host+sync"] = med(lambda: P.prepare(x, y, a, b, **kw), sync_after=True)
    P.PREPARE_PATH = "torch"
    r["prepare torch host"] = med(lambda: P.prepare(x, y, a, b, **kw))
    P.PREPARE_PATH = "auto"
    marks = {}
    real_prep, real_run = functional.prepare, graphs.run

    def prep(*aa, **kk):
        marks["p0"] = time.perf_counter()
        out = real_prep(*aa, **kk)
        marks["p1"] = time.perf_counter()
        return out

    def run(*aa, **kk):
        marks["g0"] = time.perf_counter()
        out = real_run(*aa, **kk)
        marks["g1"] = time.perf_counter()
        return out

    functional.prepare, graphs.run = prep, run
    kws = dict(eps=0.1, n_iters=10, tol=None, schedule="symmetric", precision="tf32")
    keep = []
    for _ in range(5):
        keep[:] = [fs.sinkhorn(x, y, a, b, **kws)]
    parts = {k: [] for k in ("to prepare", "prepare", "prepare to graph", "graph run", "after")}
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        keep[:] = [fs.sinkhorn(x, y, a, b, **kws)]
        t1 = time.perf_counter()
        parts["to prepare"].append(marks["p0"] - t0)
        parts["prepare"].append(marks["p1"] - marks["p0"])
        parts["prepare to graph"].append(marks["g0"] - marks["p1"])
        parts["graph run"].append(marks["g1"] - marks["g0"])
        parts["after"].append(t1 - marks["g1"])
    for k, v in parts.items():
        r["call: " + k] = 1e6 * statistics.median(v)
    for k, v in r.items():
        print(f"{k:32s} {v:8.1f} us", flush=True)
    # the bench's calling pattern (bench/providers/_timing.py): do the solve graphs hit?
    import sys

    sys.path.insert(0, "..")
    from providers._timing import Timing, measure_torch

    functional.prepare, graphs.run = real_prep, real_run
    for name in ("fwd sinkhorn", "fwdbwd ot_cost"):
        graphs.clear()
        xg = x.clone().requires_grad_(True)
        if name.startswith("fwd "):
            fn = lambda: fs.sinkhorn(x, y, a, b, **kws)  # noqa: E731
        else:

            def fn():
                loss = fs.ot_cost(xg, y, a, b, **kws)
                return loss.detach(), torch.autograd.grad(loss.sum(), xg)[0]

        stats, _ = measure_torch(fn, "cuda", Timing())
        print(f"bench pattern {name}: median {stats['ms']:.3f} ms, min {stats['ms_min']:.3f}"
              f" ms, reps {stats['reps']}, graphs {graphs.stats()}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
