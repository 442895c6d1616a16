"""GeomLoss, tensorized backend: the scaling reaching the tolerance is calibrated, then timed."""

from __future__ import annotations

import math

from ..judge import TOL, dual_value64, err_fields, marginal_error64, value_fields
from ..problems import Problem, to_device
from ..timing import Budget, sync, time_calls

GEOMLOSS_LADDER = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97, 0.99)
GEOMLOSS_MAX_N = 20_000


def ladder_iters(x, y, blur, s) -> int | None:
    """Length of GeomLoss's eps ladder + the initial and final full updates."""
    try:
        from geomloss._legacy.sinkhorn_divergence import epsilon_schedule, max_diameter

        xb, yb = (
            (x, y) if x.dim() == 2 else (x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))
        )
        return len(epsilon_schedule(2, max_diameter(xb, yb), blur, s)) + 2
    except Exception:  # noqa: BLE001
        return None


def potentials_loss(blur: float, scaling: float):
    """GeomLoss's tensorized solver at one scaling of its eps ladder, returning the potentials
    of the problem at eps = blur² with the ½‖x − y‖² cost (no debiasing)."""
    from geomloss import SamplesLoss

    return SamplesLoss(
        "sinkhorn",
        p=2,
        blur=blur,
        scaling=scaling,
        debias=False,
        potentials=True,
        backend="tensorized",
    )


def worker(p: Problem, device, budget: Budget, emit, refs) -> None:
    import geomloss  # noqa: F401  (not installed: the worker fails before its first row)
    import torch

    row = {"method": "geomloss-tensorized"}
    sh = p.shape()
    if p.rho is not None:
        emit({**row, "skipped": "unbalanced case: only ours and OTT-JAX are run"})
        return
    if max(sh["n"], sh["m"]) > GEOMLOSS_MAX_N:
        emit({**row, "skipped": f"tensorized needs n*m memory: not run above {GEOMLOSS_MAX_N}"})
        return
    ref = refs.get(p.key(), {})
    x, y, a, b = to_device(p, device)
    blur = math.sqrt(p.eps / 2)

    def make(s):
        loss = potentials_loss(blur, s)

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
        sync(device)
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
        n_iters=ladder_iters(x, y, blur, chosen),
        converged=None,
        **err_fields(error((F, G)), judge, "float64, calibration run in exact fp32"),
        **value_fields(p, ref, dual_value64(a, b, 2 * F, 2 * G)),
    )
    emit(row)
    budget.done_item()
