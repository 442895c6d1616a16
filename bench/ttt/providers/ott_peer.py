"""OTT-JAX: ``Sinkhorn`` on a ``PointCloud``, jitted (vmapped for batches)."""

from __future__ import annotations

import math

from ..judge import TOL, dual_value64, err_fields, marginal_error64, value_fields
from ..problems import Problem, to_device
from ..timing import Budget, iter_cap, time_calls

OTT_METHODS = ("ott-default", "ott-momentum1.5", "ott-anderson5")


def _setup_jax():
    import jax

    jax.config.update("jax_enable_x64", False)
    try:
        jax.config.update("jax_default_matmul_precision", "tensorfloat32")
    except Exception:
        jax.config.update("jax_default_matmul_precision", "high")
    return jax


def worker(p: Problem, device, budget: Budget, emit, refs) -> None:
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
        x, y, a, b = to_device(p, tdev)
        err = marginal_error64(x, y, a, b, f_t, g_t, p.eps, p.rho, p.rho, convention="ott")
        row.update(stats)
        row.update(
            n_iters=int(n_it.max()),
            iter_cap=cap,
            converged=bool(conv.all()),
            solver_error=float(serr.max()),
            **err_fields(err, serr.max(), "its own test (its TF32 cost is no point set)"),
        )
        if p.rho is None:
            f_o = f_t.double() - p.eps * torch.log(a.double())
            g_o = g_t.double() - p.eps * torch.log(b.double())
            row.update(value_fields(p, ref, dual_value64(a, b, f_o, g_o)))
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
