"""The multiscale solve: coarse annealed solve on cell centroids, lift, block-sparse fine loop.

1. *Clustering* (clustering.py): each cloud is sorted along a Morton curve; the non-empty
   cells of the finest grid level with at most :data:`COARSE_CLUSTERS` cells are the
   clusters, with their weighted centroids and total weights.
2. *Coarse solve*: the library's loop (``solvers.loop.solve``) on the centroids with the
   dense backend of the device, annealed from the diameter² down to the coarse eps
   eps_c = max(eps, (COARSE_EPS_CELLS · cell edge)²), below which centroids no longer
   resolve the plan.
3. *Lift*: each point's potential is the c-transform of the other side's coarse potential at
   eps_c, f_i = −eps_c log Σ_J B_J exp((G_J − ‖x_i − ȳ_J‖²)/eps_c) (one dense soft-min of
   the n points against the K centroids), damped for a KL-relaxed marginal.
4. *Fine loop*: the same loop on the points with :class:`~.backend.MultiscaleBackend`
   (block-sparse soft-mins), warm-started from the lifted potentials, annealing on from
   eps_c to eps along the solve's ladder.

Derivation and costs: docs/multiscale.md.
"""

from __future__ import annotations

import math

import torch

from ..options import SinkhornOptions
from ..problem import Problem, Side
from ..solvers import SolveState, geometric_ladder, solve
from .backend import MultiscaleBackend
from .clustering import Cells, cells

#: Most clusters per cloud in the coarse solve (its soft-mins are dense, K² scores: 2.7·10⁸ at
#: 16384, about 0.1 ms on an H100). Finer cells lift potentials nearer the fine solution:
#: 1M-point surfaces, eps = (0.01·D)², 24 fine iterations instead of 33 with 4096 clusters
#: (0.86 s instead of 1.09 s), mixture onto shell 23 instead of 28.
COARSE_CLUSTERS = 16384
#: ... and at most one cluster per COARSE_POINTS points on average.
COARSE_POINTS = 8
#: The coarse stage stops at eps_c = (COARSE_EPS_CELLS · cell edge)² (or at eps if larger).
#: With 16384 clusters 1.4 cell edges stops it at about 2 eps on the 1M-point surfaces, where
#: 1.0 ran 68 coarse iterations instead of 48 and 26 fine ones instead of 24.
COARSE_EPS_CELLS = 1.4
#: Annealing ratio (on sqrt(eps)) of the coarse stage when the solve has no ladder.
COARSE_SCALING = 0.5
#: Most iterations between two convergence tests of the fine loop of a large problem
#: (n·m ≥ FINE_CHECK_MIN_NM). There a fine iteration costs far more than a test (about 27 ms
#: against 3 ms at 1M points on an H100), so testing often stops the loop closer to the
#: tolerance and rebuilds a stale pattern sooner: 28 instead of 42 fine iterations with tests
#: every 2 instead of 5 (1M-point mixture onto shell, eps = (0.01·D)², tol 1e-3). At 100k
#: points an iteration costs a few ms, about as much as a test, so smaller problems keep the
#: default.
FINE_CHECK_EVERY = 2
FINE_CHECK_MIN_NM = 1e11


def coarse_side(side: Side, cl: Cells, mass_of: torch.Tensor | None = None) -> Side:
    """The clusters of one side as a :class:`Side` (centroids, cluster weights), with the
    side's relaxation and nominal mass; missing clusters of a smaller problem of the batch
    have zero weight (``has_null``)."""
    w = cl.w.to(side.sq.dtype)
    x = cl.x.to(side.sq.dtype)
    logw = torch.where(w > 0, w.clamp_min(1e-300).log(), torch.full_like(w, -math.inf))
    return Side(
        x.contiguous(), (x * x).sum(-1), w, logw, side.rho, has_null=True,
        unit_mass=side.unit_mass, mass_of=mass_of,
    )  # fmt: skip


def _budget(n: int) -> int:
    return max(1, min(COARSE_CLUSTERS, n // COARSE_POINTS))


def _ladders(eps_list: list[float], eps_c: float, diameter: float | None):
    """(coarse ladder ending at eps_c, fine ladder from below eps_c to eps)."""
    eps = eps_list[-1]
    above = [e for e in eps_list[:-1] if e > eps_c]
    if not above and diameter is not None and diameter**2 > eps_c:
        # the solve asked for no annealing: the coarse stage still anneals (it is cheap)
        above = geometric_ladder(diameter**2, eps_c, COARSE_SCALING**2)[:-1]
    fine = [e for e in eps_list[:-1] if eps < e < eps_c] + [eps]
    return [*above, eps_c], fine


def solve_multiscale(
    problem: Problem,
    backend: MultiscaleBackend,
    eps_list: list[float],
    opts: SinkhornOptions,
    diameter: float | None = None,
) -> SolveState:
    """Coarse solve, lift and block-sparse fine loop; returns the fine loop's state.

    Args:
        problem: the prepared problem (caller's point order).
        backend: the multiscale backend of this problem.
        eps_list: the solve's eps ladder (its last value is the target eps).
        opts: resolved options (tol, n_iters, schedule, acceleration apply to both loops).
        diameter: the cost range's length scale (bounding-box diagonal), for the coarse
            ladder when ``eps_list`` has no annealing.

    Returns:
        The state of the fine loop; ``n_iters`` counts the fine iterations only.
    """
    X, Y = problem.X, problem.Y
    own = X is Y
    lx = backend.layout(X)
    ly = lx if own else backend.layout(Y)
    cx = cells(lx, X.x, _budget(X.n))
    cy = cx if own else cells(ly, Y.x, _budget(Y.n))
    edge = max(cx.side, cy.side)
    eps = eps_list[-1]
    eps_c = max(eps, (COARSE_EPS_CELLS * edge) ** 2)
    coarse_list, fine_list = _ladders(eps_list, eps_c, diameter)
    CX = coarse_side(X, cx)
    CY = CX if own else coarse_side(Y, cy, CX.w if Y.mass_of is not None else None)
    coarse = Problem(CX, CY, True, "ieee")
    ctol = opts.tol if opts.tol is not None else 1e-3
    copts = opts.replace(tol=ctol, progress=None)  # report the fine solve only
    base = backend.base
    cst = solve(coarse, base, coarse_list, copts)
    # the lift: c-transforms of the coarse potentials of the other side at eps_c
    prec = problem.precision
    zf = torch.zeros_like(X.sq)
    f0, _ = base.softmin(X, CY, cst.g, eps_c, zf, 0.0, X.damping(eps_c), False, prec)
    if own:
        g0 = f0
    else:
        zg = torch.zeros_like(Y.sq)
        g0, _ = base.softmin(Y, CX, cst.f, eps_c, zg, 0.0, Y.damping(eps_c), False, prec)
    # the coarse stage's record, in the state of this solve
    backend.state.coarse_iters = cst.n_iters
    backend.state.eps_coarse = eps_c
    fopts = opts
    if opts.tol is not None and X.n * Y.n >= FINE_CHECK_MIN_NM:
        fopts = opts.replace(check_every=min(opts.check_every, FINE_CHECK_EVERY))
    return solve(problem, backend, fine_list, fopts, init=(f0, g0))
