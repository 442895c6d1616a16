"""Session-18 probe (development; docs/performance.md entry 17): where the remaining time of the
issue-9 rows goes, and whether Triton compiles overlap in threads.

    python bench/dev/s18_probe.py --out DIR            # breakdowns and transport-grad tiles
    python bench/dev/s18_probe.py --compile MODE       # one fresh-process compile experiment

Compile modes (run each in a fresh process with an empty TRITON_CACHE_DIR):
  first / first_noplan: import + first 10k, d = 64 symmetric solve (plan step on / off);
  seq / par: the two-sweep step's and the plan step's kernels compiled one after the other, or
  in two threads at once (small problem, so the compile dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

T0 = time.perf_counter()


def compile_mode(mode: str) -> dict:
    import torch

    t_torch = time.perf_counter() - T0
    torch.zeros(1, device="cuda")
    t_cuda = time.perf_counter() - T0
    import flashsinkhorn as fs
    from flashsinkhorn.backends import triton as tb
    from flashsinkhorn.backends.triton import lse, plan
    from flashsinkhorn.problem import prepare

    t_import = time.perf_counter() - T0
    out = dict(mode=mode, torch_s=t_torch, cuda_s=t_cuda, import_s=t_import)
    if mode.startswith("first"):
        tb.USE_PLAN_STEP = mode == "first"
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.rand(10_000, 64, device="cuda", generator=g)
        y = torch.rand(10_000, 64, device="cuda", generator=g)
        from flashsinkhorn import functional

        real_prepare = functional.prepare

        def timed_prepare(*a, **k):
            t1 = time.perf_counter()
            p_ = real_prepare(*a, **k)
            torch.cuda.synchronize()
            out["prepare_s"] = time.perf_counter() - t1
            return p_

        functional.prepare = timed_prepare
        t = time.perf_counter()
        r = fs.sinkhorn(x, y, eps=0.1, n_iters=10, tol=None, schedule="symmetric", precision="tf32")
        float(r.value)
        out["first_solve_s"] = time.perf_counter() - t
        out["total_s"] = time.perf_counter() - T0
        return out
    x = torch.rand(1, 700, 64, device="cuda")
    y = torch.rand(1, 900, 64, device="cuda")
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="tf32")
    X, Y = p.X, p.Y
    f, g = torch.zeros_like(X.sq), torch.zeros_like(Y.sq)
    two = lse.symmetric_step

    def run_two():
        t = time.perf_counter()
        two(X, Y, f, g, 0.1, 0.0, 1.0, 1.0, False, "tf32")
        torch.cuda.synchronize()
        out["two_s"] = time.perf_counter() - t

    def run_plan():
        t = time.perf_counter()
        plan.symmetric_step(X, Y, f, g, 0.1, 0.5, 0.5, 0.5, False, "tf32")
        torch.cuda.synchronize()
        out["plan_s"] = time.perf_counter() - t

    t = time.perf_counter()
    if mode == "seq":
        run_two()
        run_plan()
    else:
        # the plan step's own fallback launch is left out (thread A compiles that kernel)
        lse.symmetric_step = lambda *a, out=None, guard=None, **k: out
        ta, tb_ = threading.Thread(target=run_two), threading.Thread(target=run_plan)
        ta.start()
        tb_.start()
        ta.join()
        tb_.join()
        lse.symmetric_step = two
    out["both_s"] = time.perf_counter() - t
    return out


# transport-gradient tiles (BLOCK_M, BLOCK_N, warps, stages); the first is the rule before s18
CONFIGS = [(64, 64, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (256, 64, 8, 2),
           (128, 32, 4, 3), (128, 64, 4, 3)]  # fmt: skip


def breakdown(out_dir: str) -> None:
    import torch
    from _cuda_timing import events_ms

    import flashsinkhorn as fs
    from flashsinkhorn.backends.triton import transport
    from flashsinkhorn.problem import prepare

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rec(**kw):
        rows.append(kw)
        print(json.dumps(kw), flush=True)

    for n, d in [(10_000, 64), (10_000, 128), (40_000, 128), (50_000, 64)]:
        x = torch.rand(n, d, device="cuda", generator=gen)
        y = torch.rand(n, d, device="cuda", generator=gen)
        a = torch.rand(n, device="cuda", generator=gen) + 0.5
        b = torch.rand(n, device="cuda", generator=gen) + 0.5
        a, b = a / a.sum(), b / b.sum()
        kw = dict(eps=0.1, n_iters=10, tol=None, schedule="symmetric", precision="tf32")

        def solve():
            return fs.sinkhorn(x, y, a, b, **kw)

        def prep():
            return prepare(x[None], y[None], a[None], b[None], rho_x=None, rho_y=None,
                           precision="tf32")  # fmt: skip

        xg = x.clone().requires_grad_(True)

        def fwd():
            return fs.ot_cost(xg, y, a, b, **kw)

        def fwdbwd():
            (gx,) = torch.autograd.grad(fs.ot_cost(xg, y, a, b, **kw), xg)
            return gx

        for f_ in (solve, prep, fwd, fwdbwd):
            f_()
        rec(n=n, d=d, solve_ms=events_ms(solve, 15), prepare_ms=events_ms(prep, 15),
            ot_cost_fwd_ms=events_ms(fwd, 15), ot_cost_fwdbwd_ms=events_ms(fwdbwd, 15))  # fmt: skip
        res = solve()
        p = prep()
        X, Y = p.X, p.Y
        f = res.f[None].contiguous() if res.f.dim() == 1 else res.f
        g = res.g[None].contiguous() if res.g.dim() == 1 else res.g
        real = transport.transport_config
        for (bm, bn, w, s), fixed in [(c, fx) for c in CONFIGS for fx in (True, False)]:
            transport.FIXED_REFERENCE = fixed

            def cfg(dd, pp, rr, bm=bm, bn=bn, w=w, s=s):
                c = real(dd, pp, rr)
                return transport.TransportConfig(bm, bn, c.block_d, c.d_tiles, c.block_p,
                                                 c.p_tiles, c.block_r, c.r_tiles, w, s)  # fmt: skip

            transport.transport_config = cfg
            try:
                G, _ = transport.transport_grad(X, Y, f, g, 0.1, "tf32")
                ms = events_ms(lambda: transport.transport_grad(X, Y, f, g, 0.1, "tf32"), 10)
                rec(n=n, d=d, grad_cfg=[bm, bn, w, s], fixed_ref=fixed, grad_ms=ms)
            except Exception as e:  # noqa: BLE001 - a config that does not fit is a row too
                rec(n=n, d=d, grad_cfg=[bm, bn, w, s], fixed_ref=fixed, error=str(e)[:200])
            transport.transport_config = real
        transport.FIXED_REFERENCE = True
    with open(os.path.join(out_dir, "s18_probe.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--compile", default=None)
    args = ap.parse_args()
    if args.compile:
        print(json.dumps(compile_mode(args.compile)), flush=True)
    else:
        os.makedirs(args.out, exist_ok=True)
        breakdown(args.out)
