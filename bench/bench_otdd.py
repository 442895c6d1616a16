#!/usr/bin/env python3
"""OTDD benchmark: memory and time of ``flashsinkhorn.otdd`` (paper §4.2 / H.3 analogue).

Writes JSON rows with ``"case": "otdd"`` to ``<out>/otdd_<device-slug>.json`` (the schema of
bench/run.py: ``device``, ``torch``, ``triton``, ``cuda``, ``updated``, ``rows``), and prints
them. Three parts (``--parts``):

- ``memory``: peak memory of ``otdd_distance`` at n = m = 60,000, d = 512, 10 classes each,
  forward (no grad) and forward + backward, with W given and with W built inside; reported
  as ``work_mb`` = peak above the inputs (goal < 1 GB);
- ``time``: ``otdd_distance`` (W given, as in the paper's protocol) against a tensorized
  torch reference — dense augmented cost matrices and log-domain Sinkhorn with the same
  (symmetric, averaged) iterations — at n ∈ {2000, 5000, 10000, 20000}, d = 64; the
  reference is skipped where its three n × n matrices would not fit;
- ``w``: the W builder (``class_distance_matrix``) for 10 + 10 classes of 1000 points,
  d = 64, against a Python loop of ``sinkhorn_divergence`` over the 190 class pairs.

Protocol: synthetic class clusters (centres and spreads drawn once, seeded by the size), fp32,
eps = 0.1 on the cost 0.5‖x − y‖² + 0.5 W (the paper's λ1 = λ2 = 1/2), fixed iteration counts
(``tol=None``), CUDA-event medians after warm-up (wall clock on the CPU).

Usage::

    python bench/bench_otdd.py --out out/                 # GPU, all parts
    python bench/bench_otdd.py --device cpu --quick --out /tmp/o   # CPU smoke test, tiny sizes
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import flashsinkhorn as fs  # noqa: E402
from flashsinkhorn.otdd import augment_labels, class_distance_matrix, otdd_distance  # noqa: E402

LAMBDA = 0.5  # feature and label weights (paper H.3)


# ----------------------------------------------------------------------------- data


def make_dataset(n: int, d: int, classes: int, seed: int, device) -> tuple:
    """n points in ``classes`` Gaussian clusters (unit-scale distances), labels 0..classes-1."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=g) / math.sqrt(d) * 2.0
    l = torch.arange(n) % classes
    l = l[torch.randperm(n, generator=g)]
    x = centres[l] + torch.randn(n, d, generator=g) / math.sqrt(d)
    return x.to(device), l.to(device)


# ----------------------------------------------------------------------------- timing


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device, quick: bool) -> dict:
    """Median time of ``fn()`` after warm-up; CUDA events on the GPU, wall clock on the CPU."""
    cuda = str(device).startswith("cuda")
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    fn()
    _sync(device)
    est = time.perf_counter() - t0
    for _ in range(0 if quick else 2):
        fn()
    reps = 3 if quick else int(min(30, max(5, math.ceil(1.0 / max(est, 1e-6)))))
    ms = []
    for _ in range(reps):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = fn()
            ms.append(1e3 * (time.perf_counter() - t0))
    row = {"ms": statistics.median(ms), "ms_min": min(ms), "reps": reps, "first_call_s": first}
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        row["value"] = float(out)
    return row


