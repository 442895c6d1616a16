"""The steps of a sharded problem from plan sums: every score of a rank's block formed once.

A rank holds the rows x_r of its shard and sees every column of y (gather mode: the gathered
cloud; ring mode: one shard at a time). Its block of the plan π of (f, g) gives

- the row sums of its rows: complete once every column has been visited, so its half of the
  symmetric step, T(g)_r = f_r − σ − eps ln(r_r / a_r), needs nothing from other ranks;
- the column sums over its rows: one part of the plan's column sums, which are the sum of
  every rank's part. Gather mode adds them up in one all-reduce; ring mode passes each
  shard's sums along with the shard, one step behind it, and hands the total back to its
  owner (``Comm.ring``'s accumulator). T(f)_j = g_j − σ − eps ln(c_j / b_j) follows.

One sweep of the backend's fused plan kernel (``Backend.plan_sums``: one x·yᵀ product and one
exp per score) serves both half-steps, as the single-process symmetric step does; the sums
of all ranks share the shift σ of the plan's exponent (``Backend.plan_shift`` of the whole
clouds in gather mode, the ranks' mean estimate in ring mode). A half-step of the
alternating schedule (or of a divergence's self term) reads the row sums only.

A sum outside the trusted range (``Backend.sums_step``) is redone by the online-LSE soft-min:
in gather mode on the device, against the gathered columns (no host synchronisation); in
ring mode, where no rank holds every column, the ranks agree on a flag (one all-reduce read
by the host per step) and redo the step with a soft-min ring pass.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._sweep import epilogue, unpack
from ._timing import section


def symmetric_step(sh, f, g, eps, alpha, beta_x, beta_y, want_raw, phase):
    """Both half-steps from the plan sums of this rank's block, or None when the backend
    reads no soft-min off plan sums for these sides (then the caller's pair sweep runs).

    Args:
        sh: the sharded problem (``_engine.Sharded``).
        f, g: (1, n_local), (1, m_local) this rank's potentials.
        eps, alpha, beta_x, beta_y, want_raw, phase: as in ``Backend.symmetric_step``.

    Returns:
        ``(f_new, g_new, T(g) or None, T(f) or None)``, this rank's slices.
    """
    impl, prec = sh.impl, sh.precision
    if phase == "cold" or not impl.has_plan_sums(sh.X, sh.Y, eps, True):
        return None
    if sh.mode == "gather":
        # one all-gather: g for the sweep, f for the guarded recompute of the y rows
        f_all, g_all = sh.comm.gather_dim1([f, g], [sh.sizes_x, sh.sizes_y])
        cols_x, cols_y = sh.X_all, sh.Y_all
        # the whole clouds: the same shift on every rank, the single-process one
        with section("kernels", f.device):
            shift = impl.plan_shift(cols_x, cols_y, f_all, g_all, eps, phase)
            rows, cols = impl.plan_sums(sh.X, cols_y, f, g_all, eps, prec, shift, True)
        cols = sh.comm.all_reduce(cols.to(sh.comm.device)).to(f.device)
        mine = cols[:, sh.off_y : sh.off_y + sh.Y.n]
        with section("kernels", f.device):
            f_new, tf, _ = impl.sums_step(sh.X, rows, f, eps, alpha, beta_x, want_raw, shift,
                                          (cols_y, g_all, prec))  # fmt: skip
            g_new, tg, _ = impl.sums_step(sh.Y, mine, g, eps, alpha, beta_y, want_raw, shift,
                                          (cols_x, f_all, prec))  # fmt: skip
        return f_new, g_new, tf, tg
    shift = _mean_shift(sh, impl.plan_shift(sh.X, sh.Y, f, g, eps, phase))
    rows, mine = _ring_sums(sh, "X", f, g, eps, shift, True)
    with section("kernels", f.device):
        f_new, tf, bad_f = impl.sums_step(sh.X, rows, f, eps, alpha, beta_x, True, shift, None)
        g_new, tg, bad_g = impl.sums_step(sh.Y, mine, g, eps, alpha, beta_y, True, shift, None)
    if _any_rank(sh, torch.maximum(bad_f, bad_g)):
        tf, tg = sh.softmins(f, g, eps, ("X", "Y"))
        f_new, g_new = epilogue(f, tf, alpha, beta_x), epilogue(g, tg, alpha, beta_y)
    return f_new, g_new, (tf if want_raw else None), (tg if want_raw else None)


def half_step(sh, which, col_pot, eps, old, alpha, beta, want_raw, phase):
    """The half-step of this rank's rows of side ``which`` ("X": f from g; "Y": g from f)
    against every column, as ``Backend.half_step``: the backend's own half-step against the
    gathered columns (gather mode), or the row sums of a ring pass of plan sweeps.

    Args:
        sh: the sharded problem; a self view (``sh.X is sh.Y``) updates its one potential.
        col_pot: this rank's slice of the column side's potential.
        old: this rank's slice of the rows' potential.

    Returns:
        ``(alpha · old + beta · T, T or None)``, this rank's slices.
    """
    impl, prec = sh.impl, sh.precision
    rows = sh.X if which == "X" else sh.Y
    if sh.mode == "gather":
        sizes = sh.sizes_y if which == "X" else sh.sizes_x
        (p_all,) = sh.comm.gather_dim1([col_pot], [sizes])
        cols = sh.Y_all if which == "X" else sh.X_all
        with section("kernels", old.device):
            return impl.half_step(rows, cols, p_all, eps, old, alpha, beta, want_raw, prec, phase)
    other = sh.Y if which == "X" else sh.X
    if phase in ("second", "iterate") and impl.has_plan_sums(rows, other, eps, False):
        sums, _ = _ring_sums(sh, which, old, col_pot, eps, None, False)
        with section("kernels", old.device):
            out, t, bad = impl.sums_step(rows, sums, old, eps, alpha, beta, True, None, None)
        if not _any_rank(sh, bad):
            return out, (t if want_raw else None)
    f, g = (old, col_pot) if which == "X" else (col_pot, old)
    (t,) = sh.softmins(f, g, eps, (which,))
    return epilogue(old, t, alpha, beta), (t if want_raw else None)


def _ring_sums(sh, which, old, col_pot, eps, shift, cols: bool):
    """``(row sums (1, n_local), this rank's column sums or None)`` of the plan of
    (old, col_pot) with this rank's rows of side ``which`` against every shard of the other
    side, passed around the ring (the column sums travel with their shard)."""
    impl, comm = sh.impl, sh.comm
    rows = sh.X if which == "X" else sh.Y
    like = sh.Y if which == "X" else sh.X
    name = "Y" if which == "X" else "X"
    sizes = sh.sizes_y if which == "X" else sh.sizes_x
    local = [*sh._payload(name, False), col_pot.contiguous()]
    pts0, kernels = local[0], impl.capabilities.kernels
    acc = {}

    def shapes(r):
        n_r = sizes[r]
        pts = ((1, n_r, pts0.shape[-1]), pts0.dtype)
        return [pts, ((2, n_r), sh.pdtype), ((1, n_r), sh.pdtype)]

    def visit(owner, bufs):
        pts, sqw, pot = bufs
        shard = like if owner == comm.rank else unpack(pts, sqw, like, kernels)
        with section("kernels", old.device):
            r, c = impl.plan_sums(rows, shard, old, pot, eps, sh.precision, shift, cols)
        acc["rows"] = r if "rows" not in acc else acc["rows"] + r
        return c

    carry = (lambda r: ((1, sizes[r]), sh.pdtype)) if cols else None
    mine = comm.ring(local, shapes, visit, carry)
    if mine is not None:
        mine = mine.to(old.device)
    return acc["rows"], mine


def _mean_shift(sh, shift):
    """The ranks' mean of their estimates of the plan's shift (None stays None: the choice
    depends on the phase only, the same on every rank)."""
    if shift is None:
        return None
    total = sh.comm.all_reduce(shift.to(sh.comm.device, sh.pdtype).clone())
    return (total / sh.comm.world).to(shift.device, shift.dtype)


def _any_rank(sh, flag) -> bool:
    """Whether the flag is raised on some rank (one all-reduce, read by the host)."""
    t = flag.to(sh.comm.device, torch.float32).reshape(1).clone()
    return bool(sh.comm.all_reduce(t, dist.ReduceOp.MAX) > 0)
