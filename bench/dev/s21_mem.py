"""Session 21: what is live at the peak of one fwd+bwd call (ours, bench protocol shapes).

Records the CUDA caching allocator's history over one warm ``ot_cost`` + x-gradient call,
replays the alloc/free events, and prints the blocks live at the peak with the innermost
flashsinkhorn frame that allocated them. Usage: python bench/dev/s21_mem.py [--out DIR].
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import flashsinkhorn as fs  # noqa: E402


def where(frames) -> str:
    for fr in frames:
        fn = fr.get("filename", "")
        if "flashsinkhorn/" in fn and "/bench/" not in fn:
            return f"{fn.split('flashsinkhorn/')[-1]}:{fr.get('line')} {fr.get('name')}"
    for fr in frames:
        fn = fr.get("filename", "")
        if fn.endswith(".py") and "torch/" not in fn:
            return f"{fn.split('/')[-1]}:{fr.get('line')} {fr.get('name')}"
    return "?"


def probe(n: int, d: int, eps: float = 0.1, iters: int = 10) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, d, generator=g).cuda()
    y = (torch.randn(n, d, generator=g) + 0.5).cuda()
    xg = x.clone().requires_grad_(True)

    def fn():
        loss = fs.ot_cost(xg, y, eps=eps, n_iters=iters, tol=None, schedule="symmetric",
                          precision="tf32")  # fmt: skip
        (gx,) = torch.autograd.grad(loss.sum(), xg)
        return loss.detach(), gx

    for _ in range(3):
        out = fn()
    del out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    del out
    events = [e for tr in snap["device_traces"] for e in tr]
    live: dict[int, dict] = {}
    cur = best = 0
    at_peak: dict[int, dict] = {}
    for e in events:
        act = e["action"]
        if act == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, at_peak = cur, dict(live)
        elif act in ("free_completed",):
            if e["addr"] in live:
                cur -= live.pop(e["addr"])["size"]
    groups: dict[str, list] = defaultdict(list)
    for e in at_peak.values():
        groups[where(e.get("frames", []))].append(e["size"])
    rows = sorted(((sum(v), len(v), k) for k, v in groups.items()), reverse=True)
    # blocks allocated before the recording (inputs, cached graphs): by segment listing
    return {
        "n": n, "d": d, "base_mib": base / 2**20, "peak_mib": peak / 2**20,
        "work_mib": (peak - base) / 2**20, "traced_peak_mib": best / 2**20,
        "live_at_peak": [(s / 2**20, c, k) for s, c, k in rows],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sizes", default="10000x128,40000x128,10000x64")
    args = ap.parse_args()
    res = []
    for s in args.sizes.split(","):
        n, d = map(int, s.split("x"))
        r = probe(n, d)
        res.append(r)
        print(f"n={n} d={d}: base {r['base_mib']:.2f} peak {r['peak_mib']:.2f} "
              f"work {r['work_mib']:.2f} traced {r['traced_peak_mib']:.2f} MiB")  # fmt: skip
        for mib, cnt, k in r["live_at_peak"][:14]:
            print(f"   {mib:8.3f} MiB  x{cnt:<3d} {k}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "s21_mem.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
