"""The Sinkhorn iteration loop: the only one in the library. It does not know its backend.

Schedules:
- "symmetric": both half-steps from the same (f, g), averaged with the previous potentials
  (one fused launch per iteration when the backend provides it);
- "alternating": Gauss–Seidel, f from g, then g from the new f.

A *self* problem (``problem.X is problem.Y``, the terms OT(a, a) of a divergence) has one
potential: each iteration is one soft-min of it, averaged as in the symmetric schedule.

With a tolerance, the marginal error is tested every ``check_every`` iterations only; the
iterations in between never synchronise with the host. The marginals come for free from the
soft-mins of the step that follows the check, and when the test passes the potentials *before*
that step are returned, so ``marginal_error`` always describes the returned plan exactly.
A sharded backend reduces the error over its ranks (``Backend.reduce_error``) before the test.

``extrapolate=True`` ends with one plain (unaveraged) update of every potential from the
previous ones and returns both: GeomLoss's "last extrapolation", whose gradients use the
plans of (new f, previous g) and (previous f, new g).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import Backend
from ..options import SinkhornOptions
from ..problem import Problem
from .objective import side_error


@dataclass
class SolveState:
    """What the loop hands back to the engine."""

    f: torch.Tensor
    g: torch.Tensor
    eps: float
    n_iters: int
    converged: bool
    marginal_error: torch.Tensor | None
    errors: list[tuple[int, float]] = field(default_factory=list)
    #: With ``extrapolate``: the potentials before the final plain update.
    f_prev: torch.Tensor | None = None
    g_prev: torch.Tensor | None = None


#: Where the next symmetric step stands (Backend.symmetric_step's ``phase``).
_NEXT_PHASE = {"zero": "second", "second": "iterate", "iterate": "iterate"}


def _weights(phase: str, plain: bool) -> tuple[float, float]:
    """(alpha, w): the new potential is alpha · old + w · damping · T. The first iteration
    from zero potentials and the extrapolation are plain updates, not averages."""
    return (0.0, 1.0) if plain or phase == "zero" else (0.5, 0.5)


def _step(problem, backend, f, g, eps, schedule, phase, want_raw, plain=False):
    """One iteration; returns (f, g, error of the input plan or None)."""
    X, Y = problem.X, problem.Y
    lx, ly = X.damping(eps), Y.damping(eps)
    prec = problem.precision
    if X is Y:
        alpha, w = _weights(phase, plain)
        f_new, tf = backend.softmin(X, X, f, eps, f, alpha, w * lx, want_raw, prec)
        # Both marginals of a self plan are equal.
        err = 2.0 * side_error(X, f, tf, eps) if want_raw else None
        return f_new, f_new, err
    if schedule == "symmetric" or plain:
        alpha, w = _weights(phase, plain)
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
    if X is Y:
        return f, f
    if Y.has_null:
        t, _ = backend.softmin(Y, X, f, eps, g, 0.0, Y.damping(eps), False, prec)
        g = torch.where(Y.w == 0, t, g)
    return f, g


def solve(
    problem: Problem,
    backend: Backend,
    eps_list: list[float],
    opts: SinkhornOptions,
    *,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    extrapolate: bool = False,
) -> SolveState:
    """Runs the annealing ladder, then up to ``opts.n_iters`` iterations at ``eps_list[-1]``.

    Args:
        problem: canonical problem (``problem.X is problem.Y`` for a self problem).
        backend: soft-min implementation.
        eps_list: eps of each annealing iteration; the last value is the target eps.
        opts: reads ``n_iters`` (iterations at the target eps, the maximum when ``tol`` is
            given), ``tol`` (stop once the marginal error of every problem in the batch is
            <= tol; None runs exactly ``n_iters``), ``check_every`` and ``schedule``.
        init: optional warm-start potentials ((B, n), (B, m)).
        extrapolate: end with one plain update and return the previous potentials too.
    """
    X, Y = problem.X, problem.Y
    schedule, tol = opts.schedule, opts.tol
    if init is None:
        f = torch.zeros_like(X.sq)
        g = f if X is Y else torch.zeros_like(Y.sq)
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
    converged, err = False, None
    for k in range(opts.n_iters):
        check = tol is not None and k > 0 and k % opts.check_every == 0
        f_new, g_new, err = _step(problem, backend, f, g, eps, schedule, phase, check)
        phase = _NEXT_PHASE[phase]
        if check:
            err = backend.reduce_error(err)
            worst = float(err.max())
            errors.append((done, worst))
            if worst <= tol:
                converged = True
                break
        err = None
        f, g = f_new, g_new
        done += 1
    if extrapolate:
        # The plain update sets every potential, zero-weight points included.
        f_new, g_new, _ = _step(problem, backend, f, g, eps, schedule, "iterate", False, True)
        return SolveState(f_new, g_new, eps, done, converged, None, errors, f, g)
    f, g = _settle_null_points(problem, backend, f, g, eps)
    return SolveState(f, g, eps, done, converged, err if converged else None, errors)
