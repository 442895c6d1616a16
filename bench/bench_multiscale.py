"""Multiscale path against the dense streaming path and flash-sinkhorn's multiscale solver.

Problems: two 3-D shapes at n = m (uniform weights), eps = (f · D)² for f in {0.01, 0.001}
with D the bounding-box diagonal of both clouds, tol = 1e-3:

- ``gmm_shell``: x a mixture of 8 Gaussians (centres in [-1, 1]³, std 0.1), y a noisy sphere
  shell (radius 1, radial noise 0.05);
- ``surfaces``: x on a torus (radii 1 and 0.35), y on an ellipsoid (semi-axes 1.2, 0.8, 0.6)
  with noise 0.01.

Methods, each timed on the whole call (host included; median of ``--reps`` after one
untimed first call, whose time is reported as ``first_call_s``):

- ``ours-multiscale``: ``flashsinkhorn.sinkhorn(path="multiscale")`` (fwd) and
  ``ot_cost(path="multiscale")`` + backward w.r.t. x and y (fwdbwd);
- ``ours-streaming``: the same calls with ``path="streaming"`` on CUDA (the torch backend's
  default path on CPU), skipped where the time predicted from a smaller size exceeds
  ``--dense-budget`` seconds; it is the reference of ``value_rel`` and ``grad_rel``;
- ``flash-sinkhorn-multiscale``: ``flash_sinkhorn.SamplesLoss(backend="multiscale")`` with
  blur = sqrt(eps) and its own ``tol=1e-3`` (forward only; skipped when the package is
  missing or the device is not CUDA, or where its time extrapolated as n² exceeds
  ``--peer-budget``, default ``--dense-budget``).

Where eps is below the float32 plan floor (1.2e-5·D², flashsinkhorn/limits.py: eps =
(0.001·D)² is) our solves take float64 points (the torch block-sparse path on the GPU) and the
streaming path is not run.

Output: one JSON file ``<out>/multiscale_<device>.json`` with a row per (shape, n, eps,
method, mode). ``--quick`` runs n = 500 with the first eps factor on the CPU in under a
minute (a smoke test of the script: one call per method, no repetition).

Usage:
    python bench/bench_multiscale.py --out out                  # GPU: 100k, 1M, 4M
    python bench/bench_multiscale.py --out out --sizes 1000000 --shapes gmm_shell
    python bench/bench_multiscale.py --out /tmp/q --quick --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashsinkhorn as fs  # noqa: E402

TOL = 1e-3


def _mixture_shell(n: int, gen: torch.Generator):
    centres = torch.rand(8, 3, generator=gen) * 2 - 1
    lab = torch.randint(0, 8, (n,), generator=gen)
    x = centres[lab] + 0.1 * torch.randn(n, 3, generator=gen)
    s = torch.randn(n, 3, generator=gen)
    s = s / s.norm(dim=1, keepdim=True)
    y = s * (1.0 + 0.05 * torch.randn(n, 1, generator=gen))
    return x, y


def _surfaces(n: int, gen: torch.Generator):
    u = torch.rand(n, generator=gen) * 2 * math.pi
    v = torch.rand(n, generator=gen) * 2 * math.pi
    x = torch.stack(
        [(1 + 0.35 * torch.cos(v)) * torch.cos(u), (1 + 0.35 * torch.cos(v)) * torch.sin(u),
         0.35 * torch.sin(v)], 1,
    )  # fmt: skip
    s = torch.randn(n, 3, generator=gen)
    s = s / s.norm(dim=1, keepdim=True)
    y = s * torch.tensor([1.2, 0.8, 0.6]) + 0.01 * torch.randn(n, 3, generator=gen)
    return x, y


SHAPES = {"gmm_shell": _mixture_shell, "surfaces": _surfaces}


def make(shape: str, n: int):
    gen = torch.Generator().manual_seed(1234 + n)
    x, y = SHAPES[shape](n, gen)
    pts = torch.cat([x, y])
    diam = float((pts.amax(0) - pts.amin(0)).norm())
    return x, y, diam


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, reps: int):
    """(first call s, median s over reps, last output, peak GB of the timed calls)."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    first = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return first, statistics.median(times) if times else first, out, peak


def _ours_fwd(x, y, eps, path):
    def run():
        return fs.sinkhorn(x, y, eps=eps, tol=TOL, path=path)

    return run


