"""Batched preconditioned conjugate gradient for the Schur-complement systems of the HVP.

The systems are (B, m) symmetric positive (semi-)definite and only available as a matvec
(two streaming transports). Three properties matter here:

- the stop test uses the *true* residual ‖rhs − S w‖: the recursive residual of CG drifts
  from it in finite precision and can claim convergence that never happened, so whenever the
  recursive residual passes, the true one is computed (one extra matvec) and CG restarts from
  it if it does not pass;
- the host is consulted only every ``check_every`` iterations, so on a GPU the iterations
  queue without synchronising; on CUDA a block of ``check_every`` iterations is captured once
  in a CUDA graph and replayed, so the ~20 small vector operations of an iteration cost no
  Python launches;
- with ``project=True`` the system is solved on the complement of the constant vector (the
  null space of the undamped Schur complement): right-hand side, residuals and preconditioned
  residuals are kept mean-free, which is CG on that subspace with the preconditioner Π M Π.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._cuda_graph import capture
from ..tuning import TUNING


@dataclass
class CGInfo:
    """Diagnostics of one batched CG solve.

    Attributes:
        iters: CG iterations performed (matvecs for the true-residual checks not counted).
        residual: (B,) final *true* relative residual ‖rhs − S w‖₂ / ‖rhs‖₂ (0 for rhs = 0).
        converged: True when every residual is <= the tolerance.
        restarts: times the recursive residual passed the test but the true one did not.
    """

    iters: int
    residual: torch.Tensor
    converged: bool
    restarts: int = 0


def _mean_free(v: torch.Tensor) -> torch.Tensor:
    return v - v.mean(-1, keepdim=True)


def _identity(v: torch.Tensor) -> torch.Tensor:
    return v


def _dot(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (u * v).sum(-1)


# CUDA tensors (``TUNING.cg_graphs``): replay blocks of ``check_every`` iterations from a CUDA
# graph captured right after the first block is queued (that eager block compiles the
# kernels). Off: every iteration is launched from Python.


class _State(NamedTuple):
    w: torch.Tensor
    r: torch.Tensor
    z: torch.Tensor
    p: torch.Tensor
    rz: torch.Tensor
    active: torch.Tensor


def _restart(r: torch.Tensor, precond, proj) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = proj(precond * r)
    return z, z.clone(), _dot(r, z)


def _step(matvec, precond, proj, s: _State) -> _State:
    """One preconditioned CG iteration; entries with ``active == 0`` keep their iterate."""
    Sp = matvec(s.p)
    pSp = _dot(s.p, Sp)
    alpha = torch.where(pSp > 0, s.rz / torch.where(pSp > 0, pSp, 1.0), 0.0) * s.active
    w = s.w + alpha[:, None] * s.p
    r = proj(s.r - alpha[:, None] * Sp)
    z = proj(precond * r)
    rz = _dot(r, z)
    beta = torch.where(s.rz > 0, rz / torch.where(s.rz > 0, s.rz, 1.0), 0.0)
    return _State(w, r, z, z + beta[:, None] * s.p, rz, s.active)


class _GraphedBlock:
    """``k`` CG iterations captured once in a CUDA graph; each call copies the state into the
    graph's input buffers and replays (one launch for ~20 kernels × k, no Python per kernel)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inp: _State, out: _State):
        self.graph, self.inp, self.out = graph, inp, out

    @classmethod
    def try_capture(cls, step, like: _State, k: int) -> _GraphedBlock | None:
        """The captured block, or None when the matvec cannot be captured (a host sync or
        another stream inside it, or a capture already under way): CG then stays eager."""
        inp = _State(*(t.clone() for t in like))

        def block():
            out = inp
            for _ in range(k):
                out = step(out)
            return out

        got = capture(block, like.w.device)
        return None if got is None else cls(got[0], inp, got[1])

    def __call__(self, s: _State) -> _State:
        for dst, src in zip(self.inp, s, strict=True):
            dst.copy_(src)
        self.graph.replay()
        # The outputs are the graph's own buffers: the next call copies them in before it
        # replays, and the solver clones what it returns.
        return self.out


def cg_solve(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    precond: torch.Tensor,
    *,
    tol: float,
    max_iter: int,
    check_every: int = 10,
    project: bool = False,
    x0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CGInfo]:
    """Solves ``matvec(w) = rhs`` for a batch of SPD systems by preconditioned CG.

    Args:
        matvec: maps (B, m) to (B, m); symmetric positive (semi-)definite per batch entry.
            On CUDA, blocks of iterations are replayed from a CUDA graph when the matvec can be
            captured (no host synchronisation), as the library's transports can; otherwise
            CG runs eagerly.
        rhs: (B, m) right-hand sides.
        precond: (B, m) diagonal of the inverse preconditioner (Jacobi), positive.
        tol: stop when every true relative residual is <= tol.
        max_iter: iteration cap; the final true residual is reported either way.
        check_every: iterations between two host-side convergence tests.
        project: solve on the complement of the constant vector (singular systems whose null
            space is spanned by ones; the right-hand side is projected first).
        x0: (B, m) warm start, or None for zero.

    Returns:
        ``(w (B, m), CGInfo)``.
    """
    proj = _mean_free if project else _identity
    rhs = proj(rhs)
    bnorm = rhs.norm(dim=-1)
    bsafe = torch.where(bnorm > 0, bnorm, torch.ones_like(bnorm))
    if x0 is None:
        w = torch.zeros_like(rhs)
        r = rhs.clone()
    else:
        w = proj(x0.to(rhs.dtype)).clone()
        r = proj(rhs - matvec(w))
    s = _State(w, r, *_restart(r, precond, proj), torch.ones_like(bnorm))
    step = lambda st: _step(matvec, precond, proj, st)  # noqa: E731
    graphed = TUNING.cg_graphs and rhs.is_cuda and check_every > 1
    block = None
    it = restarts = 0
    true_rel = None
    while True:
        if it % check_every == 0 or it >= max_iter:
            rel = s.r.norm(dim=-1) / bsafe
            s = s._replace(active=(rel > tol).to(rhs.dtype))
            if not bool(s.active.any()) or it >= max_iter:
                # The recursive residual says "done": check the true one before believing it.
                r_true = proj(rhs - matvec(s.w))
                true_rel = r_true.norm(dim=-1) / bsafe
                if bool((true_rel <= tol).all()) or it >= max_iter:
                    break
                restarts += 1
                true_rel = None
                active = (r_true.norm(dim=-1) / bsafe > tol).to(rhs.dtype)
                s = _State(s.w, r_true, *_restart(r_true, precond, proj), active)
        k = min(check_every - it % check_every, max_iter - it)
        if block is not None and k == check_every:
            s = block(s)
        else:
            for _ in range(k):
                s = step(s)
            if graphed and block is None and max_iter - it - k >= check_every:
                # Capture now, while the GPU still runs the eager block just queued (which
                # compiled every kernel): the capture's host time overlaps it, and the next
                # check's synchronisation comes after. Only one attempt per solve.
                block = _GraphedBlock.try_capture(step, s, check_every)
                graphed = block is not None
        it += k
    converged = bool((true_rel <= tol).all())
    return s.w.clone(), CGInfo(iters=it, residual=true_rel, converged=converged, restarts=restarts)
