"""The Sinkhorn iteration loop. It does not know which backend runs it.

Schedules:
- "symmetric": both half-steps from the same (f, g), averaged with the previous potentials
  (one fused launch per iteration when the backend provides it);
- "alternating": Gauss–Seidel, f from g, then g from the new f.

With a tolerance, the marginal error is tested every ``check_every`` iterations only; the
iterations in between never synchronise with the host. The marginals come for free from the
soft-mins of the step that follows the check, and when the test passes the potentials *before*
that step are returned, so ``marginal_error`` always describes the returned plan exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import Backend
from ..problem import Problem
from .objective import side_error


@dataclass
class SolveState:
    """What the loop hands back to the API layer."""

    f: torch.Tensor
    g: torch.Tensor
    eps: float
    n_iters: int
    converged: bool
    marginal_error: torch.Tensor | None
    errors: list[tuple[int, float]] = field(default_factory=list)


#: Where the next symmetric step stands (Backend.symmetric_step's ``phase``).
_NEXT_PHASE = {"zero": "second", "second": "iterate", "iterate": "iterate"}


def _step(problem, backend, f, g, eps, schedule, phase, want_raw):
    """One iteration; returns (f, g, error of the input plan or None)."""
    X, Y = problem.X, problem.Y
    lx, ly = X.damping(eps), Y.damping(eps)
    prec = problem.precision
    if schedule == "symmetric":
        # The first iteration starts from zero potentials: a plain update, not an average.
        alpha, w = (0.0, 1.0) if phase == "zero" else (0.5, 0.5)
        f_new, g_new, tf, tg = backend.symmetric_step(
            X, Y, f, g, eps, alpha, w * lx, w * ly, want_raw, prec, phase=phase
        )
        err = side_error(X, f, tf, eps) + side_error(Y, g, tg, eps) if want_raw else None
        return f_new, g_new, err
    f_new, tf = backend.softmin(X, Y, g, eps, f, 0.0, lx, want_raw, prec)
    g_new, _ = backend.softmin(Y, X, f_new, eps, g, 0.0, ly, False, prec)
    # The input g was the soft-min of the input f, so the column marginal was exact.
    err = side_error(X, f, tf, eps) if want_raw else None
    return f_new, g_new, err


def _settle_null_points(problem, backend, f, g, eps):
    """Gives zero-weight points the potential of the final plan: the damped soft-min of the
    other side's potential (their entries feed no other update, so the iteration leaves them
    lagging behind; with the symmetric schedule by a geometric average).
    """
    X, Y = problem.X, problem.Y
    prec = problem.precision
    if X.has_null:
        t, _ = backend.softmin(X, Y, g, eps, f, 0.0, X.damping(eps), False, prec)
        f = torch.where(X.w == 0, t, f)
    if Y.has_null:
        t, _ = backend.softmin(Y, X, f, eps, g, 0.0, Y.damping(eps), False, prec)
        g = torch.where(Y.w == 0, t, g)
    return f, g


def solve(
    problem: Problem,
    backend: Backend,
    *,
    eps_list: list[float],
    n_iters: int,
    tol: float | None,
    check_every: int,
    schedule: str,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SolveState:
    """Runs the annealing ladder, then up to ``n_iters`` iterations at ``eps_list[-1]``.

    Args:
        problem: canonical problem.
        backend: soft-min implementation.
        eps_list: eps of each annealing iteration; the last value is the target eps.
        n_iters: iterations at the target eps (the maximum when ``tol`` is given).
        tol: stop once the marginal error of every problem in the batch is <= tol; None runs
            exactly ``n_iters`` iterations.
        check_every: iterations between two tests of the marginal error.
        schedule: "symmetric" or "alternating".
        init: optional warm-start potentials ((B, n), (B, m)).
    """
    X, Y = problem.X, problem.Y
    if init is None:
        f = torch.zeros_like(X.sq)
        g = torch.zeros_like(Y.sq)
        phase = "zero"
    else:
        f, g = init
        phase = "iterate"
    done = 0
    for eps_k in eps_list[:-1]:
        f, g, _ = _step(problem, backend, f, g, eps_k, schedule, phase, False)
        phase = _NEXT_PHASE[phase]
        done += 1
    eps = eps_list[-1]
    errors: list[tuple[int, float]] = []
    for k in range(n_iters):
        check = tol is not None and k > 0 and k % check_every == 0
        f_new, g_new, err = _step(problem, backend, f, g, eps, schedule, phase, check)
        phase = _NEXT_PHASE[phase]
        if check:
            worst = float(err.max())
            errors.append((done, worst))
            if worst <= tol:
                f, g = _settle_null_points(problem, backend, f, g, eps)
                return SolveState(f, g, eps, done, True, err, errors)
        f, g = f_new, g_new
        done += 1
    f, g = _settle_null_points(problem, backend, f, g, eps)
    return SolveState(f, g, eps, done, False, None, errors)
