"""The debiased Sinkhorn divergence, forward + backward: ours against OT_eps alone and peers.

S(x, y) = OT(x, y) − ½ OT(x, x) − ½ OT(y, y) is the loss users train with. This script
times one training step of it (value and gradient with respect to x, y fixed) next to the
same step of ``ot_cost`` (the yardstick: the divergence should cost little more than one
OT solve) and the peers' debiased losses, all in one run, and writes
``<out>/divergence_<gpu-slug>.json`` (top-level keys, one row per line) plus a table.

Protocol

- Inputs: fp32, x, y ~ U[0,1]^d, uniform weights, drawn on the CPU from fixed seeds; cost
  ‖x − y‖², eps = 0.1. Sizes: n = m = 10,000 at d = 64 and d = 128, 40,000 at d = 128, and
  a batch of 64 problems of 1024 points at d = 3 (``--quick``: 1000 points, and 4 × 256).
- Modes: ``fixed``, exactly 10 iterations of every solve (``tol=None``; ours with the
  symmetric schedule, whose self terms keep f = g); ``tol``, our default call
  (``tol=1e-3``: the "auto" schedule, acceleration and annealing).
- Methods: ``ours-ot_cost`` (OT(x, y) alone), ``ours-divergence``
  (``sinkhorn_divergence``), ``ours-three-solves`` (three ``ot_cost`` calls composed: what
  the divergence cost before its terms shared one preparation and its self terms became
  one-potential solves); peers in the fixed mode: flash-sinkhorn 0.4.1
  ``SamplesLoss(debias=True, backend="alternating", use_epsilon_scaling=False,
  n_iters=10, threshold=None)``; GeomLoss 0.3.1 tensorized ``SamplesLoss(debias=True,
  blur=sqrt(eps/2))`` with its default eps ladder (``n_iters`` says its length; n <= 10k);
  OTT-JAX 0.6 ``sinkhorn_divergence(PointCloud, ...)`` with ``min_iterations =
  max_iterations = 10`` (fixed) or ``threshold=1e-3`` (tol), gradient by ``jax.grad``
  (n <= 10k: it stores the cost matrices).
- Timing: CUDA synchronised wall clock of value + ``autograd.grad`` (``jax.grad`` jitted),
  one warm-up call (compilation, autotuning), then the median of 3–15 calls (0.5 s).
  ``ratio`` = ms / ms of ``ours-ot_cost`` at the same size and mode.

Usage::

    python bench/bench_divergence.py --out $OUT [--quick] [--providers ours,flash-sinkhorn]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from ttt.timing import device_name, slug, sync, time_calls  # noqa: E402

EPS = 0.1
ITERS = 10
TOL = 1e-3
PEER_MAX_N = 10_000
PROVIDERS = ("ours", "flash-sinkhorn", "geomloss", "ott")


def sizes(quick: bool) -> list[dict]:
    if quick:
        return [dict(B=None, n=1000, d=64), dict(B=4, n=256, d=3)]
    return [
        dict(B=None, n=10_000, d=64),
        dict(B=None, n=10_000, d=128),
        dict(B=None, n=40_000, d=128),
        dict(B=64, n=1024, d=3),
    ]


def label(s: dict) -> str:
    core = f"{s['n']}x{s['n']} d={s['d']}"
    return f"B={s['B']} {core}" if s["B"] else core


def inputs(s: dict, device):
    import torch

    g = torch.Generator().manual_seed(s["n"] * 131 + s["d"])
    lead = () if s["B"] is None else (s["B"],)
    x = torch.rand(*lead, s["n"], s["d"], generator=g)
    y = torch.rand(*lead, s["n"], s["d"], generator=g)
    return x.to(device), y.to(device)


def ours(s, device, mode, emit):
    import torch

    import flashsinkhorn as fs

    x, y = inputs(s, device)
    xg = x.clone().requires_grad_(True)
    kw = dict(eps=EPS)
    if mode == "fixed":
        kw.update(tol=None, n_iters=ITERS, schedule="symmetric", scaling=None)

    def step(loss):
        def call():
            v = loss()
            (gx,) = torch.autograd.grad(v.sum(), xg)
            return v.detach(), gx

        return call

    methods = {
        "ours-ot_cost": lambda: fs.ot_cost(xg, y, **kw),
        "ours-divergence": lambda: fs.sinkhorn_divergence(xg, y, **kw),
        "ours-three-solves": lambda: (
            fs.ot_cost(xg, y, **kw) - 0.5 * (fs.ot_cost(xg, xg, **kw) + fs.ot_cost(y, y, **kw))
        ),
    }
    for name, loss in methods.items():
        stats, (v, _) = time_calls(step(loss), device)
        emit({"method": name, **stats, "value": float(v.double().mean())})


def flash(s, device, mode, emit):
    import torch

    if mode != "fixed":
        return
    import flash_sinkhorn as fsk

    if s["B"] is not None:
        emit({"method": "flash-sinkhorn-debiased", "skipped": "no batched inputs"})
        return
    x, y = inputs(s, device)
    xg = x.clone().requires_grad_(True)
    n = s["n"]
    w = torch.full((n,), 1.0 / n, device=device)
    loss = fsk.SamplesLoss("sinkhorn", p=2, half_cost=False, debias=True, potentials=False,
                           use_epsilon_scaling=False, eps=EPS, n_iters=ITERS,
                           backend="alternating", allow_tf32=True, threshold=None)  # fmt: skip

    def call():
        v = loss(w, xg, w, y)
        (gx,) = torch.autograd.grad(v.sum(), xg)
        return v.detach(), gx

    stats, (v, _) = time_calls(call, device)
    emit({"method": "flash-sinkhorn-debiased", **stats, "value": float(v.double().mean()),
          "settings": "alternating, fixed eps, 10 iterations, TF32"})  # fmt: skip


def geomloss(s, device, mode, emit):
    import torch

    if mode != "fixed":
        return
    from geomloss import SamplesLoss

    row = {"method": "geomloss-tensorized-debiased"}
    if s["n"] > PEER_MAX_N:
        emit({**row, "skipped": f"dense n×m matrices: not run above n = {PEER_MAX_N}"})
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    x, y = inputs(s, device)
    xg = x.clone().requires_grad_(True)
    loss = SamplesLoss("sinkhorn", p=2, blur=math.sqrt(EPS / 2), debias=True,
                       backend="tensorized")  # fmt: skip

    def call():
        v = 2.0 * loss(xg, y)  # GeomLoss's p = 2 cost is ½‖x − y‖²
        (gx,) = torch.autograd.grad(v.sum(), xg)
        return v.detach(), gx

    stats, (v, _) = time_calls(call, device)
    emit({**row, **stats, "value": float(v.double().mean()),
          "settings": "blur=sqrt(eps/2), default scaling 0.5 (its own eps ladder)"})  # fmt: skip


def ott(s, device, mode, emit):
    row = {"method": "ott-sinkhorn_divergence"}
    if s["n"] > PEER_MAX_N:
        emit({**row, "skipped": f"stores the cost matrices: not run above n = {PEER_MAX_N}"})
        return
    import jax
    import jax.numpy as jnp
    from ott.geometry import pointcloud
    from ott.tools import sinkhorn_divergence as sd

    try:
        jax.config.update("jax_default_matmul_precision", "tensorfloat32")
    except Exception:  # noqa: BLE001 (older JAX names it "high")
        jax.config.update("jax_default_matmul_precision", "high")
    x, y = inputs(s, "cpu")
    xs, ys = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())
    if mode == "fixed":
        solve = {"min_iterations": ITERS, "max_iterations": ITERS, "threshold": -1.0}
    else:
        solve = {"threshold": TOL, "max_iterations": 2000}

    def div(x, y):
        return sd.sinkhorn_divergence(pointcloud.PointCloud, x, y, epsilon=EPS,
                                      solve_kwargs=solve)[0]  # fmt: skip

    one = jax.value_and_grad(div)
    fn = jax.jit(jax.vmap(one) if s["B"] else one)

    def call():
        return jax.block_until_ready(fn(xs, ys))

    stats, (v, _) = time_calls(call, "cpu")
    emit({**row, **stats, "value": float(jnp.mean(v)), "settings": json.dumps(solve)})


RUN = {"ours": ours, "flash-sinkhorn": flash, "geomloss": geomloss, "ott": ott}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--modes", default="fixed,tol")
    args = p.parse_args(argv)
    import torch

    rows = []
    for s in sizes(args.quick):
        for mode in args.modes.split(","):
            for prov in args.providers.split(","):

                def emit(r, s=s, mode=mode):
                    rows.append({"size": label(s), "mode": mode, **r})
                    print(_brief(rows[-1]), flush=True)

                try:
                    RUN[prov](s, args.device, mode, emit)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    emit({"method": prov, "error": f"{type(e).__name__}: {e}"[:300]})
                sync(args.device)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    for r in rows:
        base = [q for q in rows if q["size"] == r["size"] and q["mode"] == r["mode"]
                and q["method"] == "ours-ot_cost" and "ms" in q]  # fmt: skip
        if base and "ms" in r:
            r["ratio"] = r["ms"] / base[0]["ms"]
    dev = device_name(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"divergence_{slug(dev)}{'_quick' if args.quick else ''}.json"
    now = _dt.datetime.now(_dt.timezone.utc).isoformat()
    head = {"device": dev, "torch": torch.__version__, "eps": EPS, "iters": ITERS, "tol": TOL,
            "quick": args.quick, "updated": now}  # fmt: skip
    with open(path, "w") as fh:
        fh.write("{\n")
        for k, v in head.items():
            fh.write(f"  {json.dumps(k)}: {json.dumps(v)},\n")
        fh.write('  "rows": [\n')
        fh.write(",\n".join("    " + json.dumps(r) for r in rows))
        fh.write("\n  ]\n}\n")
    print(f"\n{'size':22s} {'mode':6s} {'method':32s} {'ms':>9s} {'ratio':>6s}")
    for r in rows:
        print(_brief(r))
    print(f"wrote {path}")
    return 0


def _brief(r: dict) -> str:
    if "ms" not in r:
        return (
            f"{r['size']:22s} {r['mode']:6s} {r['method']:32s} {r.get('skipped') or r.get('error')}"
        )
    ratio = f"{r['ratio']:6.2f}" if "ratio" in r else "      "
    return f"{r['size']:22s} {r['mode']:6s} {r['method']:32s} {r['ms']:9.2f} {ratio}"


if __name__ == "__main__":
    sys.exit(main())
