"""Time per training step of an OT coupling: ours (``couple_indices``) against torchcfm 1.0.7.

One training step of OT-CFM pairs a noise minibatch x0 with a data minibatch x1 by an OT
plan. This script times that step, from the two GPU minibatches to the index pairs on the
GPU, and writes ``<out>/coupling_<gpu-slug>.json`` (one row per line) plus a table.

Protocol

- Inputs: fp32 on the GPU, x0 ~ N(0, I_d) (noise), x1 ~ U[-1, 1]^d (pixel-like data), from
  fixed seeds; n = m in 256, 1024, 4096, 16384, 65536 (``--quick``: up to 4096); d = 2 and
  d = 3072 (a flattened 3 × 32 × 32 image). Cost ‖x0_i − x1_j‖², uniform weights.
- Regularisation: eps = 0.01 × the mean squared distance between the batches (our default),
  the same absolute eps for every method (torchcfm's ``reg``).
- Marginal error: ours stops at ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ <= 1e-3 (our default); POT's
  ``ot.sinkhorn`` behind torchcfm's "sinkhorn" method is given stopThr = 1e-3 / sqrt(m) on
  the L2 norm of its column error (its rows are exact after each update), so its L1 error is
  at most 1e-3 too. Both errors are measured on the returned plans (untimed) and reported.
- Methods: ``ours`` (``flashsinkhorn.couple_indices(x0, x1, eps=eps, replace=True)``:
  solve, row marginal, streamed Gumbel-max draw; the plan is never formed), ``ours-exact``
  (``mode="exact"``: eps annealed to 1e-3 × the mean squared distance; up to
  ``--exact-max`` = 16384 points), and where B·n·m
  fp32 fits a quarter of the free memory at d = 3072, ``ours-dense`` (``path="dense"``: the
  Gram matrix x0·x1ᵀ stored once, then streamed by every soft-min). torchcfm's
  ``OTPlanSampler("sinkhorn", reg=eps)`` and ``OTPlanSampler("exact")`` (``ot.emd``, its
  defaults) each call ``get_map`` + ``sample_map`` as ``sample_plan`` does; their inputs are
  cast to float64 first, because POT forms exp(−M / reg) in the dtype of M and float32
  underflows to a NaN plan at d = 3072 (exp(−100)). A peer size runs only while the
  previous size predicts < ``--peer-cap`` s per call (n² growth for sinkhorn, n³ for emd)
  and the peers' total stays under ``--peer-budget``.
- Timing: ``torch.cuda.synchronize`` wall clock around the whole call (host work included);
  ours: one warm-up call (kernel compilation), then the median of up to 7 calls within 3 s;
  peers: one call when it takes over 2 s, else the median of 3.
- Floors, per configuration, from the H100 ceilings in DESIGN §4 (fp16 tensor-core products
  775 TFLOP/s for the float16 grid operands of precision "tf32", exp2/log2 4.1e12 /s, 3.0
  TB/s): sweeps = 2 × iterations (soft-mins) + 1 (row marginal) + 1 (draws); each sweep
  2·n·m·d product FLOPs, n·m exponentials (the draw: two log2 per score) and (n + m)·d·2
  operand bytes; a dense path builds x0·x1ᵀ once and reads 4·n·m bytes per sweep instead.
  ``floor_ms`` is the sum over sweeps of the largest of the three.

Usage::

    python bench/bench_coupling.py --out bench/results [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

# the repository's flashsinkhorn, whatever PYTHONPATH holds (the peers' wheels)
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RATES = {"flops": 775e12, "exps": 4.1e12, "bytes": 3.0e12}
DEVICE = "cuda"


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="bench/results", help="output folder")
    ap.add_argument("--quick", action="store_true", help="sizes up to 4096 only")
    ap.add_argument("--sizes", default=None, help="comma-separated n (default 256..65536)")
    ap.add_argument("--dims", default="2,3072", help="comma-separated d")
    ap.add_argument("--peer-cap", type=float, default=60.0, help="s per peer call")
    ap.add_argument("--peer-budget", type=float, default=180.0, help="s for all peer calls")
    ap.add_argument("--exact-max", type=int, default=16384, help="largest n of ours-exact")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    return ap.parse_args()


def _sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn, reps: int, budget: float) -> tuple[float, int]:
    """(median ms, calls) of ``fn`` over up to ``reps`` calls within ``budget`` seconds."""
    times = []
    start = time.perf_counter()
    while len(times) < reps and (not times or time.perf_counter() - start < budget):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), len(times)


def _data(n: int, d: int):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(n * 7919 + d)
    x0 = torch.randn(n, d, device=DEVICE, generator=g)
    x1 = torch.rand(n, d, device=DEVICE, generator=g) * 2 - 1
    return x0, x1


def _floor(n: int, d: int, iters: int, dense: bool) -> dict:
    nm = float(n) * n
    sweep = {"flops": 2 * nm * d, "exps": nm, "bytes": 2.0 * 2 * n * d}
    soft = dict(sweep)
    if dense:  # the soft-mins, the marginal and the draws read K
        soft = {"flops": 0.0, "exps": nm, "bytes": 4 * nm}
    draw = dict(soft, exps=2 * nm)
    parts = [soft] * (2 * iters) + [soft, draw]
    if dense:
        parts.append({"flops": 2 * nm * d, "exps": 0.0, "bytes": 4 * nm})
    total = {k: sum(p[k] for p in parts) for k in RATES}
    ms = sum(max(p[k] / RATES[k] for k in RATES) for p in parts) * 1e3
    return {"floor_ms": ms, "products": total["flops"], "exps": total["exps"],
            "bytes": total["bytes"]}  # fmt: skip


def _marginal_error(P, n: int) -> float:
    import numpy as np

    return float(np.abs(P.sum(1) - 1 / n).sum() + np.abs(P.sum(0) - 1 / n).sum())


def _ours(n, d, eps, rows, **kw):
    import flashsinkhorn as fs
    from flashsinkhorn.coupling.minibatch import solve_batches

    x0, x1 = _data(n, d)
    name = kw.pop("name")
    call = lambda: fs.couple_indices(x0, x1, eps=eps, replace=True, **kw)  # noqa: E731
    call()  # compilation, first-call work
    ms, calls = _timed(call, 7, 3.0)
    mode = kw.get("mode", "entropic")
    e = eps if mode != "exact" else None
    res = solve_batches(
        x0, x1, eps=e, mode=mode, rho=None, tol=1e-3, n_iters=1000, backend="auto",
        precision="auto", path=kw.get("path", "auto"),
    )  # fmt: skip
    dense = res.path == "dense" and res.backend == "triton"
    row = {"method": name, "n": n, "d": d, "eps": res.eps, "ms": ms, "calls": calls,
           "n_iters": res.n_iters, "marginal_error": float(res.marginal_error),
           "path": res.path, **_floor(n, d, res.n_iters, dense)}  # fmt: skip
    rows.append(row)
    return row


def _peer(n, d, eps, method, rows):
    import functools

    import numpy as np
    import ot
    import torch
    from torchcfm.optimal_transport import OTPlanSampler

    x0, x1 = _data(n, d)
    x0, x1 = x0.double(), x1.double()
    if method == "sinkhorn":
        s = OTPlanSampler("sinkhorn", reg=eps)
        s.ot_fn = functools.partial(ot.sinkhorn, reg=eps, stopThr=1e-3 / math.sqrt(n))
    else:
        s = OTPlanSampler("exact")

    plans = []

    def call():
        pi = s.get_map(x0, x1)
        i, j = s.sample_map(pi, n)
        plans[:] = [pi]  # kept for the (untimed) marginal error
        return torch.as_tensor(i, device=DEVICE), torch.as_tensor(j, device=DEVICE)

    _sync()
    t0 = time.perf_counter()
    call()
    _sync()
    first = time.perf_counter() - t0
    ms, calls = (1e3 * first, 1) if first > 2.0 else _timed(call, 3, 10.0)
    P = plans[0]
    row = {"method": f"torchcfm-{method}", "n": n, "d": d, "eps": eps if method == "sinkhorn"
           else 0.0, "ms": ms, "calls": calls, "marginal_error": _marginal_error(P, n),
           "finite": bool(np.isfinite(P).all())}  # fmt: skip
    rows.append(row)
    return row, first


def main():
    args = _parse()
    import torch

    from flashsinkhorn.coupling.minibatch import cost_scale

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_coupling.py needs a CUDA device (or --device cpu)")
    sizes = [256, 1024, 4096] if args.quick else [256, 1024, 4096, 16384, 65536]
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    dims = [int(s) for s in args.dims.split(",")]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-")
    rows: list[dict] = []
    have_peers = False
    if not args.no_peers:
        try:
            import torchcfm.optimal_transport  # noqa: F401

            have_peers = True
        except ImportError as exc:
            print(f"torchcfm not available ({exc}): peers skipped")
    peer_time = 0.0
    for d in dims:
        prev = {"sinkhorn": None, "exact": None}
        for n in sizes:
            x0, x1 = _data(n, d)
            msd = cost_scale(x0, x1).msd
            eps = 0.01 * msd
            del x0, x1
            for kw in ({"name": "ours"}, {"name": "ours-exact", "mode": "exact"}):
                if kw["name"] == "ours-exact" and n > args.exact_max:
                    continue
                r = _ours(n, d, eps, rows, **kw)
                print(_fmt(r), flush=True)
            free = torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 0
            if d >= 256 and 4.0 * n * n < 0.25 * free:
                r = _ours(n, d, eps, rows, name="ours-dense", path="dense")
                print(_fmt(r), flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            if not have_peers:
                continue
            for method, power in (("sinkhorn", 2), ("exact", 3)):
                last = prev[method]
                if last is not None:
                    predicted = last[1] * (n / last[0]) ** power
                    if predicted > args.peer_cap or peer_time + predicted > args.peer_budget:
                        rows.append(
                            {
                                "method": f"torchcfm-{method}",
                                "n": n,
                                "d": d,
                                "skipped": f"predicted {predicted:.0f} s per call",
                            }
                        )
                        print(f"torchcfm-{method} n={n} d={d}: skipped (predicted "
                              f"{predicted:.0f} s)", flush=True)  # fmt: skip
                        continue
                try:
                    r, first = _peer(n, d, eps, method, rows)
                except Exception as exc:  # report and go on
                    rows.append({"method": f"torchcfm-{method}", "n": n, "d": d,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})  # fmt: skip
                    print(f"torchcfm-{method} n={n} d={d}: {type(exc).__name__}", flush=True)
                    prev[method] = (n, args.peer_cap + 1)
                    continue
                peer_time += first + r["ms"] * (r["calls"] - 1) / 1e3
                prev[method] = (n, first)
                print(_fmt(r), flush=True)
    _ratios(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d"), "protocol": "bench_coupling.py"}  # fmt: skip
    path = out / f"coupling_{slug}.json"
    with open(path, "w") as fh:
        fh.write("{\n" + f'"meta": {json.dumps(meta)},\n"rows": [\n')
        fh.write(",\n".join(json.dumps(r) for r in rows) + "\n]}\n")
    print(f"wrote {path}")


def _ratios(rows):
    """Speed-up of ``ours`` over each peer at the same (n, d)."""
    ours = {(r["n"], r["d"]): r["ms"] for r in rows if r.get("method") == "ours" and "ms" in r}
    for r in rows:
        if r["method"].startswith("torchcfm") and "ms" in r and (r["n"], r["d"]) in ours:
            r["speedup_of_ours"] = r["ms"] / ours[(r["n"], r["d"])]
            print(f"{r['method']:18s} n={r['n']:6d} d={r['d']:5d}: its time / ours = "
                  f"{r['speedup_of_ours']:.1f}")  # fmt: skip


def _fmt(r: dict) -> str:
    extra = ""
    if "floor_ms" in r:
        extra = (f" its={r['n_iters']:4d} err={r['marginal_error']:.1e} floor={r['floor_ms']:.2f} "
                 f"ms ({r['products']:.2e} FLOP, {r['exps']:.2e} exp, {r['bytes']:.2e} B) "
                 f"path={r['path']}")  # fmt: skip
    else:
        extra = f" err={r['marginal_error']:.1e} finite={r['finite']}"
    return f"{r['method']:18s} n={r['n']:6d} d={r['d']:5d} {r['ms']:10.2f} ms{extra}"


if __name__ == "__main__":
    main()
