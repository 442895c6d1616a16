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
A sharded backend reduces the error over its ranks (``Backend.reduce_error``) before the test;
a backend that visits part of the plan only adds the bound of the rest (``Backend.bound_error``).

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
from . import blocks, graphs
from .acceleration import AdaptiveOmega, Anderson
from .blocks import GraphedBlock
from .objective import side_error
from .progress import ErrorHistory


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
    #: Iterations of the annealing ladder, included in ``n_iters``.
    n_annealing: int = 0


#: Blocks of ``check_every`` iterations run eagerly before the rest are replayed from a graph
#: (measured on an H100: a capture costs about as much as 10 eager iterations at 10k², d = 64).
GRAPH_AFTER_BLOCKS = 4

#: A self problem's averaged iteration contracts by about 2 per iteration (its linearisation
#: has eigenvalues in [0, ½]; measured 0.35–0.45): its test comes every 3 iterations at most,
#: so that it stops within a few iterations of reaching the tolerance.
SELF_CHECK_EVERY = 3

#: Where the next symmetric step stands (Backend.symmetric_step's ``phase``).
_NEXT_PHASE = {"zero": "second", "second": "iterate", "iterate": "iterate"}


def _weights(phase: str, plain: bool, theta: float = 0.5) -> tuple[float, float]:
    """(alpha, w): the new potential is alpha · old + w · damping · T. The first iteration
    from zero potentials and the extrapolation are plain updates, not averages; ``theta`` is
    the weight of the new soft-min (½ for the symmetric schedule, ω/2 over-relaxed)."""
    return (0.0, 1.0) if plain or phase == "zero" else (1.0 - theta, theta)


def _relax(backend, rows, cols, col_pot, eps, old, lam, omega, want_raw, prec, phase):
    """The half-step ``(1 − ω) old + ω λ T`` (ω = 1: the plain soft-min). A scalar ω is fused
    into the kernel's epilogue; a per-problem ω (a (B, 1) tensor) mixes afterwards."""
    if not isinstance(omega, torch.Tensor):
        return backend.half_step(rows, cols, col_pot, eps, old, 1.0 - omega, omega * lam,
                                 want_raw, prec, phase)  # fmt: skip
    new, raw = backend.half_step(rows, cols, col_pot, eps, old, 0.0, lam, want_raw, prec, phase)
    return torch.lerp(old, new, omega.to(new.dtype)), raw


