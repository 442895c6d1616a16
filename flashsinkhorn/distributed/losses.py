"""Differentiable sharded losses: :func:`ot_cost` and :func:`sinkhorn_divergence`.

Convention: the returned value is the global loss, identical on every rank. Call
``backward()`` on every rank (the ring mode's backward is a collective): each rank then
receives the gradient of that one global loss with respect to its own shards, which is the
slice of the single-process gradient. Nothing is summed or averaged over ranks in the
backward, so summing the per-rank losses, or averaging gradients over ranks, would count
the loss ``world`` times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _validation as V
from ..autograd.guard import guard_second_order
from ..options import public_options
from ._comm import require_group
from ._engine import Sharded
from .solver import _run


class _DistOTCost(torch.autograd.Function):
    """``apply(x_local, y_local, a_local, b_local, options)`` → global OT_eps (0-d)."""

    @staticmethod
    def forward(ctx, x, y, a, b, options):
        sh, out, value = _run(x, y, a, b, **options)
        ctx.sh, ctx.out = sh, out
        ctx.save_for_backward(x, y, a, b)
        return value[0].clone()

    @staticmethod
    def backward(ctx, grad_out):
        x, y, a, b = ctx.saved_tensors
        sh: Sharded = ctx.sh
        out = ctx.out
        need = ctx.needs_input_grad
        balanced = sh.X.rho is None and sh.Y.rho is None
        ops = {"X": set(), "Y": set()}
        if need[0]:
            ops["X"].add("grad")
        if need[1]:
            ops["Y"].add("grad")
        if not balanced and need[2] and a is not None:
            ops["X"].add("softmin")
        if not balanced and need[3] and b is not None:
            ops["Y"].add("softmin")
        ops = {k: v for k, v in ops.items() if v}
        gx = gy = ga = gb = None
        with torch.no_grad():
            go = grad_out.reshape(()).to(sh.pdtype)
            res = sh.sweep(out.f, out.g, out.eps, ops) if ops else {}
            if need[0]:
                gx = (res["X"]["grad"][0] * go).to(x.dtype)
            if need[1]:
                gy = (res["Y"]["grad"][0] * go).to(y.dtype)
            if need[2] and a is not None:
                ga = _weight_grad(sh, "X", out, res) * go
                ga = ga.reshape(a.shape).to(a.dtype)
            if need[3] and b is not None:
                gb = _weight_grad(sh, "Y", out, res) * go
                gb = gb.reshape(b.shape).to(b.dtype)
        gx, gy, ga, gb = guard_second_order((gx, gy, ga, gb), (x, y, a, b))
        return gx, gy, ga, gb, None


def _weight_grad(sh: Sharded, side: str, out, res) -> torch.Tensor:
    """(n_local,) gradient of the dual value w.r.t. this rank's weights of one side.

    Balanced: the potential (GeomLoss convention). KL-relaxed: φ'(pot) − eps · â/w + eps · m,
    with m the global mass of the other side (``autograd/ot_cost.py``).
    """
    R = sh.X if side == "X" else sh.Y
    pot = out.f if side == "X" else out.g
    if sh.X.rho is None and sh.Y.rho is None:
        return pot[0]
    eps = out.eps
    raw = res[side]["softmin"]
    ratio = torch.exp((pot - raw) / eps)
    dphi = pot if R.rho is None else R.rho * -torch.expm1(-pot / R.rho)
    other_mass = sh.mb if side == "X" else sh.ma
    return (dphi - eps * ratio + eps * other_mass)[0]


def _options(group, mode, **kw) -> dict:
    return dict(group=group, mode=mode, compute_error=False, **kw)


def ot_cost(
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
) -> torch.Tensor:
    """Global OT_eps of sharded clouds, differentiable w.r.t. this rank's shards.

    A collective, in the forward and (ring mode) in the backward: call it, and ``backward``,
    on every rank. Problem and options as in :func:`flashsinkhorn.distributed.sinkhorn`.
    Envelope gradients of the plan actually computed (as :func:`flashsinkhorn.ot_cost`):
    ∇_x = 2 (diag(â) x − P y) for the local rows with P applied over all columns (gather: the
    backend's ``transport_grad`` against the gathered cloud; ring: per-shard partial sums),
    ∇_y likewise, ∇_a = f and ∇_b = g for a balanced problem (KL-relaxed sides: the partial
    derivative of the dual objective).

    Args:
        x_local: (n_local, d) this rank's rows of x.
        y_local: (m_local, d) this rank's rows of y.
        a_local: (n_local,) weights of those rows, or None on every rank (uniform).
        b_local: (m_local,) weights, or None on every rank (uniform).
        eps, group, mode, n_iters, tol, check_every, schedule, scaling, diameter, rho_x,
        rho_y, backend, precision, check_finite: as in
            :func:`flashsinkhorn.distributed.sinkhorn`.

    Returns:
        A 0-d tensor, the global value, identical on every rank (float32, or float64 for
        float64 points). Its gradient w.r.t. each local input is the slice of the
        single-process gradient: do not sum it over ranks.

    Raises:
        RuntimeError: when no process group is initialised, or on a second derivative.
        ValueError, TypeError: for invalid arguments, on every rank.
    """
    options = _options(group, mode, **public_options(locals()))
    return _DistOTCost.apply(x_local, y_local, a_local, b_local, options)


class _GlobalSum(torch.autograd.Function):
    """Sum over ranks whose backward is the identity (value identical on every rank)."""

    @staticmethod
    def forward(ctx, t, group):
        out = t.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _global_mass(w: torch.Tensor | None, like: torch.Tensor, group) -> torch.Tensor:
    """Global total mass of sharded weights (1 for uniform), differentiable locally."""
    if w is None:
        return torch.ones((), dtype=like.dtype, device=like.device)
    return _GlobalSum.apply(w.sum().to(like.dtype), group)


def sinkhorn_divergence(
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
) -> torch.Tensor:
    """Global debiased Sinkhorn divergence S = OT(a, b) − ½ OT(a, a) − ½ OT(b, b), sharded.

    Three sharded :func:`ot_cost` solves with the semantics of
    :func:`flashsinkhorn.sinkhorn_divergence` (with ``scaling`` all three anneal from the
    diameter of the global bounding box of both clouds; KL-relaxed marginals, with
    ``rho_x == rho_y``, add the debiasing term eps/2 (m_a − m_b)² with global masses). A
    collective; same gradient convention as :func:`ot_cost`.

    Args:
        x_local, y_local, a_local, b_local: this rank's shards, as in :func:`ot_cost`.
        eps, group, mode, n_iters, tol, check_every, schedule, scaling, diameter, rho_x,
        rho_y, backend, precision, check_finite: as in
            :func:`flashsinkhorn.distributed.sinkhorn`.

    Returns:
        A 0-d tensor, identical on every rank, differentiable w.r.t. the local shards.
    """
    require_group(group)
    V.check_divergence_rho(
        V.check_positive("rho_x", rho_x, allow_none=True),
        V.check_positive("rho_y", rho_y, allow_none=True),
    )
    if scaling is not None and diameter is None:
        V.check_scaling(scaling, allow_auto=True)
        V.check_points("x_local", x_local)
        V.check_points("y_local", y_local)
        V.check_pair(x_local, y_local)
        # The bounding box of the caller's points, as the single-process divergence does.
        sh_diam = _diameter(x_local.detach(), y_local.detach(), group)
        diameter = sh_diam if sh_diam > 0 else None
    common = {**public_options(locals()), "group": group, "mode": mode}
    del common["rho_x"], common["rho_y"]
    xy = ot_cost(x_local, y_local, a_local, b_local, rho_x=rho_x, rho_y=rho_y, **common)
    # The self terms as in the single-process divergence (SinkhornOptions.for_self_transport).
    if schedule == "auto" and acceleration == "auto":
        common.update(schedule="symmetric", acceleration="none")
    xx = ot_cost(x_local, x_local, a_local, a_local, rho_x=rho_x, rho_y=rho_x, **common)
    yy = ot_cost(y_local, y_local, b_local, b_local, rho_x=rho_y, rho_y=rho_y, **common)
    div = xy - 0.5 * (xx + yy)
    if rho_x is None and rho_y is None:
        return div
    ma = _global_mass(a_local, x_local, group)
    mb = _global_mass(b_local, y_local, group)
    return div + 0.5 * eps * (ma.to(div.dtype) - mb.to(div.dtype)) ** 2


def _diameter(x: torch.Tensor, y: torch.Tensor, group) -> float:
    """Diagonal of the global bounding box of raw (uncentred) points."""
    lo = torch.minimum(x.amin(0), y.amin(0)).double()
    hi = torch.maximum(x.amax(0), y.amax(0)).double()
    box = torch.cat([-lo, hi])
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    d = lo.numel()
    return float((box[d:] + box[:d]).norm())
