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
  - ``u64_50k``: n = m = 50,000, d = 64, x, y ~ U[0,1]^d, eps in {0.1, 0.01}: the size at
    which the alternating half-step reads the plan's row sums (backends/triton/plan.py).
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
  ``marginal_error`` decides ``reached_tol`` (``judged_by`` says whose): for the solvers
  with a convergence test of the marginals, ours and OTT-JAX, their own test, as the solver
  returns it (the float32 plan that it applies and differentiates); for ours, a float64
  recomputation on the points it solved is reported beside it (``marginal_error_check``:
  with precision "tf32" its points are rounded to the grid on which its tensor-core
  products are exact and its norms are those of the rounded points, so the exact plan of
  its potentials is that problem's; near the float32 floor, eps/diam² ≈ 1e-5, this exact
  plan's error sits above the float32 one, for any float32 solver: OTT's TF32 cost describes
  no point set and cannot be checked this way). GeomLoss and flash-sinkhorn, which have no
  such test, are calibrated in exact fp32 (TF32 off, judged in float64) and timed with TF32
  at the calibrated setting.
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

Code: ``bench/ttt/`` (problems, judge, timing, one worker per provider in ``providers/``,
the worker subprocess and the driver); this file is the command line, and the driver
starts each worker through it.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:  # run as ``python -m`` or imported: make ``ttt`` importable
    sys.path.insert(0, str(BENCH))

from ttt.driver import main as _main  # noqa: E402


def main(argv=None) -> int:
    return _main(argv, description=__doc__.split("\n")[0])


if __name__ == "__main__":
    sys.exit(main())