def _ours_fwdbwd(x, y, eps, path):
    def run():
        xs, ys = x.detach().requires_grad_(), y.detach().requires_grad_()
        v = fs.ot_cost(xs, ys, eps=eps, tol=TOL, path=path)
        gx, gy = torch.autograd.grad(v, (xs, ys))
        return v.detach(), gx, gy

    return run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _half_step(res, device, reps: int = 10) -> dict:
    """Microbenchmark on the returned solve: one block-sparse soft-min on the final pattern
    (visited scores per second) and one rebuild of the pattern."""
    be, sol = res.solution.backend, res.solution
    p = sol.problem
    args = (p.X, p.Y, sol.g, sol.eps, sol.f, 0.0, 1.0, False, p.precision)
    be.softmin(*args)  # pattern current for these potentials
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        be.softmin(*args)
    _sync(device)
    half = (time.perf_counter() - t0) / reps
    lx, ly = be.layout(p.X), be.layout(p.Y)
    t0 = time.perf_counter()
    pat = be._build(lx, ly, lx.sort(sol.f), ly.sort(sol.g), sol.eps, p.X is p.Y)
    _sync(device)
    rebuild = time.perf_counter() - t0
    from flashsinkhorn.multiscale.clustering import TILE

    scores = pat.pairs * TILE * TILE
    return {"half_step_s": half, "visited_scores": scores, "scores_per_s": scores / half,
            "rebuild_s": rebuild}  # fmt: skip


def _ms_info(res) -> dict:
    be = res.solution.backend
    pat = be.state.pattern
    lay = be.layout(res.solution.problem.X)
    lay_y = be.layout(res.solution.problem.Y)
    return {
        "pairs": None if pat is None else pat.pairs,
        "pair_fraction": None if pat is None else pat.pairs / (lay.tiles * lay_y.tiles),
        "rebuilds": be.state.rebuilds,
        "coarse_iters": be.state.coarse_iters,
        "eps_coarse": getattr(be, "eps_coarse", None),
    }


#: float32 plans need eps >= 1.2e-5·D² (flashsinkhorn.limits.PLAN_FLOOR_ULPS): below it our
#: solves run in float64 (the streaming path then is not the kernels' and is not run).
FP32_FLOOR = 1.2e-5


