"""Our solver: the default call and each schedule / acceleration."""

from __future__ import annotations

import json

from ..judge import TOL, dual_value64, err_fields, marginal_error64, solved_points, value_fields
from ..problems import Problem, to_device
from ..timing import Budget, iter_cap, time_calls

OUR_METHODS = {
    "ours-default": {},
    "ours-symmetric": dict(schedule="symmetric", acceleration="none", scaling=None),
    "ours-alternating": dict(schedule="alternating", acceleration="none", scaling=None),
    "ours-alt-anneal0.7": dict(schedule="alternating", acceleration="none", scaling=0.7),
    "ours-overrelax": dict(schedule="alternating", acceleration="overrelax", scaling=None),
    "ours-anderson": dict(schedule="alternating", acceleration="anderson", scaling=None),
    "ours-anderson-auto-anneal": dict(schedule="alternating", acceleration="anderson"),
}


def worker(p: Problem, device, budget: Budget, emit, refs) -> None:
    import flashsinkhorn as fs

    x, y, a, b = to_device(p, device)
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
            # Judged like OTT-JAX, by its own test (the float32 plan it returns and applies);
            # the float64 check on the points it solved is reported beside it.
            **err_fields(err, res.marginal_error.max(), "its own test (float32)", check=judge),
            **value_fields(p, ref, value),
        )
        emit(row)
        budget.done_item()
