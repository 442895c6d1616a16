"""Session-19 probe (development): the timeline of one bench-style call at 10k.

For the two unmet issue-9 rows (fwd 10k, d = 64 with ``sinkhorn``; fwd+bwd 10k, d = 128 with
``ot_cost`` and its gradient), after warm-up (solve graphs captured), this prints:

* CUDA-event times of the whole call, of ``prepare`` alone and of the graph replay alone;
* one profiled call as a timeline: host spans of ``prepare``, the graph replay and the rest,
  and every kernel with its start (relative to the call) and duration.

    python bench/dev/s19_probe.py --out DIR        # DIR/s19_probe.json and chrome traces
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
from _cuda_timing import events_ms

import flashsinkhorn as fs
from flashsinkhorn import functional
from flashsinkhorn.problem import prepare
from flashsinkhorn.solvers import graphs


def _labelled(mod, name, label):
    real = getattr(mod, name)

    def wrapper(*a, **k):
        with torch.profiler.record_function(label):
            return real(*a, **k)

    setattr(mod, name, wrapper)


def timeline(fn, path: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("CALL"):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as fh:
        ev = json.load(fh)["traceEvents"]
    spans = [e for e in ev if e.get("ph") == "X"]
    call = next(e for e in spans if e["name"] == "CALL" and e.get("cat") == "user_annotation")
    t0 = call["ts"]
    out = {"call_host_us": call["dur"], "host": [], "kernels": []}
    for e in spans:
        if e.get("cat") == "user_annotation" and e["name"] != "CALL":
            out["host"].append((e["name"], round(e["ts"] - t0, 1), round(e["dur"], 1)))
        if e.get("cat") == "kernel":
            out["kernels"].append((e["name"][:48], round(e["ts"] - t0, 1), round(e["dur"], 1)))
    out["kernels"].sort(key=lambda r: r[1])
    out["host"].sort(key=lambda r: r[1])
    ks = out["kernels"]
    if ks:
        out["gpu_first_us"] = ks[0][1]
        out["gpu_last_end_us"] = max(k[1] + k[2] for k in ks)
        out["kernel_sum_us"] = round(sum(k[2] for k in ks), 1)
        out["n_kernels"] = len(ks)
    syncs = [e for e in spans if "Synchronize" in e["name"] or "MemcpyAsync" in e["name"]]
    out["syncs"] = [(e["name"], round(e["ts"] - t0, 1), round(e["dur"], 1)) for e in syncs]
    return out


def main(out_dir: str) -> None:
    _labelled(functional, "prepare", "prepare")
    _labelled(graphs, "run", "graph_run")
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = []
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
            keep[:] = [r]  # the bench keeps the previous call's outputs alive

        def prep():
            return prepare(x, y, a, b, rho_x=None, rho_y=None, precision="tf32")

        for _ in range(6):
            call()
        row = {"kind": kind, "n": n, "d": d}
        row["call_events_ms"] = events_ms(call, 30)
        row["prepare_events_ms"] = events_ms(prep, 30)
        row["graph_stats"] = graphs.stats()
        with contextlib.suppress(Exception):
            row["timeline"] = timeline(call, os.path.join(out_dir, f"s19_trace_{kind}.json"))
        report.append(row)
        t = row.get("timeline", {})
        print(
            f"{kind} {n} d={d}: call {row['call_events_ms']:.3f} ms, prepare "
            f"{row['prepare_events_ms']:.3f} ms; profiled host {t.get('call_host_us')} us, "
            f"gpu first {t.get('gpu_first_us')} last end {t.get('gpu_last_end_us')} us, "
            f"kernels {t.get('n_kernels')} sum {t.get('kernel_sum_us')} us",
            flush=True,
        )
        for h in t.get("host", []):
            print("   host", h)
        for s in t.get("syncs", []):
            print("   sync", s)
        for k in t.get("kernels", []):
            print("   kern", k)
    with open(os.path.join(out_dir, "s19_probe.json"), "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    main(args.out)
