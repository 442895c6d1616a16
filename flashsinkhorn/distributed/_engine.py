"""A sharded OT problem: validation across ranks, global facts, and the two sweep engines.

Each rank holds contiguous shards of the rows of x and y. Every fact that the single-process
solver derives from the whole clouds is computed here from all-reduced partial sums: the
joint weighted mean (centring), uniform weights 1/n_global, the TF32 grid scale (max over
ranks), the annealing diameter (global bounding box), the balanced-mass check, the marginal
error of the convergence test and the dual value. The canonical form is the one of
``problem.prepare``: centred points (rounded to the TF32/float16 grid for precision "tf32"),
squared norms, weights and log-weights in :class:`~flashsinkhorn.problem.Side` objects.

A *sweep* computes, for the local rows of one or both sides, the soft-min T against all
columns of the other side (and/or the envelope gradient):

- ``mode="gather"``: the points are all-gathered once; a sweep all-gathers the column
  potentials (one collective of O(n + m) values) and runs the local backend primitive on
  rows = local shard, columns = whole other cloud;
- ``mode="ring"``: the shards of the other side (points, squared norms, weights, potential)
  pass around the ring while each rank merges per-shard soft-mins by log-sum-exp (and sums
  per-shard transport gradients); nothing of size n or m is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import _validation as V
from ..backends import resolve_backend
from ..backends.base import Backend
from ..engine import resolve_precision
from ..options import SinkhornOptions
from ..problem import Problem, Side, centred_side, kernel_scale, split_half
from ..solvers import eps_schedule, solve
from ..solvers.annealing import cost_range
from ..solvers.objective import _phi, side_error
from ._comm import Comm, comm_device, require_group

MODES = ("gather", "ring")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_options(options: dict) -> tuple[SinkhornOptions, str]:
    """Validates the solver options and the mode; raises ValueError/TypeError naming them."""
    mode = V.check_choice("mode", options.pop("mode"), MODES)
    return SinkhornOptions.build(**options), mode


def _option_codes(opts: SinkhornOptions, mode: str) -> list[float]:
    """The options as numbers, for the cross-rank comparison (None is -1)."""
    out = []
    for v in [*opts.solver_kwargs().values(), mode]:
        if isinstance(v, str):
            v = float(sum(ord(c) * 31**i for i, c in enumerate(v)) % 1_000_003)
        out.append(-1.0 if v is None else float(v))
    return out


#: Names of the compared options, in the order of ``_option_codes``.
_OPTION_NAMES = (*SinkhornOptions(eps=1.0).solver_kwargs(), "mode")


def _check_local(x, y, a, b, device: torch.device):
    """Checks this rank's shards; returns the weights as (n,) / (m,) or None."""
    V.check_points("x_local", x)
    V.check_points("y_local", y)
    for name, t in (("x_local", x), ("y_local", y)):
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D (n_local, d): flashsinkhorn.distributed shards the rows "
                f"of one problem and does not take batched (B, n, d) clouds, got shape "
                f"{tuple(t.shape)}"
            )
    V.check_pair(x, y)
    if x.device != device:
        raise ValueError(
            f"x_local and y_local must be on {device}, the device of this process group's "
            f"communication (NCCL: the current CUDA device, set with torch.cuda.set_device; "
            f"gloo: the CPU), got {x.device}"
        )
    return V.check_weights("a_local", a, x), V.check_weights("b_local", b, y)