def _step(problem, backend, f, g, eps, schedule, phase, want_raw, plain=False, omega=1.0,
          omega_g=None):  # fmt: skip
    """One iteration; returns (f, g, error of the input plan or None).

    ``omega`` over-relaxes (scalar or (B, 1) per problem); ``omega_g`` overrides it for the
    alternating schedule's g half-step (1 before a convergence test, so that the column
    marginal of the tested plan is exact).
    """
    X, Y = problem.X, problem.Y
    lx, ly = X.damping(eps), Y.damping(eps)
    prec = problem.precision
    if X is Y:
        alpha, w = _weights(phase, plain)
        f_new, tf = backend.self_step(X, f, eps, alpha, w * lx, want_raw, prec, phase=phase)
        # Both marginals of a self plan are equal.
        err = 2.0 * side_error(X, f, tf, eps) if want_raw else None
        return f_new, f_new, err
    if schedule == "symmetric" or plain:
        if isinstance(omega, torch.Tensor) and not (plain or phase == "zero"):
            f_lam, g_lam, tf, tg = backend.symmetric_step(
                X, Y, f, g, eps, 0.0, lx, ly, want_raw, prec, phase=phase
            )
            theta = (0.5 * omega).to(f_lam.dtype)
            f_new, g_new = torch.lerp(f, f_lam, theta), torch.lerp(g, g_lam, theta)
        else:
            theta = 0.5 * omega if not isinstance(omega, torch.Tensor) else 0.5
            alpha, w = _weights(phase, plain, theta)
            f_new, g_new, tf, tg = backend.symmetric_step(
                X, Y, f, g, eps, alpha, w * lx, w * ly, want_raw, prec, phase=phase
            )
        err = side_error(X, f, tf, eps) + side_error(Y, g, tg, eps) if want_raw else None
        return f_new, g_new, err
    wf = 1.0 if phase == "zero" else omega
    wg = wf if omega_g is None else omega_g
    # From zero potentials the plan's sums are far from the weights: the plain sweeps.
    f_new, tf = _relax(backend, X, Y, g, eps, f, lx, wf, want_raw, prec, phase)
    g_new, _ = _relax(backend, Y, X, f_new, eps, g, ly, wg, False, prec, phase)
    # The input g was the plain soft-min of the input f, so the column marginal was exact.
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
        opts: resolved options (``SinkhornOptions.resolve``); the loop reads ``n_iters``
            (iterations at the target eps, the maximum when ``tol`` is given), ``tol`` (stop
            once the marginal error of every problem in the batch is <= tol; None runs
            exactly ``n_iters``), ``check_every``, ``schedule`` ("symmetric" or
            "alternating"), ``acceleration`` ("none", "overrelax" or "anderson"), ``omega``
            and ``anderson_memory``.
        init: optional warm-start potentials ((B, n), (B, m)).
        extrapolate: end with one plain update and return the previous potentials too.
    """
    X, Y = problem.X, problem.Y
    schedule = opts.schedule
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
    annealing = done
    eps = eps_list[-1]
    run = _run_anderson if opts.acceleration == "anderson" else _run_plain
    if X is Y:
        run = _run_plain
        if opts.tol is not None:
            opts = opts.replace(check_every=min(opts.check_every, SELF_CHECK_EVERY))
        # (no over-relaxation: θ = 2/3, the best fixed weight for its linearisation, needs
        # more iterations than θ = ½ to reach 1e-3 from zero potentials, measured)
        opts = opts.replace(acceleration="none")
    f, g, done, converged, err, errors = run(problem, backend, f, g, eps, opts, phase, done)
    if extrapolate:
        # The plain update sets every potential, zero-weight points included.
        f_new, g_new, _ = _step(problem, backend, f, g, eps, schedule, "iterate", False, True)
        return SolveState(f_new, g_new, eps, done, converged, None, errors, f, g, annealing)
    f, g = _settle_null_points(problem, backend, f, g, eps)
    err = err if converged else None
    return SolveState(f, g, eps, done, converged, err, errors, n_annealing=annealing)


def _is_check(opts: SinkhornOptions, k: int) -> bool:
    return opts.tol is not None and k > 0 and k % opts.check_every == 0


def _run_plain(problem, backend, f, g, eps, opts, phase, done):
    """The schedule's iteration, over-relaxed with ``opts.acceleration == "overrelax"``. On
    CUDA the blocks of iterations that end at a test are replayed from a CUDA graph
    (``blocks.py``)."""
    schedule, tol, every = opts.schedule, opts.tol, opts.check_every
    relax = None
    if opts.acceleration == "overrelax":
        relax = AdaptiveOmega(problem.B, schedule, opts.omega)
    errors = ErrorHistory(opts.progress, done, opts.n_iters, opts.tol)
    state = {"converged": False, "last": done, "err": None}

    def test(err) -> bool:
        # the error of the whole problem (a sharded backend reduces it over its ranks); a
        # truncating backend bounds that of the exact plan, while the estimate of the
        # contraction (over-relaxation) reads the measured error of the iteration itself
        measured = backend.reduce_error(err)
        err = state["err"] = backend.bound_error(measured)
        both = torch.stack([err, measured]).tolist() if err is not measured else None
        per, per_measured = (both[0], both[1]) if both is not None else (err.tolist(),) * 2
        worst = max(per)
        errors.append((done, worst))
        if worst <= tol:
            state["converged"] = True
            return True
        if relax is not None:
            relax.update(per_measured, done - state["last"])
        state["last"] = done
        return False

    def block_step(f, g, phase, want_raw, before_test, omega):
        omega_g = 1.0 if relax is not None and schedule == "alternating" and before_test else None
        return _step(problem, backend, f, g, eps, schedule, phase, want_raw,
                     omega=1.0 if omega is None else omega, omega_g=omega_g)  # fmt: skip

    graphed = GraphedBlock.possible(problem, backend, opts)
    keys: dict[tuple, tuple | None] = {}
    k = 0
    while k < opts.n_iters:
        check = _is_check(opts, k)
        # A block covers iterations k .. k + length − 1, the last one a test's: the first
        # block of the solve also takes its iteration 0 (``every`` + 1 steps), the others
        # ``every``.
        length = every + 1 if k == 0 else every
        if graphed and (k == 0 or k % every == 1) and k + length <= opts.n_iters:
            got = _graphed_block(problem, backend, eps, opts, relax, phase, keys, block_step,
                                 f, g, k, length)  # fmt: skip
            if got is not None:
                f_t, g_t, f_new, g_new, err = got
                done += length - 1
                phase = "iterate"
                if test(err):
                    f, g = f_t, g_t
                    break
                f, g = f_new, g_new
                done += 1
                k += length
                continue
        omega, omega_g = 1.0, None
        if relax is not None:
            # where blocks may replay from a graph (a tensor ω, mixed after the kernel), the
            # eager iterations mix the same way: the first solve of a shape and its replays
            # are then bitwise equal (a seeded draw from the plan repeats)
            common = None if graphed else relax.uniform()
            omega = common if common is not None else relax.tensor(f)
            if schedule == "alternating" and _is_check(opts, k + 1):
                omega_g = 1.0
        f_new, g_new, err = _step(problem, backend, f, g, eps, schedule, phase, check,
                                  omega=omega, omega_g=omega_g)  # fmt: skip
        phase = _NEXT_PHASE[phase]
        if check and test(err):
            break
        err = None
        f, g = f_new, g_new
        done += 1
        k += 1
    return f, g, done, state["converged"], state["err"], errors.close()


def _graphed_block(problem, backend, eps, opts, relax, phase, keys, block_step, f, g, k,
                   length):  # fmt: skip
    """Runs the ``length`` iterations from ``k`` from a CUDA graph, or returns None (eager).

    A block seen in an earlier solve (same key) is replayed, or captured now; a new one is
    captured only after ``GRAPH_AFTER_BLOCKS`` eager blocks of this solve: they compile every
    kernel variant the block launches, and a solve that ends within them would not repay a
    capture (a few ms).
    """
    phases = [phase]
    while len(phases) < length:
        phases.append(_NEXT_PHASE[phases[-1]])
    phases = tuple(phases)
    cache = blocks.cache(problem.device)
    if phases not in keys:
        key = graphs.block_key(problem, backend, eps, opts, relax is not None, phases)
        recurring = key is not None and cache.known(key)
        if key is not None and not recurring:
            cache.see(key)
        keys[phases] = (key, recurring)
    key, recurring = keys[phases]
    if key is None:
        return None
    block = cache.get(key)
    if block is None:
        if cache.failed(key):
            return None
        if not recurring and k <= GRAPH_AFTER_BLOCKS * opts.check_every:
            return None
        omega_t = None if relax is None else relax.tensor(f)
        block = GraphedBlock(block_step, f, g, phases, omega_t)
        cache.put(key, block)
        if block.graph is None:
            return None
    return block.run(f, g, None if relax is None else relax.tensor(f))


def _passed(errors: ErrorHistory, done: int, err: torch.Tensor, tol: float) -> bool:
    """Records the error of a convergence test; True when every problem passed."""
    worst = float(err.max())
    errors.append((done, worst))
    return worst <= tol


def _run_anderson(problem, backend, f, g, eps, opts, phase, done):
    """Anderson mixing of the schedule's fixed-point map. Alternating: the iterate is g and
    the map g ↦ λ_y T(λ_x T(g)) (f follows from g, so the row marginal is exact); symmetric:
    the iterate is (f, g) and the map is one averaged step. Every iteration measures the
    error of its input plan (the soft-mins give it for free) for the safeguard."""
    X, Y = problem.X, problem.Y
    prec, tol = problem.precision, opts.tol
    lx, ly = X.damping(eps), Y.damping(eps)
    alternating = opts.schedule == "alternating"
    balanced = X.rho is None and Y.rho is None
    # A sharded backend sums the mixing's inner products over its processes, the error of
    # each iteration with them (one reduction per iteration); a whole problem reduces nothing.
    reduce = backend.reduce_sum if backend.capabilities.sharded else None
    if alternating:
        # (The first iteration, with no history, is the plain alternating step.)
        mixer = Anderson(g, opts.anderson_memory, Y.w if balanced else None, reduce)
    else:
        mixer = Anderson(torch.cat([f, g], -1), opts.anderson_memory, reduce=reduce)
    n = f.shape[-1]
    errors = ErrorHistory(opts.progress, done, opts.n_iters, opts.tol)
    converged, err = False, None
    for k in range(opts.n_iters):
        if alternating:
            # the old potentials shift the half-steps' plan sweeps (Backend.half_step)
            ph = phase if k == 0 else "iterate"
            f, _ = backend.half_step(X, Y, g, eps, f, 0.0, lx, False, prec, ph)
            g_img, tg = backend.half_step(Y, X, f, eps, g, 0.0, ly, True, prec, ph)
            err = side_error(Y, g, tg, eps)
        else:
            f_img, g_img, tf, tg = backend.symmetric_step(
                X, Y, f, g, eps, 0.5, 0.5 * lx, 0.5 * ly, True, prec, phase=phase
            )
            phase = _NEXT_PHASE[phase]
            err = side_error(X, f, tf, eps) + side_error(Y, g, tg, eps)
        check = _is_check(opts, k)
        if check and reduce is None:
            err = backend.bound_error(err)
            if _passed(errors, done, err, tol):
                converged = True
                break
        if alternating:
            mixed = mixer.step(g, g_img, err)
        else:
            mixed = mixer.step(torch.cat([f, g], -1), torch.cat([f_img, g_img], -1), err)
        if check and reduce is not None:
            # the error of the whole problem came with the mixing's sums
            err = backend.bound_error(mixer.err)
            if _passed(errors, done, err, tol):
                converged = True
                break
        if alternating:
            g = mixed
        else:
            f, g = mixed[..., :n], mixed[..., n:]
        done += 1
    if not converged and alternating:
        # The returned plan is (λ_x T(g), g): its row marginal is exact.
        f, _ = backend.softmin(X, Y, g, eps, f, 0.0, lx, False, prec)
    return f, g, done, converged, err, errors.close()
