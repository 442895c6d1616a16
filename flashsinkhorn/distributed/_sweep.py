"""Sweeps of a sharded problem: the soft-mins and envelope gradients of the local rows
against every column of the other side, in gather or ring mode.

- ``mode="gather"``: the points were all-gathered once; a sweep all-gathers the column
  potentials (one collective of O(n + m) values) and runs the backend on rows = local shard,
  columns = the whole other cloud. Both half-steps of a symmetric iteration go to the backend
  together (``Backend.softmin_pair``: one launch on Triton).
- ``mode="ring"``: the shards of the other side (kernel operands, squared norms, weights,
  potential) pass around the ring while each rank merges the per-shard soft-mins (and sums
  the per-shard transport gradients); nothing of size n or m is replicated. The shards travel
  in the format the kernels read (float16 grid copies or hi/lo parts, split once by their
  owner), so nothing is re-split on arrival in the iterations.

Merging soft-mins over shards. Below the large-eps threshold the per-shard soft-mins T_k merge
as T = −eps · LSE_k(−T_k / eps). At large eps (``Side.large_eps``, docs/precision.md) that
log-sum-exp of numbers within ulps of each other would lose u·eps of the cost, as the plain
soft-min does; there each shard's soft-min is taken against its weights normalised to mass 1
(the backend's expansion about the mean score), A_k = ‖r‖² − T̂_k, and the shards merge by the
same expansion one level up:

    T = ‖r‖² − c − eps ln M − eps log1p(Σ_k μ_k expm1((A_k − c) / eps)),

with μ_k the shard's share of the mass, c the A of the first shard with mass and M the
side's nominal mass: every term keeps its digits, as in the single-process soft-min.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..problem import Side, split_half


def payload(side: Side, kernels: bool, grad: bool) -> list[torch.Tensor]:
    """What represents a Side on the wire: kernel points (B=1) and (2, n) norms + weights.

    The Triton kernels read float16 copies (precision "tf32": the grid points; "tf32x3": the
    hi/lo parts), which travel as such: the owner made them once. A gradient sweep on split
    parts sends the float32 points instead (the transport reads them besides the parts); a
    backend without compiled kernels (``Capabilities.kernels``) reads the points only.
    """
    pts = side.x
    if kernels and side.xk is not None and not (side.split and grad):
        pts = side.xk
    return [pts.contiguous(), torch.cat([side.sq, side.w], 0)]


def unpack(pts: torch.Tensor, sqw: torch.Tensor, like: Side, kernels: bool) -> Side:
    """Rebuilds a column Side from its payload (:func:`payload`), with ``like``'s format.

    Grid copies give back the owner's points exactly (x = x_half · kscale). Split parts are
    used as they came; their points (hi + lo) · kscale, 22 bits of the owner's, only serve as
    the large-eps expansion's shift, which may be any value. Points of a split side that
    travelled as points (gradient sweeps) are split here, once per shard and sweep.
    """
    w = sqw[1:2]
    common = dict(sq=sqw[0:1], w=w, logw=w.log(), rho=like.rho, kscale=like.kscale)
    if like.xk is None or not kernels:
        return Side(x=pts, **common)  # a backend without kernels reads the points only
    if pts.dtype != torch.float16:
        return Side(x=pts, xk=split_half(pts, like.kscale), **common)
    if like.split:
        d = pts.shape[-1] // 2
        x = (pts[..., :d].float() + pts[..., d:].float()) * like.kscale
        return Side(x=x, xk=pts, **common)
    return Side(x=pts.float() * like.kscale, xk=pts, **common)


def unit_columns(cols: Side, mass: float) -> Side:
    """The columns with weights of total mass 1 (divided by ``mass``, their sum) and nominal
    mass 1: the backend's large-eps soft-min of them carries no eps ln M term."""
    w = cols.w / mass
    return replace(cols, w=w, logw=cols.logw - math.log(mass), unit_mass=True, mass_of=None)


def merge_softmin(prev: torch.Tensor | None, t: torch.Tensor, eps: float) -> torch.Tensor:
    """Soft-min over the union of column shards: T = −eps · LSE_k(−T_k / eps).

    A shard of zero-weight columns has T_k = +inf and drops out (logaddexp of −inf).
    """
    if prev is None:
        return t
    return -eps * torch.logaddexp(-prev / eps, -t / eps)


class LargeMerge:
    """The large-eps merge of per-shard soft-mins of one row side (module docstring).

    Besides the expansion it keeps the plain merge eps · LSE_k(A_k/eps + ln μ_k) for rows whose
    shards spread by more than eps (|A_k − c| > eps), where the expansion's terms are no longer
    small (as the backends fall back per row).
    """

    def __init__(self, rows: Side, eps: float, log_mass: float):
        self.rows, self.eps, self.log_mass = rows, eps, log_mass
        self.c = self.s = self.spread = self.lse = None

    def add(self, t_hat: torch.Tensor, mu: float) -> None:
        """Adds the soft-min ``t_hat`` of a shard with mass share ``mu`` > 0 whose weights
        were normalised to mass 1 (:func:`unit_columns`)."""
        a = self.rows.sq - t_hat
        if self.c is None:
            # the shift: exact for any value, accurate when every |A_k − c| << eps
            self.c = a
            self.s = torch.zeros_like(a)
            self.spread = torch.zeros_like(a)
            self.lse = a / self.eps + math.log(mu)
            return
        t = (a - self.c) / self.eps
        self.s = self.s + mu * torch.expm1(t)
        self.spread = torch.maximum(self.spread, t.abs())
        self.lse = torch.logaddexp(self.lse, a / self.eps + math.log(mu))

    def result(self) -> torch.Tensor:
        """The merged soft-min T of the rows."""
        sq, eps = self.rows.sq, self.eps
        expanded = sq - self.c - eps * (self.log_mass + torch.log1p(self.s))
        plain = sq - eps * (self.lse + self.log_mass)
        return torch.where(self.spread <= 1.0, expanded, plain)


def epilogue(old, t, alpha: float, beta: float) -> torch.Tensor:
    """alpha · old + beta · T, as the backends write it."""
    return beta * t if alpha == 0.0 else alpha * old + beta * t