def _exchange_meta(comm: Comm, failure, x, y, a, b, codes: list[float] | None):
    """One all_gather of shapes and options; raises the same error on every rank.

    Returns:
        (sizes of the x shards, sizes of the y shards), in rank order.
    """
    if failure is None:
        meta = [0.0, x.shape[1], x.shape[0], y.shape[0], _DTYPES.index(x.dtype)]
        meta += [a is not None, b is not None, *codes]
    else:
        meta = [1.0] + [0.0] * (6 + len(_OPTION_NAMES))
    t = torch.tensor(meta, dtype=torch.float64, device=comm.device)
    rows = torch.stack(comm.all_gather(t)).cpu()
    bad = [r for r in range(comm.world) if rows[r, 0] != 0]
    if failure is not None:
        raise failure
    if bad:
        raise ValueError(
            f"invalid arguments on rank(s) {bad} of the process group (see the error raised "
            "there); every rank stops"
        )

    def column(i):
        return [rows[r, i].item() for r in range(comm.world)]

    if len(set(column(1))) > 1:
        raise ValueError(
            "x_local and y_local must have the same feature dimension d on every rank, got "
            f"d = {[int(v) for v in column(1)]} across ranks"
        )
    if len(set(column(4))) > 1:
        raise TypeError(
            "x_local and y_local must have the same dtype on every rank, got "
            f"{[str(_DTYPES[int(v)]) for v in column(4)]} across ranks"
        )
    for i, name in ((5, "a_local"), (6, "b_local")):
        if len(set(column(i))) > 1:
            raise ValueError(f"{name} must be given on every rank or on none (None: uniform)")
    for i, name in enumerate(_OPTION_NAMES):
        if len(set(column(7 + i))) > 1:
            raise ValueError(f"{name} must be the same on every rank")
    return [int(v) for v in column(2)], [int(v) for v in column(3)]


def _payload(side: Side) -> list[torch.Tensor]:
    """What represents a Side on the wire: kernel points (B=1) and (2, n) norms + weights.

    Grid copies ("tf32") travel as float16; split parts ("tf32x3") are rebuilt from the
    float32 points on arrival, so those travel instead.
    """
    pts = side.xk if side.xk is not None and not side.split else side.x
    return [pts.contiguous(), torch.cat([side.sq, side.w], 0)]


def _unpack(pts: torch.Tensor, sqw: torch.Tensor, like: Side) -> Side:
    """Rebuilds a Side from its payload; bit-identical to the Side its owner built."""
    if like.split:
        x, xk = pts, split_half(pts, like.kscale)
    elif like.xk is not None:
        x, xk = pts.to(torch.float32) * like.kscale, pts
    else:
        x, xk = pts, None
    w = sqw[1:2]
    return Side(x=x, sq=sqw[0:1], w=w, logw=w.log(), rho=like.rho, xk=xk, kscale=like.kscale)


def _merge_softmin(prev: torch.Tensor | None, t: torch.Tensor, eps: float) -> torch.Tensor:
    """Soft-min over the union of column shards: T = −eps · LSE_k(−T_k / eps).

    A shard of zero-weight columns has T_k = +inf and drops out (logaddexp of −inf).
    """
    if prev is None:
        return t
    return -eps * torch.logaddexp(-prev / eps, -t / eps)


def _epilogue(old, t, alpha: float, beta: float) -> torch.Tensor:
    """alpha · old + beta · T, as the backends write it."""
    return beta * t if alpha == 0.0 else alpha * old + beta * t


@dataclass
class SolveOutput:
    """Local potentials (1, n_local), (1, m_local) and the global facts of the solve."""

    f: torch.Tensor
    g: torch.Tensor
    eps: float
    n_iters: int
    converged: bool
    marginal_error: torch.Tensor | None
    errors: list[tuple[int, float]] = field(default_factory=list)


