"""Sharded Sinkhorn solve: :func:`sinkhorn` and its result."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..options import public_options
from ._engine import Sharded


@dataclass
class DistributedSinkhornResult:
    """One rank's view of a sharded solve.

    Conventions as in :class:`flashsinkhorn.SinkhornResult` (cost ‖x_i − y_j‖², plan
    P_ij = a_i b_j exp((f_i + g_j − C_ij) / eps)); the potentials are this rank's slices of
    the global ones, every other field is global and identical on every rank.

    Attributes:
        f: (n_local,) potential of this rank's x rows (global rows ``offset_x`` onwards).
        g: (m_local,) potential of this rank's y rows (global rows ``offset_y`` onwards).
        value: 0-d tensor, the global OT_eps (dual objective), the same on every rank.
        eps: final (target) eps.
        n_iters: iterations performed, annealing included.
        converged: True when the global marginal-error test passed; always False with
            ``tol=None``.
        marginal_error: 0-d tensor, global ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ of the returned plan, or
            None when the solve ran with ``compute_error=False`` and did not converge.
        errors: (iteration, marginal error) at each convergence test.
        n: global number of x points.
        m: global number of y points.
        offset_x: index of this rank's first x row in the global cloud.
        offset_y: index of this rank's first y row in the global cloud.
        rank: this process's rank in the group.
        world_size: number of ranks in the group.
        mode: "gather" or "ring".
        schedule: the schedule that ran, "symmetric" or "alternating".
        acceleration: the acceleration that ran, "none", "overrelax" or "anderson".
        backend: "torch" or "triton".
        precision: dot-product precision used ("ieee", "tf32", "tf32x3").
    """

    f: torch.Tensor
    g: torch.Tensor
    value: torch.Tensor
    eps: float
    n_iters: int
    converged: bool
    marginal_error: torch.Tensor | None
    errors: list[tuple[int, float]] = field(default_factory=list)
    n: int = 0
    m: int = 0
    offset_x: int = 0
    offset_y: int = 0
    rank: int = 0
    world_size: int = 1
    mode: str = "gather"
    schedule: str = "symmetric"
    acceleration: str = "none"
    backend: str = "torch"
    precision: str = "ieee"


def _run(x_local, y_local, a_local, b_local, *, group, compute_error, **options):
    """Builds the sharded problem and solves it; returns (engine, SolveOutput, value)."""
    sh = Sharded(x_local, y_local, a_local, b_local, group=group, compute_error=compute_error,
                 **options)  # fmt: skip
    with torch.no_grad():
        out = sh.solve(compute_error)
        value = sh.value(out.f, out.g, out.eps)
    return sh, out, value


def _result(sh: Sharded, out, value) -> DistributedSinkhornResult:
    err = out.marginal_error
    return DistributedSinkhornResult(
        f=out.f[0], g=out.g[0], value=value[0], eps=out.eps, n_iters=out.n_iters,
        converged=out.converged, marginal_error=None if err is None else err[0],
        errors=out.errors, n=sh.n, m=sh.m, offset_x=sh.off_x, offset_y=sh.off_y,
        rank=sh.comm.rank, world_size=sh.comm.world, mode=sh.mode,
        schedule=sh.opts.schedule, acceleration=sh.opts.acceleration, backend=sh.impl.name,
        precision=sh.precision,
    )  # fmt: skip


def sinkhorn(
    x_local: torch.Tensor,
    y_local: torch.Tensor,
    a_local: torch.Tensor | None = None,
    b_local: torch.Tensor | None = None,
    *,
    eps: float,
    group: dist.ProcessGroup | None = None,
    mode: str = "gather",
    n_iters: int = 1000,
    tol: float | None = 1e-3,
    check_every: int = 10,
    schedule: str = "auto",
    acceleration: str = "auto",
    omega: float | None = None,
    anderson_memory: int = 5,
    scaling: float | str | None = "auto",
    diameter: float | None = None,
    rho_x: float | None = None,
    rho_y: float | None = None,
    backend: str = "auto",
    precision: str = "auto",
    check_finite: bool = True,
    compute_error: bool = True,
) -> DistributedSinkhornResult:
    """Entropic OT between two point clouds whose rows are sharded over a process group.

    A collective: every rank of ``group`` calls it with its own contiguous shards (rank r holds
    the rows that come after those of ranks 0..r−1) and the same options. The result equals
    :func:`flashsinkhorn.sinkhorn` on the concatenated clouds (centring at the joint weighted
    mean, uniform weights 1/n_global, annealing diameter, TF32 grid scale, convergence test
    and mass check are all global), up to the order of floating-point sums.

    Args:
        x_local: (n_local, d) this rank's rows of x, n_local >= 1 (shards may be uneven).
            CUDA tensor on the current device for an NCCL group, CPU tensor for gloo.
        y_local: (m_local, d) this rank's rows of y, m_local >= 1, same dtype and device.
        a_local: (n_local,) weights of those rows, or None on every rank for uniform
            1/n_global.
        b_local: (m_local,) weights of the y rows, or None on every rank for uniform 1/m_global.
        eps: entropic regularisation, > 0, in units of the cost (squared distance).
        group: the torch.distributed process group; None is the default group.
        mode: "gather" (default): the clouds are all-gathered once, then each half-step
            updates the local slice against the whole other cloud and all-gathers the
            potentials (O(n + m) values per iteration, O((n + m) d) memory per rank).
            "ring": the other side's shards circulate around the ring, overlapped with the
            compute, and the per-shard soft-mins merge by log-sum-exp (O((n + m) d / world)
            memory per rank, each rank sends its shards of both clouds once per iteration).
        n_iters: iterations at the target eps (the maximum when ``tol`` is set). Default 1000.
        tol: stop when the global ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ <= tol; None runs exactly
            ``n_iters`` iterations. Default 1e-3.
        check_every: iterations between two convergence tests, the only host
            synchronisations of the loop (one all-reduce each). Default 10.
        schedule: as in :func:`flashsinkhorn.sinkhorn`. Default "auto".
        acceleration: as in :func:`flashsinkhorn.sinkhorn`, resolved as for one process on the
            whole problem (Anderson mixing by default on GPUs from 10⁹ scores per half-step);
            Anderson's inner products and the marginal error are reduced over the ranks in
            one all-reduce per iteration, the over-relaxation reads the global errors of the
            convergence tests. Default "auto".
        omega: as in :func:`flashsinkhorn.sinkhorn`. Default None (adaptive).
        anderson_memory: as in :func:`flashsinkhorn.sinkhorn`. Default 5.
        scaling: as in :func:`flashsinkhorn.sinkhorn`. Default "auto".
        diameter: largest distance between points for annealing; None estimates it from the
            global bounding box.
        rho_x: KL relaxation strength of the x marginal (unbalanced OT); None is a hard
            constraint.
        rho_y: the same for the y marginal.
        backend: "auto" (Triton for CUDA tensors, torch otherwise), "torch" or "triton".
        precision: "auto", "ieee", "tf32" or "tf32x3", as in :func:`flashsinkhorn.sinkhorn`.
        check_finite: check points and weights for NaN/inf. Default True.
        compute_error: when the solve ends without a passing test, compute the marginal
            error of the returned plan (one more sweep, collective). False leaves
            ``marginal_error`` None (benchmarks). Default True.

    Returns:
        A :class:`DistributedSinkhornResult` (local potential slices, global value and
        convergence facts).

    The numerics are those of the single-process solve, from global statistics: range
    checks, the float32 plan floor (a solve with a tolerance below it raises) and the
    large-eps soft-min (docs/precision.md). Like :func:`flashsinkhorn.sinkhorn` it does not
    warn when ``tol`` is not reached: the result says ``converged=False``.

    Raises:
        RuntimeError: when no process group is initialised.
        ValueError, TypeError: for invalid arguments, naming the argument, on every rank:
            each rank checks its shards first and one all-reduce of a failure flag precedes
            every other collective, so every rank raises the failing rank's error (naming
            that rank) instead of waiting; also for eps below the float32 plan floor with a
            tolerance, or with ``compute_error`` when the error must be computed
            (docs/errors.md).
    """
    sh, out, value = _run(
        x_local, y_local, a_local, b_local, group=group, compute_error=compute_error,
        mode=mode, **public_options(locals()),
    )  # fmt: skip
    return _result(sh, out, value)