def _attempt(rows, row, fn, device, reps):
    """Times ``fn``; a failure becomes the row's ``error`` (the grid goes on)."""
    try:
        first, t, out, peak = timed(fn, device, reps)
    except Exception as e:  # noqa: BLE001 (a failure is a result)
        rows.append({**row, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
        return None
    row.update(time_s=t, first_call_s=first, peak_gb=peak)
    return out


def bench_ours(rows, shape, n, eps_f, x, y, eps, device, reps, dense_budget, predicted, diam):
    fp64 = eps < FP32_FLOOR * diam * diam
    if fp64:
        x, y = x.double(), y.double()
    base = {"shape": shape, "n": n, "eps_factor": eps_f, "eps": eps, "tol": TOL,
            "dtype": str(x.dtype).replace("torch.", "")}  # fmt: skip
    dense_path = "streaming" if device.type == "cuda" else "auto"
    ref = {}
    for mode in ("fwd", "fwdbwd"):
        make_fn = _ours_fwd if mode == "fwd" else _ours_fwdbwd
        key = (shape, eps_f, mode)
        guess = predicted.get(key)
        row = {**base, "method": "ours-streaming", "mode": mode}
        if fp64 and device.type == "cuda":
            rows.append({**row, "skipped": "eps below the float32 plan floor; float64 does not "
                                           "run the streaming kernels"})  # fmt: skip
        elif guess is not None and guess[1] * (n / guess[0]) ** 2 > dense_budget:
            rows.append({**row, "skipped": f"predicted {guess[1] * (n / guess[0]) ** 2:.0f} s > "
                                           f"--dense-budget {dense_budget:g} s"})  # fmt: skip
        else:
            out = _attempt(rows, row, make_fn(x, y, eps, dense_path), device, reps)
            if out is not None:
                predicted[key] = (n, row["time_s"])
                if mode == "fwd":
                    row.update(n_iters=out.n_iters, marginal_error=float(out.marginal_error),
                               value=float(out.value))  # fmt: skip
                    ref["value"] = out.value
                else:
                    ref["grads"] = out[1:]
                rows.append(row)
        row = {**base, "method": "ours-multiscale", "mode": mode}
        out = _attempt(rows, row, make_fn(x, y, eps, "multiscale"), device, reps)
        if out is None:
            continue
        if mode == "fwd":
            row.update(n_iters=out.n_iters, marginal_error=float(out.marginal_error),
                       converged=out.converged, value=float(out.value))  # fmt: skip
            row.update(_ms_info(out))
            row.update(_half_step(out, device, reps=max(1, reps) * 3))
            if "value" in ref:
                row["value_rel"] = abs(float(out.value) / float(ref["value"]) - 1.0)
        elif "grads" in ref:
            row["grad_rel_x"] = _rel(out[1], ref["grads"][0])
            row["grad_rel_y"] = _rel(out[2], ref["grads"][1])
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)


def bench_flash(rows, shape, n, eps_f, x, y, eps, device, reps, budget, predicted):
    base = {"shape": shape, "n": n, "eps_factor": eps_f, "eps": eps, "tol": TOL,
            "method": "flash-sinkhorn-multiscale", "mode": "fwd"}  # fmt: skip
    key = ("flash", shape, eps_f)
    guess = predicted.get(key)
    if guess is not None and guess[1] * (n / guess[0]) ** 2 > budget:
        rows.append({**base, "skipped": f"predicted {guess[1] * (n / guess[0]) ** 2:.0f} s > "
                                        f"--peer-budget {budget:g} s"})  # fmt: skip
        return
    if device.type != "cuda":
        rows.append({**base, "skipped": "CUDA only"})
        return
    try:
        import flash_sinkhorn as fsk
    except ImportError:
        rows.append({**base, "skipped": "flash_sinkhorn not installed"})
        return
    loss = fsk.SamplesLoss("sinkhorn", p=2, blur=math.sqrt(eps), backend="multiscale",
                           potentials=True, debias=False, tol=TOL)  # fmt: skip
    a = torch.full((n,), 1.0 / n, device=device)

    def run():
        return loss(a, x, a, y)

    try:
        first, t, _, peak = timed(run, device, reps)
    except Exception as e:  # noqa: BLE001 (a peer's failure is a result)
        rows.append({**base, "error": f"{type(e).__name__}: {e}"[:300]})
        return
    predicted[key] = (n, t)
    rows.append({**base, "time_s": t, "first_call_s": first, "peak_gb": peak, "reps": reps,
                 "version": getattr(fsk, "__version__", "?")})  # fmt: skip
    print(json.dumps(rows[-1]), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--quick", action="store_true", help="n = 500, one eps: CPU smoke test")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="100000,1000000,4000000")
    ap.add_argument("--eps-factors", default="0.01,0.001")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--dense-budget",
        type=float,
        default=120.0,
        help="skip the streaming path where its predicted time exceeds this (s)",
    )
    ap.add_argument(
        "--peer-budget",
        type=float,
        default=None,
        help="the same for flash-sinkhorn (default: --dense-budget)",
    )
    ap.add_argument(
        "--peer-slow",
        type=float,
        default=60.0,
        help="flash-sinkhorn calls predicted above this (s) are timed once, after the smaller "
        "sizes of the same process have compiled its kernels (the row's reps is then 0)",
    )
    ap.add_argument("--no-peer", action="store_true", help="skip flash-sinkhorn")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sizes = [500] if args.quick else [int(s) for s in args.sizes.split(",")]
    factors = [float(f) for f in args.eps_factors.split(",")]
    if args.quick:
        factors = factors[:1]
    reps = 0 if args.quick else args.reps
    rows: list[dict] = []
    predicted: dict = {}
    for shape in args.shapes.split(","):
        for n in sizes:
            x, y, diam = make(shape, n)
            x, y = x.to(device), y.to(device)
            for f in factors:
                eps = (f * diam) ** 2
                r = 1 if n >= 4_000_000 else reps
                bench_ours(rows, shape, n, f, x, y, eps, device, r, args.dense_budget, predicted,
                           diam)  # fmt: skip
                if not args.no_peer:
                    peer_budget = (
                        args.dense_budget if args.peer_budget is None else args.peer_budget
                    )
                    guess = predicted.get(("flash", shape, f))
                    slow = guess is not None and guess[1] * (n / guess[0]) ** 2 > args.peer_slow
                    bench_flash(rows, shape, n, f, x, y, eps, device, 0 if slow else r,
                                peer_budget, predicted)  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"multiscale_{slug}.json")
    meta = {"device": name, "torch": torch.__version__, "quick": args.quick}
    with open(path, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