class Sharded:
    """This rank's part of a sharded OT problem and the engine that sweeps it."""

    def __init__(self, x, y, a, b, *, group, **options):
        require_group(group)
        self.comm = comm = Comm(group, comm_device(group, x))
        failure = opts = codes = None
        try:
            opts, mode = _check_options(dict(options))
            codes = _option_codes(opts, mode)
            a, b = _check_local(x, y, a, b, comm.device)
        except (TypeError, ValueError) as exc:
            failure = exc
        self.sizes_x, self.sizes_y = _exchange_meta(comm, failure, x, y, a, b, codes)
        self.opts = opts
        self.n, self.m = sum(self.sizes_x), sum(self.sizes_y)
        self.off_x = sum(self.sizes_x[: comm.rank])
        self.off_y = sum(self.sizes_y[: comm.rank])
        self.impl = resolve_backend(opts.backend, x.device, x.dtype)
        self.precision = resolve_precision(opts.precision, self.impl.name, x.dtype)
        self.mode = mode
        with torch.no_grad():
            self._build(x.detach(), y.detach(), a, b)

    def _build(self, x, y, a, b):
        opts, comm = self.opts, self.comm
        X, Y = x[None], y[None]
        d = X.shape[-1]
        pdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.pdtype = pdtype

        def weights(w, n_local, n_global):
            if w is None:
                return torch.full((1, n_local), 1.0 / n_global, dtype=pdtype, device=X.device)
            return w.to(pdtype).reshape(1, n_local).contiguous()

        wa = weights(a, X.shape[1], self.n)
        wb = weights(b, Y.shape[1], self.m)
        Xc, Yc = X.to(pdtype), Y.to(pdtype)
        # One all-reduce: flags (counts), masses and weighted sums for the joint mean.
        flags = [(wa < 0).any(), (wb < 0).any(), ~torch.isfinite(wa).all()]
        flags += [~torch.isfinite(wb).all()]
        if opts.check_finite:
            flags += [~torch.isfinite(X).all(), ~torch.isfinite(Y).all()]
        flags += [(wa == 0).any(), (wb == 0).any()]
        sx = torch.einsum("bn,bnd->bd", wa, Xc)[0]
        sy = torch.einsum("bm,bmd->bd", wb, Yc)[0]
        pack = torch.cat([torch.stack(flags).to(pdtype), wa.sum(-1), wb.sum(-1), sx, sy]).to(
            comm.device
        )
        pack = comm.all_reduce(pack).to(X.device)
        k = len(flags)
        *bad, null_a, null_b = (pack[:k] > 0).tolist()
        names = ["a_local", "b_local", "a_local", "b_local", "x_local", "y_local"]
        msgs = ["must be non-negative"] * 2 + ["must be finite"] * 2
        msgs += ["must not contain NaN or inf"] * 2
        for flag, name, msg in zip(bad, names, msgs, strict=False):
            if flag:
                raise ValueError(f"{name} {msg} (on some rank)")
        ma, mb = pack[k : k + 1], pack[k + 1 : k + 2]
        if float(ma) <= 0:
            raise ValueError("a_local must have a positive total mass over all ranks")
        if float(mb) <= 0:
            raise ValueError("b_local must have a positive total mass over all ranks")
        if opts.rho_x is None and opts.rho_y is None:
            rtol = 1e-6 if pdtype == torch.float64 else 1e-4
            gap = float((ma - mb).abs() / torch.maximum(ma, mb))
            if gap > rtol:
                raise ValueError(
                    "a and b must have equal total mass over all ranks in a balanced problem "
                    f"(relative gap {gap:.2e} > {rtol:g}); normalise them or pass rho_x/rho_y "
                    "for an unbalanced problem"
                )
        self.ma, self.mb = ma, mb
        centre = ((pack[k + 2 : k + 2 + d] + pack[k + 2 + d :]) / (ma + mb))[None]
        self.centre = centre
        Xc = Xc - centre[:, None, :]
        Yc = Yc - centre[:, None, :]
        kscale = 1.0
        if self.precision in ("tf32", "tf32x3") and x.dtype == torch.float32:
            amax = torch.maximum(Xc.abs().max(), Yc.abs().max()).reshape(1).to(comm.device)
            kscale = kernel_scale(self.precision, float(comm.all_reduce(amax, dist.ReduceOp.MAX)))
        self.X = centred_side(Xc, x.dtype, wa, opts.rho_x, self.precision, kscale, null_a)
        self.Y = centred_side(Yc, x.dtype, wb, opts.rho_y, self.precision, kscale, null_b)
        diameter = opts.diameter
        wants_range = opts.scaling == "auto" and opts.tol is not None
        if (wants_range or isinstance(opts.scaling, float)) and diameter is None:
            diameter = self.global_diameter(self.X.x, self.Y.x)
        self.opts = opts = opts.resolve(cost_range(diameter))
        if opts.acceleration == "anderson":
            raise ValueError(
                "acceleration='anderson' is not available for sharded solves (its mixing "
                "needs inner products over every rank); use 'overrelax' or 'auto'"
            )
        self.eps_list = eps_schedule(opts.eps, opts.scaling, diameter, dtype=self.X.sq.dtype)
        self.payload_x = _payload(self.X)
        self.payload_y = _payload(self.Y)
        if self.mode == "gather":
            pts = self.comm.gather_dim1(
                [self.payload_x[0], self.payload_y[0]], [self.sizes_x, self.sizes_y]
            )
            sqw = self.comm.gather_dim1(
                [self.payload_x[1], self.payload_y[1]], [self.sizes_x, self.sizes_y]
            )
            self.X_all = _unpack(pts[0], sqw[0], self.X)
            self.Y_all = _unpack(pts[1], sqw[1], self.Y)

    def global_diameter(self, X: torch.Tensor, Y: torch.Tensor) -> float:
        """Diagonal of the bounding box of all ranks' points (``estimate_diameter``)."""
        lo = torch.minimum(X.amin(dim=(0, 1)), Y.amin(dim=(0, 1))).double()
        hi = torch.maximum(X.amax(dim=(0, 1)), Y.amax(dim=(0, 1))).double()
        box = self.comm.all_reduce(torch.cat([-lo, hi]).to(self.comm.device), dist.ReduceOp.MAX)
        d = lo.numel()
        return float((box[d:] + box[:d]).norm())

    # ----------------------------------------------------------------------------- sweeps

    def _partial(self, rows, row_pot, cols, col_pot, eps, ops, acc):
        prec = self.precision
        if "softmin" in ops:
            _, t = self.impl.softmin(rows, cols, col_pot, eps, row_pot, 0.0, 1.0, True, prec)
            acc["softmin"] = _merge_softmin(acc.get("softmin"), t, eps)
        if "grad" in ops:
            G, _ = self.impl.transport_grad(rows, cols, row_pot, col_pot, eps, prec)
            acc["grad"] = G if "grad" not in acc else acc["grad"] + G

    def sweep(self, f, g, eps: float, ops: dict[str, set[str]]) -> dict[str, dict]:
        """Soft-mins / envelope gradients of the local rows against all columns.

        Args:
            f: (1, n_local) potential of the local x shard.
            g: (1, m_local) potential of the local y shard.
            eps: entropic regularisation.
            ops: ``{"X": {...}, "Y": {...}}``, each a subset of {"softmin", "grad"}: for "X"
                the rows are the local x shard and the columns all of y (potential g).

        Returns:
            ``{"X": {"softmin": T (1, n_local), "grad": (1, n_local, d)}, "Y": {...}}``.
        """
        acc = {side: {} for side in ops}
        if self.mode == "gather":
            want = [("Y" in ops, f, self.sizes_x), ("X" in ops, g, self.sizes_y)]
            parts = [(p, s) for need, p, s in want if need]
            full = self.comm.gather_dim1([p for p, _ in parts], [s for _, s in parts])
            full = iter(full)
            f_all = next(full) if "Y" in ops else None
            g_all = next(full) if "X" in ops else None
            if "X" in ops:
                self._partial(self.X, f, self.Y_all, g_all, eps, ops["X"], acc["X"])
            if "Y" in ops:
                self._partial(self.Y, g, self.X_all, f_all, eps, ops["Y"], acc["Y"])
            return acc
        # Ring: the buffers of rank r are [y points, y norms+weights, g] for the x rows and
        # [x points, x norms+weights, f] for the y rows.
        local = []
        if "X" in ops:
            local += [*self.payload_y, g]
        if "Y" in ops:
            local += [*self.payload_x, f]
        pts_x, pts_y = self.payload_x[0], self.payload_y[0]
        d = pts_x.shape[-1]

        def shapes(r):
            out = []
            for side, n_r, pts in (("X", self.sizes_y[r], pts_y), ("Y", self.sizes_x[r], pts_x)):
                if side in ops:
                    out += [((1, n_r, d), pts.dtype), ((2, n_r), self.pdtype)]
                    out += [((1, n_r), self.pdtype)]
            return out

        def visit(owner, bufs):
            i = 0
            if "X" in ops:
                cols = self.Y if owner == self.comm.rank else _unpack(bufs[0], bufs[1], self.Y)
                self._partial(self.X, f, cols, bufs[2], eps, ops["X"], acc["X"])
                i = 3
            if "Y" in ops:
                own = owner == self.comm.rank
                cols = self.X if own else _unpack(bufs[i], bufs[i + 1], self.X)
                self._partial(self.Y, g, cols, bufs[i + 2], eps, ops["Y"], acc["Y"])

        self.comm.ring(local, shapes, visit)
        return acc

    def softmins(self, f, g, eps, sides: tuple[str, ...]) -> list[torch.Tensor]:
        """Raw soft-mins T of the requested sides ("X": of f's rows from g; "Y": from f)."""
        out = self.sweep(f, g, eps, {s: {"softmin"} for s in sides})
        return [out[s]["softmin"] for s in sides]

    # ---------------------------------------------------------------------------- solver

    def _global_error(self, err: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(err.to(self.comm.device)).to(err.device)

    def solve(self, compute_error: bool) -> SolveOutput:
        """The library's solver loop on this rank's rows, with sweeps over all columns and
        the convergence test on the global error (:class:`ShardedBackend`)."""
        problem = Problem(self.X, self.Y, batched=False, precision=self.precision)
        st = solve(problem, ShardedBackend(self), self.eps_list, self.opts)
        err = st.marginal_error
        if not st.converged and compute_error:
            err = self.marginal_error(st.f, st.g, st.eps)
        return SolveOutput(st.f, st.g, st.eps, st.n_iters, st.converged, err, st.errors)

    def marginal_error(self, f, g, eps) -> torch.Tensor:
        """(1,) global ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ of the plan (f, g) (collective)."""
        tf, tg = self.softmins(f, g, eps, ("X", "Y"))
        err = side_error(self.X, f, tf, eps) + side_error(self.Y, g, tg, eps)
        return self._global_error(err)

    def value(self, f, g, eps) -> torch.Tensor:
        """(1,) OT_eps from the dual (``objective.dual_value``), reduced over ranks."""
        X, Y = self.X, self.Y
        parts = [_phi(X, f), _phi(Y, g)]
        relaxed = X.rho is not None and Y.rho is not None
        if relaxed:
            parts += [(X.w * torch.exp(-f / X.rho)).sum(-1), (Y.w * torch.exp(-g / Y.rho)).sum(-1)]
        t = self.comm.all_reduce(torch.cat(parts).to(self.comm.device)).to(f.device)
        if X.rho is None:
            mass = self.ma
        elif Y.rho is None:
            mass = self.mb
        else:
            mass = 0.5 * (t[2:3] + t[3:4])
        return t[0:1] + t[1:2] - eps * (mass - self.ma * self.mb)


class ShardedBackend(Backend):
    """The soft-min primitive of a sharded problem, for the solver loop.

    Rows are this rank's shard of a side (``rows is sharded.X`` or ``sharded.Y``); the sweep
    runs them against every column of the other side (gather or ring mode). The loop's
    convergence test sees the error reduced over all ranks.
    """

    def __init__(self, sharded: Sharded):
        self.sh = sharded
        self.name = sharded.impl.name

    def _raw(self, rows: Side, old: torch.Tensor, col_pot: torch.Tensor, eps: float):
        if rows is self.sh.X:
            return self.sh.softmins(old, col_pot, eps, ("X",))[0]
        return self.sh.softmins(col_pot, old, eps, ("Y",))[0]

    def softmin(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
        t = self._raw(rows, old, col_pot, eps)
        return _epilogue(old, t, alpha, beta), (t if want_raw else None)

    def symmetric_step(self, X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision,
                       phase="cold"):  # fmt: skip
        tf, tg = self.sh.softmins(f, g, eps, ("X", "Y"))
        return _epilogue(f, tf, alpha, beta_x), _epilogue(g, tg, alpha, beta_y), tf, tg

    def reduce_error(self, err: torch.Tensor) -> torch.Tensor:
        return self.sh._global_error(err)
