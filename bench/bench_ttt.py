"""Time to solution: wall time until the marginal error reaches a tolerance, ours and peers.

Users wait for convergence, not for a fixed number of iterations. This script times each
solver, at its best settings, from zero potentials until

    ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ <= tol = 1e-3

(bench/README.md, "Time to solution"), all in one run, and writes ``<out>/ttt_<gpu-slug>.json``
(the format of bench/run.py: top-level keys, one row per line) plus a printed table.

Protocol

- Inputs: fp32, cost ‖x − y‖², uniform weights, drawn on the CPU from fixed seeds, so that
  every provider solves the same problems. Cases (``--quick``: n = m = 2000, B = 8):

  - ``u64``: n = m = 10,000, d = 64, x, y ~ U[0,1]^d, eps in {0.1, 0.01, 0.001}.
  - ``shape3d``: n = m = 50,000, d = 3; x a mixture of 8 Gaussians (centres in [-1, 1]^3,
    std 0.1), y a noisy sphere shell (radius 1, radial noise 0.05); eps = (0.01 · D)² with
    D the diagonal of the bounding box of both clouds.
  - ``mix16``: n = m = 20,000, d = 16; x and y two mixtures of 10 Gaussians (means drawn
    independently in U[0,1]^16, std 0.05), eps = 0.01.
  - ``batched``: B = 64 problems of n = m = 1024, d = 3, U[0,1]^3, eps = 0.001; the
    tolerance applies to each problem (the recomputed error is the worst of the batch).
  - ``unbalanced``: the u64 inputs at eps = 0.01 with rho_x = rho_y = 1 (ours) and
    tau_a = tau_b = rho / (rho + eps) (OTT-JAX). The two solvers' unbalanced objectives
    differ (our entropy is relative to a⊗b, OTT's is not), so values are not compared
    across them; each is timed to the tolerance against its own fixed-point marginals
    (a e^{−f/rho}, b e^{−g/rho}, each with its own potentials).

- Timing: wall clock of the whole call (host work included; CUDA synchronised before and
  after), one warm-up call first (it also compiles, JIT-traces or autotunes; its time is
  ``first_call_s``), then the median of 3 to 15 calls (until 0.5 s of calls; 1 call when
  one takes over 1 s; ``reps``).
- Result of each row: ``n_iters`` (the solver's count; for GeomLoss the length of its eps
  ladder + 2), ``converged`` and ``solver_error`` as the solver reports them, and two
  recomputed errors. ``marginal_error_exact`` is the float64 error of the returned potentials
  on the fp32 input points; it also counts the TF32 rounding of the cost (at eps = 0.001 the
  rounding alone moves every TF32 solver's plan above the tolerance), so it cannot judge.
  ``marginal_error`` is the error on the problem the solver computed, and decides
  ``reached_tol`` (``judged_by`` says which): ours, float64 on the points it solved (with
  precision "tf32" its points are rounded to the grid on which its tensor-core products are
  exact, and its norms are those of the rounded points, so its plan is exactly that
  problem's); OTT-JAX, its own test (its TF32 cross term and fp32 norms describe no point
  set); GeomLoss and flash-sinkhorn, which have no such test, are calibrated in exact fp32
  (TF32 off, judged in float64) and timed with TF32 at the calibrated setting.
- ``value`` (float64, <a, f> + <b, g> from the returned potentials in our convention; for
  batched rows the mean over the batch) and ``value_err``, its largest absolute distance
  to a converged reference: our float64 solve ``flashsinkhorn.sinkhorn(x.double(), ...,
  tol=1e-6, backend="torch")``; for n >= 20k that is too slow, and the reference is our fp32
  Triton solve at tol = 1e-6 with precision="tf32x3" (``ref_note`` says which). References
  are cached in ``<out>/ttt_ref_<gpu-slug>.json`` and reused by later invocations.
- Peers' conventions: OTT-JAX's potentials are f_ott = f + eps log a, g_ott = g + eps log b;
  GeomLoss's p = 2 cost is ½‖x − y‖² at eps_g = blur², so it runs at blur = sqrt(eps / 2)
  and its potentials are half of ours.
- Providers and methods:

  - ours: ``ours-default`` is ``flashsinkhorn.sinkhorn(x, y, a, b, eps=eps, tol=1e-3)``
    (the default call); ``ours-symmetric`` / ``ours-alternating`` (fixed eps, no
    acceleration), ``ours-alt-anneal0.7`` (alternating, eps annealed by 0.7),
    ``ours-overrelax`` and ``ours-anderson`` (alternating, fixed eps), and
    ``ours-anderson-auto-anneal`` (Anderson with the default's annealing rule).
  - OTT-JAX 0.6 (``ott``): ``PointCloud`` + ``LinearProblem`` + ``Sinkhorn(threshold=1e-3)``,
    ``jax.jit``, TF32 matmuls, zero initial potentials (its default initializer), its
    default test every 10 iterations on the L1 norm (``norm_error=1``): in the balanced
    case ‖Pᵀ1 − b‖₁ after its f-update, where P1 = a holds, i.e. the same quantity as ours.
    ``ott-default``, ``ott-momentum1.5`` (``Momentum(value=1.5)``), ``ott-anderson5``
    (``AndersonAcceleration(memory=5)``). Batched: ``jax.vmap``.
  - GeomLoss 0.3.1 (``geomloss``): ``SamplesLoss("sinkhorn", p=2, blur=sqrt(eps/2),
    scaling=s, debias=False, potentials=True, backend="tensorized")``. It has no tolerance
    test: the smallest s of (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99), i.e. the fewest
    iterations, whose plan reaches the tolerance (TF32 off) is found once per problem
    (``calibrated``) and timed (TF32 on). Dense n × m matrices: not run above n = 20k.
  - flash-sinkhorn 0.4.1 (``flash-sinkhorn``, not in the default list: its autotuning takes
    20-70 s per new shape): ``SamplesLoss(backend="alternating", use_epsilon_scaling=False,
    eps=eps, half_cost=False, n_iters=k, threshold=None, potentials=True)``; its ``threshold``
    tests the change of the potentials, not the marginals, so the smallest k reaching the
    tolerance (TF32 off) is calibrated (doubling from 10, then bisection) and timed (TF32). On d = 3
    single problems also its ``backend="multiscale"`` with its own ``tol=1e-3`` (a sampled
    marginal check). Calibration that would exceed the provider's budget is skipped and
    said so in the row.

- Isolation and budget: every (provider, case) runs in a fresh subprocess
  (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` for JAX); a crash or a timeout costs that item
  only. ``--max-seconds`` bounds each provider's total time; iteration caps of the solvers
  come from that budget and the measured per-iteration time, and a row that ran out of it
  says so (``converged`` false, or ``skipped``).

Usage::

    python bench/bench_ttt.py --out $OUT                      # ours, ott, geomloss (< 9 min H100)
    python bench/bench_ttt.py --out $OUT --providers flash-sinkhorn   # second run, merged in
    python bench/bench_ttt.py --device cpu --quick --providers ours,geomloss   # smoke test
    python bench/bench_ttt.py --cases u64,batched --max-seconds 60
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
TOL = 1e-3
REF_TOL = 1e-6
CASES = ("u64", "shape3d", "mix16", "batched", "unbalanced")
PROVIDERS = ("ours", "ott", "geomloss", "flash-sinkhorn")
DEFAULT_PROVIDERS = "ours,ott,geomloss"
GEOMLOSS_LADDER = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99)
GEOMLOSS_MAX_N = 20_000
#: from this size on the reference is our fp32 Triton solve (tf32x3), not the fp64 torch one
REF_FP32_FROM_N = 20_000
#: per-iteration cost of each provider relative to our alternating iteration (for caps)
COST_FACTOR = {"ours": 1.5, "ott": 3.0, "geomloss": 10.0, "flash-sinkhorn": 1.5}
OUR_METHODS = {
    "ours-default": {},
    "ours-symmetric": dict(schedule="symmetric", acceleration="none", scaling=None),
    "ours-alternating": dict(schedule="alternating", acceleration="none", scaling=None),
    "ours-alt-anneal0.7": dict(schedule="alternating", acceleration="none", scaling=0.7),
    "ours-overrelax": dict(schedule="alternating", acceleration="overrelax", scaling=None),
    "ours-anderson": dict(schedule="alternating", acceleration="anderson", scaling=None),
    "ours-anderson-auto-anneal": dict(schedule="alternating", acceleration="anderson"),
}
OTT_METHODS = ("ott-default", "ott-momentum1.5", "ott-anderson5")


# ----------------------------------------------------------------------------- problems


@dataclass
class Problem:
    """One solve: inputs (CPU, fp32), eps and relaxation."""

    case: str
    pid: str
    x: object
    y: object
    a: object
    b: object
    eps: float
    rho: float | None = None

    @property
    def batched(self) -> bool:
        return self.x.dim() == 3

    def shape(self) -> dict:
        B = self.x.shape[0] if self.batched else None
        n, d = self.x.shape[-2:]
        return {"B": B, "n": int(n), "m": int(self.y.shape[-2]), "d": int(d)}

    def key(self) -> str:
        s = self.shape()
        return f"{self.pid}|{s['B']}|{s['n']}|{s['m']}|{s['d']}|{self.eps:.6g}|{self.rho}"


def _uniform(shape):
    import torch

    return torch.full(shape, 1.0 / shape[-1], dtype=torch.float32)


def _gen(seed):
    import torch

    return torch.Generator().manual_seed(seed)


def _mixture(gen, n, means, std):
    import torch

    k, d = means.shape
    lab = torch.randint(0, k, (n,), generator=gen)
    return means[lab] + std * torch.randn(n, d, generator=gen)


def bbox_diameter(x, y) -> float:
    """Diagonal of the bounding box of both clouds (batched: the largest)."""
    import torch

    pts = torch.cat([x, y], dim=-2)
    ext = pts.amax(dim=-2) - pts.amin(dim=-2)
    return float(ext.norm(dim=-1).max())


def make_problems(case: str, quick: bool) -> list[Problem]:
    """The problems of ``case`` (fixed seeds; ``quick``: n = 2000, B = 8)."""
    import torch

    if case in ("u64", "unbalanced"):
        n = 2000 if quick else 10_000
        g = _gen(64)
        x, y = torch.rand(n, 64, generator=g), torch.rand(n, 64, generator=g)
        a, b = _uniform((n,)), _uniform((n,))
        if case == "unbalanced":
            return [Problem(case, "unbalanced/eps=0.01/rho=1", x, y, a, b, 0.01, 1.0)]
        return [Problem(case, f"u64/eps={e:g}", x, y, a, b, e) for e in (0.1, 0.01, 0.001)]
    if case == "shape3d":
        n = 2000 if quick else 50_000
        g = _gen(3)
        centres = torch.rand(8, 3, generator=g) * 2 - 1
        x = _mixture(g, n, centres, 0.1)
        s = torch.randn(n, 3, generator=g)
        s = s / s.norm(dim=1, keepdim=True)
        y = s * (1.0 + 0.05 * torch.randn(n, 1, generator=g))
        eps = (0.01 * bbox_diameter(x, y)) ** 2
        return [Problem(case, "shape3d", x, y, _uniform((n,)), _uniform((n,)), eps)]
    if case == "mix16":
        n = 2000 if quick else 20_000
        g = _gen(16)
        x = _mixture(g, n, torch.rand(10, 16, generator=g), 0.05)
        y = _mixture(g, n, torch.rand(10, 16, generator=g), 0.05)
        return [Problem(case, "mix16", x, y, _uniform((n,)), _uniform((n,)), 0.01)]
    if case == "batched":
        B, n = (8, 2000) if quick else (64, 1024)
        g = _gen(1024)
        x, y = torch.rand(B, n, 3, generator=g), torch.rand(B, n, 3, generator=g)
        return [Problem(case, "batched", x, y, _uniform((B, n)), _uniform((B, n)), 0.001)]
    raise ValueError(f"unknown case {case!r}")


# ----------------------------------------------------------------------------- measurements


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def marginal_error64(x, y, a, b, f, g, eps, rho_x=None, rho_y=None, convention="ours"):
    """‖P1 − a*‖₁ + ‖Pᵀ1 − b*‖₁ in float64 on the device of ``x``, by blocks of rows.

    ``convention="ours"``: P_ij = a_i b_j exp((f_i + g_j − C_ij)/eps); ``"ott"``: the
    potentials include the weights, P_ij = exp((f_i + g_j − C_ij)/eps). C_ij = ‖x_i − y_j‖².
    The target a* is a, or a e^{−f/rho_x} for a relaxed side (with the potentials of the given
    convention, i.e. each solver's own fixed point); b* likewise. Batched inputs (leading B)
    give a (B,) tensor, otherwise a 0-d one.
    """
    import torch

    if x.dim() == 3:
        return torch.stack(
            [
                marginal_error64(x[k], y[k], a[k], b[k], f[k], g[k], eps, rho_x, rho_y, convention)
                for k in range(x.shape[0])
            ]
        )
    dev = x.device
    x, y = x.to(torch.float64), y.to(dev, torch.float64)
    a, b, f, g = (t.to(dev, torch.float64).reshape(-1) for t in (a, b, f, g))
    n, m = x.shape[0], y.shape[0]
    la, lb = torch.log(a), torch.log(b)
    if convention == "ours":
        rf, cg = f / eps + la, g / eps + lb
    elif convention == "ott":
        rf, cg = f / eps, g / eps
    else:
        raise ValueError(convention)
    yy = (y * y).sum(1)
    block = max(1, min(n, (1 << 26) // max(m, 1)))
    row_err = torch.zeros((), dtype=torch.float64, device=dev)
    col_lse = torch.full((m,), -math.inf, dtype=torch.float64, device=dev)
    ta = a if rho_x is None else a * torch.exp(-f / rho_x)
    tb = b if rho_y is None else b * torch.exp(-g / rho_y)
    for i0 in range(0, n, block):
        xi = x[i0 : i0 + block]
        c = ((xi * xi).sum(1)[:, None] + yy[None, :] - 2.0 * xi @ y.T).clamp_min_(0.0)
        s = rf[i0 : i0 + block, None] + cg[None, :] - c / eps
        del c
        row_err += (torch.logsumexp(s, dim=1).exp() - ta[i0 : i0 + block]).abs().sum()
        col_lse = torch.logaddexp(col_lse, torch.logsumexp(s, dim=0))
        del s
    return row_err + (col_lse.exp() - tb).abs().sum()


def dual_value64(a, b, f, g):
    """(B,) or () <a, f> + <b, g> in float64 (potentials in our convention)."""

    f, g = f.double().reshape(a.shape), g.double().reshape(b.shape)
    a, b = a.double(), b.double()
    return (a * f).sum(-1) + (b * g).sum(-1)


def time_calls(fn, device):
    """Warm-up call (``first_call_s``), then the median wall time of repeated calls: at least
    3, until 0.5 s of calls or 15 calls (short calls vary by ±30 % from one call to the next
    on a GPU, so 3 are too few); 1 call when one takes over 1 s. Returns (stats, output of
    the last call)."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    first = time.perf_counter() - t0
    times = []
    while len(times) < 15:
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if times[-1] > 1.0 or (len(times) >= 3 and sum(times) > 0.5):
            break
    stats = {
        "ms": 1e3 * statistics.median(times),
        "ms_min": 1e3 * min(times),
        "reps": len(times),
        "first_call_s": round(first, 3),
    }
    return stats, out


def _to_dev(p: Problem, device):
    return tuple(t.to(device) for t in (p.x, p.y, p.a, p.b))


class Budget:
    """Deadline of one worker, and the share of it a single call may take."""

    def __init__(self, seconds: float, items: int):
        self.end = time.time() + seconds
        self.items_left = max(1, items)

    def left(self) -> float:
        return self.end - time.time()

    def call_s(self, calls_per_item: int = 4, cap: float = 5.0) -> float:
        """Seconds one call of the next item may take (shared by the items left)."""
        return max(0.2, min(cap, self.left() / self.items_left / calls_per_item))

    def done_item(self) -> None:
        self.items_left = max(1, self.items_left - 1)


def iter_cap(ref: dict, provider: str, call_s: float, lo: int = 100, hi: int = 50_000) -> int:
    """Largest iteration count that fits ``call_s`` at the reference's per-iteration time."""
    t_it = ref.get("t_iter_s") or 1e-3
    return int(min(hi, max(lo, call_s / (t_it * COST_FACTOR[provider]))))


def _value_fields(p: Problem, ref: dict | None, value, compare: bool = True) -> dict:
    """``value`` (mean for batches) and its largest distance to the reference."""
    import torch

    v = value.double().flatten().cpu()
    out = {"value": float(v.mean())}
    if ref and compare and ref.get("value") is not None:
        r = torch.tensor(ref["value"], dtype=torch.float64).flatten()
        out["ref_value"] = float(r.mean())
        out["value_err"] = float((v - r).abs().max())
        out["value_rel_err"] = float(((v - r).abs() / r.abs().clamp_min(1e-30)).max())
    return out


def _err_fields(exact, judge=None, judged_by: str = "exact points") -> dict:
    """The error that decides ``reached_tol`` (``marginal_error``, measured on the problem the
    solver computed: ``judged_by`` says how) and the float64 error of the returned
    potentials on the fp32 input points (``marginal_error_exact``: it also counts the TF32
    rounding of the cost, which at eps = 0.001 alone exceeds the tolerance for every
    solver)."""
    e_exact = float(exact.max())
    e = e_exact if judge is None else float(judge.max() if hasattr(judge, "max") else judge)
    return {
        "marginal_error": e,
        "reached_tol": bool(e <= TOL),
        "judged_by": judged_by,
        "marginal_error_exact": e_exact,
    }


def solved_points(res):
    """The points a result of ours solved: centred, and with precision "tf32" rounded to the
    grid its tensor-core products are exact on (norms and products describe these points)."""
    prob = res.solution.problem
    return prob.unbatch(prob.X.x), prob.unbatch(prob.Y.x)


# ----------------------------------------------------------------------------- workers


def worker_ref(p: Problem, device, budget: Budget, emit, refs) -> None:
    """Reference value and our per-iteration time of one problem."""
    import torch

    import flashsinkhorn as fs

    x, y, a, b = _to_dev(p, device)
    rho = {"rho_x": p.rho, "rho_y": p.rho} if p.rho else {}
    # per-iteration time: our alternating solve at fixed eps, fixed count
    kw = dict(eps=p.eps, schedule="alternating", scaling=None, acceleration="none", **rho)
    fs.sinkhorn(x, y, a, b, n_iters=10, tol=None, **kw)
    _sync(device)
    t0 = time.perf_counter()
    fs.sinkhorn(x, y, a, b, n_iters=40, tol=None, **kw)
    _sync(device)
    t_iter = (time.perf_counter() - t0) / 40
    t0 = time.perf_counter()
    if str(device).startswith("cuda") and p.shape()["n"] >= REF_FP32_FROM_N:
        note = f"fp32 triton solve, precision=tf32x3, tol={REF_TOL:g}"
        res = fs.sinkhorn(
            x,
            y,
            a,
            b,
            eps=p.eps,
            tol=REF_TOL,
            n_iters=4000,
            acceleration="none",
            backend="triton",
            precision="tf32x3",
            **rho,
        )
    else:
        note = f"float64 torch solve, tol={REF_TOL:g}"
        x64, y64, a64, b64 = (t.double() for t in (x, y, a, b))
        res = fs.sinkhorn(
            x64,
            y64,
            a64,
            b64,
            eps=p.eps,
            tol=REF_TOL,
            n_iters=4000,
            acceleration="none",
            backend="torch",
            **rho,
        )
    _sync(device)
    ref_s = time.perf_counter() - t0
    err = marginal_error64(x, y, a, b, res.f, res.g, p.eps, p.rho, p.rho)
    value = res.value if p.rho else dual_value64(a, b, res.f, res.g)
    emit(
        {
            "kind": "ref",
            "key": p.key(),
            "pid": p.pid,
            "value": value.double().cpu().tolist(),
            "ref_note": note,
            "ref_iters": int(res.n_iters),
            "ref_error": float(err.max()),
            "ref_converged": bool(res.converged),
            "ref_s": round(ref_s, 2),
            "t_iter_s": t_iter,
        }
    )
    del x, y, a, b, res
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


def worker_ours(p: Problem, device, budget: Budget, emit, refs) -> None:
    import flashsinkhorn as fs

    x, y, a, b = _to_dev(p, device)
    ref = refs.get(p.key(), {})
    rho = {"rho_x": p.rho, "rho_y": p.rho} if p.rho else {}
    for method, kw in OUR_METHODS.items():
        row = {"method": method, "settings": json.dumps(kw) if kw else "default call"}
        if budget.left() < 2:
            emit({**row, "skipped": "provider time budget (--max-seconds) spent"})
            continue
        cap = iter_cap(ref, "ours", budget.call_s())
        if method == "ours-default":
            cap = max(cap, 1000)  # the default call keeps its default maximum

        def call(kw=kw, cap=cap):
            return fs.sinkhorn(x, y, a, b, eps=p.eps, tol=TOL, n_iters=cap, **kw, **rho)

        try:
            stats, res = time_calls(call, device)
        except Exception as e:  # noqa: BLE001
            emit({**row, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        err = marginal_error64(x, y, a, b, res.f, res.g, p.eps, p.rho, p.rho)
        xs, ys = solved_points(res)
        judge = marginal_error64(xs, ys, a, b, res.f, res.g, p.eps, p.rho, p.rho)
        value = res.value if p.rho else dual_value64(a, b, res.f, res.g)
        row.update(stats)
        row.update(
            n_iters=int(res.n_iters),
            iter_cap=cap,
            converged=bool(res.converged),
            solver_error=float(res.marginal_error.max()),
            schedule=res.schedule,
            acceleration=res.acceleration,
            **_err_fields(err, judge, "float64 on the points it solved (TF32-rounded)"),
            **_value_fields(p, ref, value),
        )
        emit(row)
        budget.done_item()


def _setup_jax():
    import jax

    jax.config.update("jax_enable_x64", False)
    try:
        jax.config.update("jax_default_matmul_precision", "tensorfloat32")
    except Exception:
        jax.config.update("jax_default_matmul_precision", "high")
    return jax


def worker_ott(p: Problem, device, budget: Budget, emit, refs) -> None:
    jax = _setup_jax()
    import jax.numpy as jnp
    import numpy as np
    import torch
    from ott.geometry import pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import acceleration, sinkhorn

    dev = jax.devices("cpu" if device == "cpu" else "gpu")[0]
    ref = refs.get(p.key(), {})
    xs, ys, as_, bs = (jax.device_put(t.numpy(), dev) for t in (p.x, p.y, p.a, p.b))
    tau = None if p.rho is None else p.rho / (p.rho + p.eps)
    for method in OTT_METHODS:
        row = {"method": method}
        if budget.left() < 3:
            emit({**row, "skipped": "provider time budget (--max-seconds) spent"})
            continue
        cap = iter_cap(ref, "ott", budget.call_s())
        cap = int(math.ceil(cap / 10) * 10)
        accel = {}
        if method == "ott-momentum1.5":
            accel = {"momentum": acceleration.Momentum(value=1.5)}
        elif method == "ott-anderson5":
            accel = {"anderson": acceleration.AndersonAcceleration(memory=5)}
        solver = sinkhorn.Sinkhorn(threshold=TOL, max_iterations=cap, **accel)
        row["settings"] = f"threshold={TOL:g}, norm_error=1, inner_iterations=10, " + (
            ", ".join(f"{k}={v}" for k, v in accel.items()) or "no acceleration"
        )

        def solve(x, y, a, b, solver=solver):
            geom = pointcloud.PointCloud(x, y, epsilon=p.eps)
            kw = {} if tau is None else {"tau_a": tau, "tau_b": tau}
            out = solver(linear_problem.LinearProblem(geom, a=a, b=b, **kw))
            errs = out.errors
            last = jnp.max(jnp.where(errs >= 0, jnp.arange(errs.shape[-1]), -1))
            return out.f, out.g, out.n_iters, out.converged, errs[jnp.maximum(last, 0)]

        fn = jax.jit(jax.vmap(solve) if p.batched else solve)

        def call(fn=fn):
            return jax.block_until_ready(fn(xs, ys, as_, bs))

        try:
            stats, out = time_calls(call, "cpu")  # block_until_ready synchronises
        except Exception as e:  # noqa: BLE001
            emit({**row, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        f, g, n_it, conv, serr = (np.asarray(o) for o in out)
        tdev = "cuda" if str(device).startswith("cuda") else "cpu"
        f_t, g_t = torch.from_numpy(f).to(tdev), torch.from_numpy(g).to(tdev)
        x, y, a, b = _to_dev(p, tdev)
        err = marginal_error64(x, y, a, b, f_t, g_t, p.eps, p.rho, p.rho, convention="ott")
        row.update(stats)
        row.update(
            n_iters=int(n_it.max()),
            iter_cap=cap,
            converged=bool(conv.all()),
            solver_error=float(serr.max()),
            **_err_fields(err, serr.max(), "its own test (its TF32 cost is no point set)"),
        )
        if p.rho is None:
            f_o = f_t.double() - p.eps * torch.log(a.double())
            g_o = g_t.double() - p.eps * torch.log(b.double())
            row.update(_value_fields(p, ref, dual_value64(a, b, f_o, g_o)))
            row["solver_error_is"] = "‖Pᵀ1 − b‖₁ after its f-update (P1 = a): both marginals"
        else:
            row["note"] = (
                "OTT's unbalanced entropy differs from ours (ours relative to a⊗b): value "
                "not compared; error against its own fixed point b e^{-g_ott/rho}"
            )
            row["solver_error_is"] = "L1 of both marginals against its own fixed point"
        row["tau"] = tau
        emit(row)
        budget.done_item()
        del x, y, a, b, f_t, g_t


def _geomloss_n_iters(x, y, blur, s) -> int | None:
    """Length of GeomLoss's eps ladder + the initial and final full updates."""
    try:
        from geomloss._legacy.sinkhorn_divergence import epsilon_schedule, max_diameter

        xb, yb = (
            (x, y) if x.dim() == 2 else (x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))
        )
        return len(epsilon_schedule(2, max_diameter(xb, yb), blur, s)) + 2
    except Exception:  # noqa: BLE001
        return None


def worker_geomloss(p: Problem, device, budget: Budget, emit, refs) -> None:
    import torch
    from geomloss import SamplesLoss

    row = {"method": "geomloss-tensorized"}
    sh = p.shape()
    if p.rho is not None:
        emit({**row, "skipped": "unbalanced case: only ours and OTT-JAX are run"})
        return
    if max(sh["n"], sh["m"]) > GEOMLOSS_MAX_N:
        emit({**row, "skipped": f"tensorized needs n*m memory: not run above {GEOMLOSS_MAX_N}"})
        return
    ref = refs.get(p.key(), {})
    x, y, a, b = _to_dev(p, device)
    blur = math.sqrt(p.eps / 2)

    def make(s):
        loss = SamplesLoss(
            "sinkhorn",
            p=2,
            blur=blur,
            scaling=s,
            debias=False,
            potentials=True,
            backend="tensorized",
        )

        def call():
            F, G = loss(a, x, b, y)
            return F.reshape(a.shape), G.reshape(b.shape)

        return call

    def error(out):
        F, G = out
        return marginal_error64(x, y, a, b, 2 * F, 2 * G, p.eps)

    # Calibrated in exact fp32 (TF32 off), where the float64 error describes the problem it
    # solves; timed with TF32 on at the calibrated scaling.
    chosen, tried, judge = None, [], None
    torch.backends.cuda.matmul.allow_tf32 = False
    for s in GEOMLOSS_LADDER:
        if budget.left() < 2:
            break
        e = float(error(make(s)()).max())
        _sync(device)
        tried.append(f"{s}:{e:.2e}")
        judge = e
        if e <= TOL:
            chosen = s
            break
    torch.backends.cuda.matmul.allow_tf32 = True
    if chosen is None:
        if not tried:
            emit({**row, "skipped": "provider time budget (--max-seconds) spent"})
            return
        chosen = float(tried[-1].split(":")[0])
        row["note"] = "no scaling of the ladder reached the tolerance: the last tried is timed"
    stats, (F, G) = time_calls(make(chosen), device)
    row.update(stats)
    row.update(
        settings=f"blur=sqrt(eps/2)={blur:.4g}, tensorized, debias=False",
        calibrated=f"scaling={chosen}",
        calibration=", ".join(tried),
        n_iters=_geomloss_n_iters(x, y, blur, chosen),
        converged=None,
        **_err_fields(error((F, G)), judge, "float64, calibration run in exact fp32"),
        **_value_fields(p, ref, dual_value64(a, b, 2 * F, 2 * G)),
    )
    emit(row)
    budget.done_item()


def worker_flash(p: Problem, device, budget: Budget, emit, refs) -> None:
    import flash_sinkhorn as fsk

    row = {"method": "flash-sinkhorn-alt"}
    if p.rho is not None:
        emit({**row, "skipped": "unbalanced case: only ours and OTT-JAX are run"})
        return
    if not str(device).startswith("cuda"):
        emit({**row, "skipped": "flash-sinkhorn runs on CUDA only"})
        return
    ref = refs.get(p.key(), {})
    x, y, a, b = _to_dev(p, device)

    def make(k, tf32=True):
        loss = fsk.SamplesLoss(
            "sinkhorn",
            p=2,
            half_cost=False,
            debias=False,
            potentials=True,
            use_epsilon_scaling=False,
            eps=p.eps,
            n_iters=k,
            backend="alternating",
            allow_tf32=tf32,
            threshold=None,
        )

        def call():
            F, G = loss(a, x, b, y)
            return F.reshape(a.shape), G.reshape(b.shape)

        return call

    def error(out):
        return float(marginal_error64(x, y, a, b, out[0], out[1], p.eps).max())

    # calibration: doubling from 10 (the first call also autotunes), then bisection
    t_it = (ref.get("t_iter_s") or 1e-3) * COST_FACTOR["flash-sinkhorn"]
    t0 = time.perf_counter()
    # calibrated in exact fp32 (where the float64 error describes the problem it solves),
    # timed with TF32 at the calibrated count
    tried, k, lo, hi, judge = [], 10, 0, None, None
    while budget.left() > 5:
        if k * t_it > budget.call_s(calls_per_item=8, cap=10.0):
            break
        e = error(make(k, tf32=False)())
        tried.append(f"{k}:{e:.2e}")
        if e <= TOL:
            hi, judge = k, e
            break
        lo, k = k, 2 * k
    if hi is None:
        why = "budget spent" if budget.left() <= 5 else f"would need > {k // 2} iterations"
        emit(
            {
                **row,
                "skipped": f"calibration would exceed the provider budget ({why})",
                "calibration": ", ".join(tried),
            }
        )
    else:
        while hi - lo > max(5, hi // 16) and budget.left() > 5 + 2 * hi * t_it:
            mid = (lo + hi) // 2
            e = error(make(mid, tf32=False)())
            tried.append(f"{mid}:{e:.2e}")
            if e <= TOL:
                hi, judge = mid, e
            else:
                lo = mid
        calib_s = time.perf_counter() - t0
        stats, (F, G) = time_calls(make(hi), device)
        row.update(stats)
        row.update(
            settings="alternating, fixed eps (use_epsilon_scaling=False), half_cost=False, "
            "TF32, threshold=None",
            calibrated=f"n_iters={hi}",
            calibration=", ".join(tried),
            calibration_s=round(calib_s, 1),
            n_iters=hi,
            converged=None,
            **_err_fields(
                marginal_error64(x, y, a, b, F, G, p.eps),
                judge,
                "float64, calibration run in exact fp32",
            ),
            **_value_fields(p, ref, dual_value64(a, b, F, G)),
        )
        emit(row)
    budget.done_item()
    if p.shape()["d"] == 3 and not p.batched:
        _flash_multiscale(fsk, p, x, y, a, b, device, budget, emit, ref)


def _flash_multiscale(fsk, p, x, y, a, b, device, budget, emit, ref) -> None:
    row = {"method": "flash-sinkhorn-multiscale"}
    if budget.left() < 20:
        emit({**row, "skipped": "provider time budget (--max-seconds) spent"})
        return
    loss = fsk.SamplesLoss(
        "sinkhorn",
        p=2,
        blur=math.sqrt(p.eps),
        backend="multiscale",
        potentials=True,
        debias=False,
        tol=TOL,
    )

    def call():
        F, G = loss(a, x, b, y)
        return F.reshape(a.shape), G.reshape(b.shape)

    stats, (F, G) = time_calls(call, device)
    info = getattr(loss, "last_multiscale_info", None)
    row.update(stats)
    row.update(
        settings=f"backend=multiscale, blur=sqrt(eps), its own tol={TOL:g} (sampled check)",
        converged=None if info is None else bool(info.accepted),
        n_iters=None if info is None else int(info.continuation_updates + info.fine_updates),
        note=None if info is None else f"stop={info.stop}, returned={info.returned}",
        **_err_fields(marginal_error64(x, y, a, b, F, G, p.eps)),
        **_value_fields(p, ref, dual_value64(a, b, F, G)),
    )
    emit(row)


WORKERS = {
    "ours": worker_ours,
    "ott": worker_ott,
    "geomloss": worker_geomloss,
    "flash-sinkhorn": worker_flash,
}


def _versions(provider: str) -> dict:
    out = {}
    try:
        if provider == "ott":
            import jax
            import ott

            out = {"ott-jax": getattr(ott, "__version__", "?"), "jax": jax.__version__}
        elif provider == "geomloss":
            import geomloss

            out = {"geomloss": getattr(geomloss, "__version__", "?")}
        elif provider == "flash-sinkhorn":
            import flash_sinkhorn

            out = {"flash-sinkhorn": getattr(flash_sinkhorn, "__version__", "?")}
    except Exception:  # noqa: BLE001
        pass
    return out


def worker_main(args) -> int:
    """Runs one (provider, case) and appends one JSON line per row to ``args.worker_out``."""
    for path in (str(BENCH), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    problems = make_problems(args.cases, args.quick)
    refs = json.loads(Path(args.refs).read_text()) if args.refs else {}
    device = args.device
    out = open(args.worker_out, "a", encoding="utf-8")  # noqa: SIM115
    state = {"p": problems[0]}

    def emit(row: dict) -> None:
        p = state["p"]
        base = {
            "case": p.case,
            "problem": p.pid,
            **p.shape(),
            "eps": p.eps,
            "rho": p.rho,
            "tol": TOL,
            "provider": args.worker,
        }
        if row.get("kind") != "ref":
            r = refs.get(p.key(), {})
            base.update({k: r[k] for k in ("ref_note", "ref_error") if k in r})
        out.write(json.dumps({**base, **row}) + "\n")
        out.flush()
        print(
            f"  {args.worker:14s} {p.pid:28s} {row.get('method', 'reference'):24s} " + _brief(row),
            flush=True,
        )

    budget = Budget(args.max_seconds, len(problems) * (6 if args.worker == "ours" else 3))
    fn = worker_ref if args.worker == "ref" else WORKERS[args.worker]
    for p in problems:
        state["p"] = p
        fn(p, device, budget, emit, refs)
    out.close()
    return 0


def _brief(row: dict) -> str:
    if row.get("error") or row.get("skipped"):
        return f"{'error' if row.get('error') else 'skipped'}: {row.get('error') or row['skipped']}"
    if row.get("kind") == "ref":
        return f"ref {row['ref_note']}: iters={row['ref_iters']} err={row['ref_error']:.1e}"
    return (
        f"{row['ms']:10.2f} ms  it={row.get('n_iters')}  err={row['marginal_error']:.2e}  "
        f"dv={row.get('value_err', float('nan')):.1e}"
    )


# ----------------------------------------------------------------------------- driver


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip().splitlines()[0].strip() or "cuda"
    except Exception:  # noqa: BLE001
        return "cuda"


def run_item(args, provider: str, case: str, seconds: float, refs_path: str | None) -> list[dict]:
    """One (provider, case) in a fresh subprocess; its rows, or an error row."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as tmp:
        path = tmp.name
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        provider,
        "--cases",
        case,
        "--device",
        args.device,
        "--worker-out",
        path,
        "--max-seconds",
        f"{seconds:.1f}",
    ]
    if args.quick:
        cmd.append("--quick")
    if refs_path:
        cmd += ["--refs", refs_path]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    timeout = seconds + args.grace
    t0 = time.time()
    err = None
    try:
        proc = subprocess.run(
            cmd, env=env, timeout=timeout, stdout=None, stderr=subprocess.PIPE, text=True
        )
        if proc.returncode != 0:
            err = f"worker exit {proc.returncode}: " + " | ".join(
                proc.stderr.strip().splitlines()[-3:]
            )
    except subprocess.TimeoutExpired:
        err = f"worker timed out after {timeout:.0f} s"
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    os.unlink(path)
    if err:
        print(f"  {provider}/{case}: {err[:400]}", flush=True)
        rows.append(
            {
                "case": case,
                "provider": provider,
                "method": f"{provider}-*",
                "error": err[:400],
                "wall_s": round(time.time() - t0, 1),
            }
        )
    return rows


def row_key(r: dict) -> tuple:
    return (r.get("case"), r.get("problem"), r.get("n"), r.get("B"), r.get("method"))


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'problem':26s} {'size':20s} {'method':26s} {'ms':>10s} {'iters':>6s} "
        f"{'err (fp64)':>10s} {'|dv| to ref':>11s}  notes"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        size = f"{r.get('n')}x{r.get('m')} d={r.get('d')}" + (f" B={r['B']}" if r.get("B") else "")
        name = f"{r.get('problem', r.get('case', '')):26s} {size:20s} {r.get('method', ''):26s}"
        if r.get("error") or r.get("skipped"):
            what = "error: " + r["error"] if r.get("error") else "skipped: " + r["skipped"]
            lines.append(f"{name} {what[:90]}")
            continue
        dv = f"{r['value_err']:.1e}" if r.get("value_err") is not None else "-"
        notes = []
        if not r.get("reached_tol"):
            notes.append("TOL NOT REACHED")
        if r.get("calibrated"):
            notes.append(r["calibrated"])
        if r.get("converged") is False:
            notes.append(f"not converged (cap {r.get('iter_cap')})")
        lines.append(
            f"{name} {r['ms']:10.2f} {str(r.get('n_iters', '-')):>6s} "
            f"{r['marginal_error']:10.2e} {dv:>11s}  {'; '.join(notes)}"
        )
    return "\n".join(lines)


def driver_main(args) -> int:
    cases = [c for c in args.cases.split(",") if c]
    provs = [p for p in args.providers.split(",") if p]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; choose from {', '.join(CASES)}")
    for p in provs:
        if p not in PROVIDERS:
            raise SystemExit(f"unknown provider {p!r}; choose from {', '.join(PROVIDERS)}")
    provs = [p for p in PROVIDERS if p in provs]  # flash-sinkhorn last
    out_dir = Path(args.out or os.environ.get("OUT") or BENCH / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    dev_name = device_name(args.device)
    stem = _slug(dev_name) + ("_quick" if args.quick else "")
    out_path = out_dir / f"ttt_{stem}.json"
    ref_path = out_dir / f"ttt_ref_{stem}.json"
    refs = json.loads(ref_path.read_text()) if ref_path.exists() else {}
    left = {p: float(args.max_seconds) for p in provs}
    ref_left = float(args.ref_seconds)
    new_rows: list[dict] = []
    versions: dict = {}
    t_start = time.time()
    print(f"time to solution, tol={TOL:g}, device {dev_name}, cases {cases}, providers {provs}")
    for case in cases:
        missing = [p for p in make_problems(case, args.quick) if p.key() not in refs]
        if missing:
            t0 = time.time()
            for r in run_item(args, "ref", case, max(30.0, ref_left), None):
                if r.get("kind") == "ref":
                    refs[r["key"]] = {k: v for k, v in r.items() if k not in ("kind", "provider")}
            ref_left -= time.time() - t0
            ref_path.write_text(json.dumps(refs, indent=1) + "\n")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
            json.dump(refs, tmp)
            refs_tmp = tmp.name
        for prov in provs:
            if left[prov] < 5:
                new_rows.append(
                    {
                        "case": case,
                        "provider": prov,
                        "method": f"{prov}-*",
                        "skipped": "provider time budget (--max-seconds) spent",
                    }
                )
                continue
            t0 = time.time()
            new_rows += run_item(args, prov, case, left[prov], refs_tmp)
            left[prov] -= time.time() - t0
        os.unlink(refs_tmp)
    for prov in provs:
        versions.update(_versions(prov))
    import torch

    info = {"device": dev_name, "torch": torch.__version__, "tol": TOL, "quick": args.quick}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    keep = {row_key(r) for r in new_rows}
    old = json.loads(out_path.read_text()).get("rows", []) if out_path.exists() else []
    rows = [r for r in old if row_key(r) not in keep] + new_rows
    order = {c: i for i, c in enumerate(CASES)}
    rows.sort(
        key=lambda r: (
            order.get(r.get("case"), 99),
            str(r.get("problem")),
            PROVIDERS.index(r["provider"]) if r.get("provider") in PROVIDERS else 9,
        )
    )
    data = {
        **info,
        "versions": versions,
        "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    try:
        from run import results_json

        text = results_json(data)
    except Exception:  # noqa: BLE001
        text = json.dumps(data, indent=1) + "\n"
    out_path.write_text(text)
    print()
    print(format_table(rows))
    print(
        f"\nwrote {out_path} ({len(new_rows)} new rows) in {time.time() - t_start:.0f} s; "
        f"time left per provider: { {k: round(v) for k, v in left.items()} }"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument(
        "--providers",
        default=DEFAULT_PROVIDERS,
        help=f"comma list of {', '.join(PROVIDERS)} (default {DEFAULT_PROVIDERS})",
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--quick", action="store_true", help="n = m = 2000, B = 8 (smoke test)")
    p.add_argument("--out", default=None, help="folder for ttt_<gpu-slug>.json (default $OUT)")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=130.0,
        help="time budget of each provider over all cases (default 130)",
    )
    p.add_argument(
        "--ref-seconds",
        type=float,
        default=100.0,
        help="time budget of the reference solves over all cases (default 100)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=60.0,
        help="seconds past its budget before a worker is killed (default 60)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--refs", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