def peak_beyond(fn, device) -> dict:
    """Peak memory of one call of ``fn()`` above what was allocated before it (CUDA only)."""
    if not str(device).startswith("cuda"):
        out = fn()
        return {"value": float(out)} if isinstance(out, torch.Tensor) and out.numel() == 1 else {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    row = {"peak_mb": peak / 2**20, "work_mb": (peak - base) / 2**20, "work_bytes": peak - base}
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        row["value"] = float(out)
    return row


# ----------------------------------------------------------------------------- dense reference


def _dense_cost(x, y, lx, ly, W):
    C = torch.cdist(x, y).square_()
    C.mul_(LAMBDA).add_(LAMBDA * W[lx][:, ly])
    return C


def _dense_ot(C, eps: float, iters: int):
    """Uniform weights, symmetric (averaged) log-domain updates after a plain first one."""
    n, m = C.shape
    la = torch.full((n,), -math.log(n), device=C.device, dtype=C.dtype)
    lb = torch.full((m,), -math.log(m), device=C.device, dtype=C.dtype)
    f = torch.zeros(n, device=C.device, dtype=C.dtype)
    g = torch.zeros(m, device=C.device, dtype=C.dtype)
    for it in range(iters):
        tf = -eps * torch.logsumexp(lb[None, :] + (g[None, :] - C) / eps, dim=1)
        tg = -eps * torch.logsumexp(la[:, None] + (f[:, None] - C) / eps, dim=0)
        f, g = (tf, tg) if it == 0 else (0.5 * (f + tf), 0.5 * (g + tg))
    return f.mean() + g.mean()


def dense_otdd(x1, l1, x2, l2, W, eps: float, iters: int):
    """Tensorized debiased OTDD: three dense augmented cost matrices."""
    lx, ly = augment_labels(l1, l2)
    v12 = _dense_ot(_dense_cost(x1, x2, lx, ly, W), eps, iters)
    v11 = _dense_ot(_dense_cost(x1, x1, lx, lx, W), eps, iters)
    v22 = _dense_ot(_dense_cost(x2, x2, ly, ly, W), eps, iters)
    return v12 - 0.5 * (v11 + v22)


def dense_fits(n: int, device) -> bool:
    """Three n × n fp32 matrices plus the temporaries of one logsumexp."""
    if not str(device).startswith("cuda"):
        return n <= 4000
    free, _ = torch.cuda.mem_get_info()
    return 6 * n * n * 4 < 0.9 * free


# ----------------------------------------------------------------------------- parts


def _base(n, m, d, iters, eps, method, provider="ours"):
    return {
        "case": "otdd",
        "n": n,
        "m": m,
        "d": d,
        "iters": iters,
        "eps": eps,
        "method": method,
        "provider": provider,
    }


def _attempt(row: dict, fn) -> dict:
    try:
        row.update(fn())
    except torch.cuda.OutOfMemoryError:
        row["error"] = "out of memory"
        torch.cuda.empty_cache()
    except Exception as exc:  # a row with the error, the run goes on
        msg = f"{type(exc).__name__}: {exc}"
        # Compiler errors put the cause last: keep both ends of long messages.
        row["error"] = msg if len(msg) <= 1200 else msg[:300] + " ... " + msg[-900:]
    return row


def part_memory(args, device) -> list[dict]:
    n, d, V = (600, 16, 4) if args.quick else (60_000, 512, 10)
    x1, l1 = make_dataset(n, d, V, 1, device)
    x2, l2 = make_dataset(n, d, V, 2, device)
    kw = dict(eps=args.eps, n_iters=args.iters, tol=None, feature_weight=LAMBDA,
              label_weight=LAMBDA)  # fmt: skip
    W = class_distance_matrix(x1, l1, x2, l2, eps=args.eps, n_iters=args.iters, tol=None)
    rows = []

    def forward(label_cost):
        def run():
            with torch.no_grad():
                return otdd_distance(x1, l1, x2, l2, label_cost=label_cost, **kw)

        return run

    def forward_backward():
        xg = x1.clone().requires_grad_(True)

        def run():
            val = otdd_distance(xg, l1, x2, l2, label_cost=W, **kw)
            (grad,) = torch.autograd.grad(val, xg)
            return val.detach()

        return run

    for method, fn in (
        ("otdd-fwd-given-W", forward(W)),
        ("otdd-fwd-built-W", forward(None)),
        ("otdd-fwdbwd-given-W", forward_backward()),
    ):
        row = _base(n, n, d, args.iters, args.eps, "flashsinkhorn-" + method)
        row["part"] = "memory"
        row["classes"] = V
        rows.append(_attempt(row, lambda fn=fn: peak_beyond(fn, device)))
        _print(rows[-1])
    return rows


def part_time(args, device) -> list[dict]:
    sizes, d, V = ([200, 400], 8, 4) if args.quick else ([2000, 5000, 10000, 20000], 64, 10)
    rows = []
    for n in sizes:
        rows += _time_size(args, device, n, d, V)
    return rows


def _time_size(args, device, n: int, d: int, V: int) -> list[dict]:
    x1, l1 = make_dataset(n, d, V, 10 + n, device)
    x2, l2 = make_dataset(n, d, V, 20 + n, device)
    W = class_distance_matrix(x1, l1, x2, l2, eps=args.eps, n_iters=args.iters, tol=None)
    kw = dict(eps=args.eps, n_iters=args.iters, tol=None, feature_weight=LAMBDA,
              label_weight=LAMBDA, label_cost=W)  # fmt: skip
    xg = x1.clone().requires_grad_(True)

    def ours():
        with torch.no_grad():
            return otdd_distance(x1, l1, x2, l2, **kw)

    def ours_fb():
        val = otdd_distance(xg, l1, x2, l2, **kw)
        torch.autograd.grad(val, xg)
        return val.detach()

    def ref():
        with torch.no_grad():
            return dense_otdd(x1, l1, x2, l2, W, args.eps, args.iters)

    def measure(fn):
        out = timed(fn, device, args.quick)
        out.update({k: v for k, v in peak_beyond(fn, device).items() if k != "value"})
        return out

    rows = []
    for method, provider, fn in (
        ("flashsinkhorn-otdd-fwd", "ours", ours),
        ("flashsinkhorn-otdd-fwdbwd", "ours", ours_fb),
        ("torch-dense-otdd-fwd", "torch-dense", ref),
    ):
        row = _base(n, n, d, args.iters, args.eps, method, provider)
        row["part"] = "time"
        if fn is ref and not dense_fits(n, device):
            row["error"] = "skipped: three dense n x n matrices would not fit"
        else:
            _attempt(row, lambda fn=fn: measure(fn))
        rows.append(row)
        _print(row)
    return rows


def part_w(args, device) -> list[dict]:
    V, per, d = (3, 50, 8) if args.quick else (10, 1000, 64)
    n = V * per
    x1, l1 = make_dataset(n, d, V, 31, device)
    x2, l2 = make_dataset(n, d, V, 32, device)
    kw = dict(eps=args.eps, n_iters=args.iters, tol=None)

    def batched():
        return class_distance_matrix(x1, l1, x2, l2, **kw)

    def loop():
        clouds = [x1[l1 == k] for k in range(V)] + [x2[l2 == k] for k in range(V)]
        W = torch.zeros(2 * V, 2 * V, device=device)
        for i in range(2 * V):
            for j in range(i + 1, 2 * V):
                W[i, j] = W[j, i] = fs.sinkhorn_divergence(clouds[i], clouds[j], **kw)
        return W

    rows = []
    for method, fn in (("flashsinkhorn-otdd-W-batched", batched), ("python-loop-otdd-W", loop)):
        row = _base(n, n, d, args.iters, args.eps, method)
        row.update(part="w", classes=f"{V}+{V}", points_per_class=per)

        def measure(fn=fn):
            out = timed(fn, device, args.quick)
            out.update(peak_beyond(fn, device))
            return out

        rows.append(_attempt(row, measure))
        _print(rows[-1])
    return rows


# ----------------------------------------------------------------------------- driver


def _print(row: dict) -> None:
    keys = ("part", "method", "n", "d", "ms", "work_mb", "error")
    print("  ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row.get(k)}"
                    for k in keys if k in row), flush=True)  # fmt: skip


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out", help="output directory")
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--parts", default="memory,time,w", help="memory,time,w")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, fewer repetitions")
    parser.add_argument("--iters", type=int, default=10, help="Sinkhorn iterations per solve")
    parser.add_argument("--eps", type=float, default=0.1)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        # the reference's cdist, as in the bench protocol
        torch.backends.cuda.matmul.allow_tf32 = True
        name = torch.cuda.get_device_name(0)
    else:
        name = "cpu"
    parts = {"memory": part_memory, "time": part_time, "w": part_w}
    rows = []
    for p in args.parts.split(","):
        if p not in parts:
            parser.error(f"unknown part {p!r}; choose from {', '.join(parts)}")
        print(f"== {p}", flush=True)
        rows += parts[p](args, device)
    try:
        import triton

        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    data = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton_v,
        "cuda": torch.version.cuda,
        "versions": {"flashsinkhorn": fs.__version__},
        "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"otdd_{slug(name)}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
