"""The reference of each problem: a converged value, and our per-iteration time."""

from __future__ import annotations

import time

from ..judge import dual_value64, marginal_error64
from ..problems import Problem, to_device
from ..timing import Budget, sync

REF_TOL = 1e-6

#: from this size on the reference is our fp32 Triton solve (tf32x3), not the fp64 torch one
REF_FP32_FROM_N = 20_000


def worker(p: Problem, device, budget: Budget, emit, refs) -> None:
    """Reference value and our per-iteration time of one problem."""
    import torch

    import flashsinkhorn as fs

    x, y, a, b = to_device(p, device)
    rho = {"rho_x": p.rho, "rho_y": p.rho} if p.rho else {}
    # per-iteration time: our alternating solve at fixed eps, fixed count
    kw = dict(eps=p.eps, schedule="alternating", scaling=None, acceleration="none", **rho)
    fs.sinkhorn(x, y, a, b, n_iters=10, tol=None, **kw)
    sync(device)
    t0 = time.perf_counter()
    fs.sinkhorn(x, y, a, b, n_iters=40, tol=None, **kw)
    sync(device)
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
    sync(device)
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
