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
- Modes: ``fixed``, exactly 10 updates of the potentials in every solve (``tol=None``; ours
  with the symmetric schedule, whose self terms keep f = g); ``tol``, our default call
  (``tol=1e-3``: the "auto" schedule, acceleration and annealing) and each peer stopped at the
  same marginal error where it can be.
- Methods: ``ours-ot_cost`` (OT(x, y) alone), ``ours-divergence``
  (``sinkhorn_divergence``), ``ours-three-solves`` (three ``ot_cost`` calls composed: what
  the divergence cost before its terms shared one preparation and its self terms became
  one-potential solves). Peers, each at the same problem:

  - flash-sinkhorn 0.4.1 ``SamplesLoss(debias=True, half_cost=False, eps=eps,
    backend="alternating", use_epsilon_scaling=False, n_iters=10, threshold=None)``, TF32;
    fixed mode only (its ``threshold`` tests the change of the potentials, not the
    marginals); no batched inputs.
  - GeomLoss 0.3.1, tensorized backend, debiased. Its p = 2 cost is ½‖x − y‖² at
    eps_g = blur², the same problem at blur = sqrt(eps / 2) with values and potentials
    halved: it runs there and reports 2× its loss (gradient included). ``fixed``: the
    routines ``SamplesLoss(backend="tensorized", debias=True)`` runs (``sinkhorn_loop``,
    ``softmin_tensorized``, ``sinkhorn_cost``) with an eps list of 8 equal values, i.e. one
    initial update, 8 averaged ones and the final extrapolation: 10 updates.
    ``tol``: ``SamplesLoss("sinkhorn", p=2, blur=sqrt(eps/2), scaling=s, debias=True,
    backend="tensorized")``; GeomLoss has no tolerance test, so the smallest s of
    (0.5, 0.6, ..., 0.99) whose cross-term plan reaches 1e-3 (float64 error of its
    potentials, TF32 off) is found first (``calibration``) and timed with TF32 on.
    ``n_iters`` is its update count (eps ladder + 2). Dense n × m matrices (four of them,
    plus the softmin's temporaries): not run above 2.5e8 entries per matrix.
  - OTT-JAX 0.6 ``sinkhorn_divergence(PointCloud, x, y, epsilon=eps, solve_kwargs=...)``
    (its default ``SqEuclidean`` cost is ‖x − y‖², the same eps and values), with
    ``min_iterations = max_iterations = 10, threshold=-1`` (fixed) or ``threshold=1e-3,
    max_iterations=2000`` (tol: its L1 marginal test, the same quantity as ours);
    ``jax.value_and_grad`` w.r.t. x (Danskin: frozen potentials, as ours), ``jax.jit``
    (``jax.vmap`` for the batch), TF32 matmuls; ``n_iters`` lists the iterations of its three
    solves (x–y, x–x, y–y). The ``PointCloud`` without ``batch_size`` materialises the cost
    matrices: not run above 2.5e8 entries either.
  - A peer that is not installed gives a row saying so.
- Timing: synchronised wall clock of value + gradient (``block_until_ready`` for JAX), one
  warm-up call (compilation, autotuning, JIT; ours: two, since a first divergence call
  of a fresh process was followed by calls at 2.5× the median of later ones), then the median
  of 3–15 calls (0.5 s).
  ``ratio`` = ms / ms of ``ours-ot_cost`` at the same size and mode.

Usage::

    python bench/bench_divergence.py --out $OUT [--quick] [--providers ours,flash-sinkhorn]
    python bench/bench_divergence.py --device cpu --quick --out /tmp/d --providers ours,geomloss
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.util
import json
import math
import os
import sys
import traceback
from pathlib import Path

# JAX would otherwise take most of the GPU's memory on its first call, from the torch providers
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from ttt.driver import pick  # noqa: E402
from ttt.judge import marginal_error64  # noqa: E402
from ttt.providers.flash_peer import fixed_samples_loss  # noqa: E402
from ttt.providers.geomloss_peer import (  # noqa: E402
    GEOMLOSS_LADDER,
    ladder_iters,
    potentials_loss,
)
from ttt.timing import device_name, slug, sync, time_calls  # noqa: E402

#: Warm-up calls of our methods (10k², d = 64, 10 iterations, H100: median 9.43 ms against a
#: minimum of 3.64 ms over the 15 calls after one warm-up; 3.73 ms median after two).
WARMUPS = 2

EPS = 0.1
ITERS = 10
TOL = 1e-3
#: the dense peers are not run where one n × m matrix (batch included) has more entries
DENSE_MAX_ENTRIES = 2.5e8
PROVIDERS = ("ours", "flash-sinkhorn", "geomloss", "ott")
#: the modules each peer needs, and the name of its row
NEEDS = {"flash-sinkhorn": ("flash_sinkhorn",), "geomloss": ("geomloss",), "ott": ("jax", "ott")}
METHOD = {
    "flash-sinkhorn": "flash-sinkhorn-debiased",
    "geomloss": "geomloss-tensorized-debiased",
    "ott": "ott-sinkhorn_divergence",
}


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


def entries(s: dict) -> int:
    """Entries of one n × m cost matrix, batch included."""
    return (s["B"] or 1) * s["n"] * s["n"]


def inputs(s: dict, device):
    import torch

    g = torch.Generator().manual_seed(s["n"] * 131 + s["d"])
    lead = () if s["B"] is None else (s["B"],)
    x = torch.rand(*lead, s["n"], s["d"], generator=g)
    y = torch.rand(*lead, s["n"], s["d"], generator=g)
    return x.to(device), y.to(device)


def skip_dense(s: dict, row: dict, what: str, emit) -> bool:
    """Emits ``row`` as skipped when ``what``'s dense n × m matrices would not fit in memory;
    returns whether it did."""
    if entries(s) <= DENSE_MAX_ENTRIES:
        return False
    emit(
        {
            **row,
            "skipped": f"{what}: {entries(s):.3g} entries per n×m matrix > "
            f"{DENSE_MAX_ENTRIES:.3g} (memory)",
        }
    )
    return True


def missing_modules(provider: str) -> list[str]:
    return [m for m in NEEDS.get(provider, ()) if importlib.util.find_spec(m) is None]


@contextlib.contextmanager
def tf32(enabled: bool):
    """torch's TF32 matmul flag for the block, restored afterwards."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def grad_step(loss, xg, scale: float = 1.0):
    """A call of ``scale · loss()`` and its gradient w.r.t. ``xg``: (value, gradient)."""
    import torch

    def call():
        v = scale * loss()
        (gx,) = torch.autograd.grad(v.sum(), xg)
        return v.detach(), gx

    return call


def ours(s, device, mode, emit):
    import flashsinkhorn as fs

    x, y = inputs(s, device)
    xg = x.clone().requires_grad_(True)
    kw = dict(eps=EPS)
    if mode == "fixed":
        kw.update(tol=None, n_iters=ITERS, schedule="symmetric", scaling=None)
    methods = {
        "ours-ot_cost": lambda: fs.ot_cost(xg, y, **kw),
        "ours-divergence": lambda: fs.sinkhorn_divergence(xg, y, **kw),
        "ours-three-solves": lambda: (
            fs.ot_cost(xg, y, **kw) - 0.5 * (fs.ot_cost(xg, xg, **kw) + fs.ot_cost(y, y, **kw))
        ),
    }
    for name, loss in methods.items():
        stats, (v, _) = time_calls(grad_step(loss, xg), device, WARMUPS)
        emit({"method": name, **stats, "value": float(v.double().mean())})


def flash(s, device, mode, emit):
    import torch

    row = {"method": METHOD["flash-sinkhorn"]}
    if mode != "fixed":
        emit({**row, "skipped": "no marginal tolerance (its threshold tests the potentials)"})
        return
    if s["B"] is not None:
        emit({**row, "skipped": "no batched inputs"})
        return
    if not str(device).startswith("cuda"):
        emit({**row, "skipped": "flash-sinkhorn runs on CUDA only"})
        return
    import flash_sinkhorn as fsk

    x, y = inputs(s, device)
    xg = x.clone().requires_grad_(True)
    n = s["n"]
    w = torch.full((n,), 1.0 / n, device=device)
    loss = fixed_samples_loss(fsk, EPS, ITERS, debias=True)
    stats, (v, _) = time_calls(grad_step(lambda: loss(w, xg, w, y), xg), device)
    emit(
        {
            **row,
            **stats,
            "value": float(v.double().mean()),
            "n_iters": ITERS,
            "settings": "alternating, fixed eps, 10 iterations, TF32",
        }
    )


def geomloss_fixed_loss(eps_half: float, iters: int):
    """GeomLoss's tensorized debiased loss on uniform weights, at a constant eps: the
    routines ``SamplesLoss(backend="tensorized", debias=True)`` runs, with an eps list of
    ``iters - 2`` equal values (1 initial update + the list + 1 extrapolation = ``iters``)."""
    import torch
    from geomloss._legacy.sinkhorn_divergence import log_weights, sinkhorn_cost, sinkhorn_loop
    from geomloss._legacy.sinkhorn_samples import cost_routines, softmin_tensorized

    half_cost = cost_routines[2]
    eps_list = [eps_half] * (iters - 2)

    def loss(x, y):
        xb, yb = (x, y) if x.dim() == 3 else (x[None], y[None])
        (B, n, _), m = xb.shape, yb.shape[1]
        a = torch.full((B, n), 1.0 / n, dtype=x.dtype, device=x.device)
        b = torch.full((B, m), 1.0 / m, dtype=x.dtype, device=x.device)
        c_xy, c_yx = half_cost(xb, yb.detach()), half_cost(yb, xb.detach())
        c_xx, c_yy = half_cost(xb, xb.detach()), half_cost(yb, yb.detach())
        f_aa, g_bb, g_ab, f_ba = sinkhorn_loop(
            softmin_tensorized,
            log_weights(a),
            log_weights(b),
            c_xx,
            c_yy,
            c_xy,
            c_yx,
            eps_list,
            None,
            debias=True,
        )
        v = sinkhorn_cost(eps_half, None, a, b, f_aa, g_bb, g_ab, f_ba, batch=True, debias=True)
        return v if x.dim() == 3 else v[0]

    return loss


def geomloss_calibrate(x, y, blur: float):
    """The smallest scaling of the ladder whose cross-term plan reaches ``TOL`` (float64 error
    of its potentials, TF32 off): (scaling or None, what was tried, last error)."""
    import torch

    a = torch.full(x.shape[:-1], 1.0 / x.shape[-2], device=x.device)
    b = torch.full(y.shape[:-1], 1.0 / y.shape[-2], device=y.device)
    tried, e = [], None
    with tf32(False):
        for s in GEOMLOSS_LADDER:
            F, G = potentials_loss(blur, s)(x, y)
            e = float(
                marginal_error64(
                    x, y, a, b, 2 * F.reshape(a.shape), 2 * G.reshape(b.shape), EPS
                ).max()
            )
            tried.append(f"{s}:{e:.2e}")
            if e <= TOL:
                return s, tried, e
    return None, tried, e


def geomloss(s, device, mode, emit):
    row = {"method": METHOD["geomloss"]}
    if skip_dense(s, row, "tensorized", emit):
        return
    from geomloss import SamplesLoss

    x, y = inputs(s, device)
    xg = x.clone().requires_grad_(True)
    blur = math.sqrt(EPS / 2)
    if mode == "fixed":
        fixed = geomloss_fixed_loss(EPS / 2, ITERS)
        loss = lambda: fixed(xg, y)  # noqa: E731
        row.update(
            n_iters=ITERS,
            settings=f"blur=sqrt(eps/2), eps list of {ITERS - 2} equal "
            "values (1 + 8 + 1 updates), TF32",
        )
    else:
        scaling, tried, err = geomloss_calibrate(x, y, blur)
        row.update(calibration=", ".join(tried), calibration_error=err)
        if scaling is None:
            scaling = GEOMLOSS_LADDER[-1]
            row["note"] = f"no scaling of the ladder reached {TOL:g}: {scaling} is timed"
        samples = SamplesLoss(
            "sinkhorn", p=2, blur=blur, scaling=scaling, debias=True, backend="tensorized"
        )
        loss = lambda: samples(xg, y)  # noqa: E731
        row.update(
            n_iters=ladder_iters(x, y, blur, scaling),
            calibrated=f"scaling={scaling}",
            settings="blur=sqrt(eps/2), its eps ladder at the calibrated scaling, TF32",
        )
    with tf32(True):
        stats, (v, _) = time_calls(grad_step(loss, xg, scale=2.0), device)
    emit({**row, **stats, "value": float(v.double().mean())})


def ott(s, device, mode, emit):
    row = {"method": METHOD["ott"]}
    if skip_dense(s, row, "dense PointCloud", emit):
        return
    import jax
    import jax.numpy as jnp
    import numpy as np
    from ott.geometry import pointcloud
    from ott.tools import sinkhorn_divergence as sd

    try:
        jax.config.update("jax_default_matmul_precision", "tensorfloat32")
    except Exception:  # noqa: BLE001 (older JAX names it "high")
        jax.config.update("jax_default_matmul_precision", "high")
    dev = jax.devices("cpu" if device == "cpu" else "gpu")[0]
    x, y = inputs(s, "cpu")
    xs, ys = (jax.device_put(t.numpy(), dev) for t in (x, y))
    if mode == "fixed":
        solve = {"min_iterations": ITERS, "max_iterations": ITERS, "threshold": -1.0}
    else:
        solve = {"threshold": TOL, "max_iterations": 2000}

    def div(x, y):
        d, out = sd.sinkhorn_divergence(
            pointcloud.PointCloud, x, y, epsilon=EPS, solve_kwargs=solve
        )
        its = getattr(out, "n_iters", None)
        return d, (None if its is None else jnp.stack([jnp.asarray(k) for k in its]))

    one = jax.value_and_grad(div, has_aux=True)
    fn = jax.jit(jax.vmap(one) if s["B"] else one)

    def call():
        return jax.block_until_ready(fn(xs, ys))

    stats, ((v, its), _) = time_calls(call, "cpu")  # block_until_ready synchronises
    if its is not None:
        its = np.asarray(its).reshape(-1, 3).max(axis=0)
        row["n_iters"] = [int(k) for k in its]
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
    provs = pick(args.providers, PROVIDERS, "provider")
    modes = pick(args.modes, ("fixed", "tol"), "mode")
    import torch

    missing = {q: missing_modules(q) for q in provs}
    rows = []
    for s in sizes(args.quick):
        for mode in modes:
            for prov in provs:

                def emit(r, s=s, mode=mode):
                    rows.append({"size": label(s), "mode": mode, **r})
                    print(_brief(rows[-1]), flush=True)

                if missing[prov]:
                    emit(
                        {
                            "method": METHOD[prov],
                            "skipped": f"not installed ({', '.join(missing[prov])})",
                        }
                    )
                    continue
                try:
                    RUN[prov](s, args.device, mode, emit)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    emit(
                        {
                            "method": METHOD.get(prov, prov),
                            "error": f"{type(e).__name__}: {e}"[:300],
                        }
                    )
                sync(args.device)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
    for r in rows:
        base = [
            q
            for q in rows
            if q["size"] == r["size"]
            and q["mode"] == r["mode"]
            and q["method"] == "ours-ot_cost"
            and "ms" in q
        ]
        if base and "ms" in r:
            r["ratio"] = r["ms"] / base[0]["ms"]
    dev = device_name(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"divergence_{slug(dev)}{'_quick' if args.quick else ''}.json"
    now = _dt.datetime.now(_dt.timezone.utc).isoformat()
    head = {
        "device": dev,
        "torch": torch.__version__,
        "eps": EPS,
        "iters": ITERS,
        "tol": TOL,
        "quick": args.quick,
        "versions": versions(provs),
        "updated": now,
    }
    with open(path, "w") as fh:
        fh.write("{\n")
        for k, v in head.items():
            fh.write(f"  {json.dumps(k)}: {json.dumps(v)},\n")
        fh.write('  "rows": [\n')
        fh.write(",\n".join("    " + json.dumps(r) for r in rows))
        fh.write("\n  ]\n}\n")
    print(
        f"\n{'size':22s} {'mode':6s} {'method':32s} {'ms':>9s} {'ratio':>6s} {'iters':>10s}  notes"
    )
    for r in rows:
        print(_brief(r))
    print(f"wrote {path}")
    return 0


def versions(provs) -> dict:
    """Versions of the libraries the providers ran (those installed)."""
    from importlib.metadata import PackageNotFoundError, version

    names = {
        "ours": "flashsinkhorn",
        "flash-sinkhorn": "flash-sinkhorn",
        "geomloss": "geomloss",
        "ott": "ott-jax",
    }
    out = {}
    for q in provs:
        for dist in (names[q], "jax") if q == "ott" else (names[q],):
            with contextlib.suppress(PackageNotFoundError):
                out[dist] = version(dist)
    return out


def _brief(r: dict) -> str:
    if "ms" not in r:
        return (
            f"{r['size']:22s} {r['mode']:6s} {r['method']:32s} {r.get('skipped') or r.get('error')}"
        )
    ratio = f"{r['ratio']:6.2f}" if "ratio" in r else "      "
    its = r.get("n_iters")
    its = "-" if its is None else "/".join(map(str, its)) if isinstance(its, list) else str(its)
    notes = "; ".join(r[k] for k in ("calibrated", "note") if r.get(k))
    return (
        f"{r['size']:22s} {r['mode']:6s} {r['method']:32s} {r['ms']:9.2f} {ratio} {its:>10s}  "
        + notes
    )


if __name__ == "__main__":
    sys.exit(main())
