"""A sharded OT problem: validation across ranks, global facts, sweeps and the solver.

Each rank holds contiguous shards of the rows of x and y. Every fact that the single-process
solver derives from the whole clouds is computed here from all-reduced partial sums: the
joint weighted mean (centring), uniform weights 1/n_global, the statistics of the range
checks (largest coordinate and squared norm, bounding box, masses: one all-reduce), hence the
TF32 grid scale, the annealing ladder, the plan floor and the large-eps threshold
(``limits.admit`` on global statistics), the balanced-mass check, the marginal error of the
convergence test and the dual value. The canonical form is the one of ``problem.prepare``:
centred points (rounded to the TF32/float16 grid for precision "tf32"), squared norms,
weights and log-weights in :class:`~flashsinkhorn.problem.Side` objects.

The self terms of a divergence are views of the joint problem (:meth:`Sharded.self_view`):
one side on both ends, one potential, as ``engine.solve_divergence`` runs them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from .. import _validation as V
from .. import limits
from ..backends import resolve_backend
from ..backends.base import Backend, Capabilities
from ..engine import admit, resolve_precision, run
from ..problem import Problem, Side, Stats, centred_side, kernel_scale
from ..solvers.objective import (
    mass_gap_of,
    nominal_sum,
    phi_from_sum,
    phi_integrand,
    plan_gap_integrand,
    relaxed_integrand,
    side_error,
)
from . import _block
from . import _checks as C
from ._comm import Comm, comm_device, require_group
from ._sweep import LargeMerge, epilogue, merge_softmin, payload, unit_columns, unpack
from ._timing import section


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


@dataclass(frozen=True)
class Masses:
    """Global masses of one side: the weights' sum and the nominal mass the soft-mins and the
    value attribute to it (``Side.nominal_mass``), both (1,); per-rank shard sums (host)."""

    total: torch.Tensor
    nominal: torch.Tensor
    renormalised: bool
    shards: tuple[float, ...]
    #: ln of the nominal mass, on the host
    log_nominal: float


def _side_stats(Xc, Yc, wa, wb) -> torch.Tensor:
    """This rank's statistics for the MAX all-reduce: largest |coordinate|, −lo and hi of the
    bounding box, largest squared norm, over every point and over the points with mass (±inf
    where this rank has none: they drop out of the maximum)."""
    pts = torch.cat([Xc[0], Yc[0]])
    live = (torch.cat([wa[0], wb[0]]) > 0)[:, None]
    sq = (pts * pts).sum(-1, keepdim=True)
    parts = [pts.abs().max().reshape(1), -pts.amin(0), pts.amax(0), sq.max().reshape(1)]
    parts += [-torch.where(live, pts, math.inf).amin(0), torch.where(live, pts, -math.inf).amax(0)]
    parts += [torch.where(live, sq, -math.inf).max().reshape(1)]
    return torch.cat(parts).double()


def _stats(vals: list[float], d: int, mass: float) -> Stats:
    """The problem's :class:`~flashsinkhorn.problem.Stats` from the reduced statistics."""
    box2 = sum((vals[1 + k] + vals[1 + d + k]) ** 2 for k in range(d))
    live = vals[2 + 2 * d :]
    box2_live = sum((live[k] + live[d + k]) ** 2 for k in range(d))
    return Stats(vals[0], box2, mass, vals[1 + 2 * d], live=(box2_live, live[2 * d]))


class Sharded:
    """This rank's part of a sharded OT problem and the engine that sweeps it.

    Args:
        x, y, a, b: this rank's shards (checked here, on every rank together).
        group: the process group (None: the default group).
        compute_error: whether the caller will compute the marginal error of an unconverged
            solve (a collective sweep): checked and compared across ranks with the options.
        extra_check: a callable run with this rank's checks (its error is agreed on too).
        **options: the solver options and ``mode``.
    """

    def __init__(self, x, y, a, b, *, group, compute_error=False, extra_check=None, **options):
        require_group(group)
        self.comm = comm = Comm(group, comm_device(group, x))

        def checks():
            opts, mode = C.check_options(dict(options))
            V.check_bool("compute_error", compute_error)
            if extra_check is not None:
                extra_check()
            local = C.check_local(x, y, a, b, comm.device, opts.check_finite)
            impl = resolve_backend(opts.backend, x.device, x.dtype)
            prec = resolve_precision(opts.precision, impl, x.dtype)
            codes = C.option_codes(opts, mode, compute_error, impl.name, prec)
            return opts, mode, codes, impl, prec, *local

        opts, mode, codes, self.impl, self.precision, a, b = C.guarded(comm, checks)
        self.sizes_x, self.sizes_y = C.exchange_meta(comm, x, y, a, b, codes)
        self.n, self.m = sum(self.sizes_x), sum(self.sizes_y)
        self.off_x = sum(self.sizes_x[: comm.rank])
        self.off_y = sum(self.sizes_y[: comm.rank])
        self.mode = mode
        self.opts = opts
        self.is_self = False
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
        # One all-reduce (sum): zero-weight flags, masses, weighted sums for the joint mean,
        # and this rank's shard masses in its slots (every rank learns every shard's mass).
        W = comm.world
        shard = torch.zeros(2 * W, dtype=pdtype, device=X.device)
        shard[comm.rank], shard[W + comm.rank] = wa.sum(), wb.sum()
        flags = torch.stack([(wa == 0).any(), (wb == 0).any()]).to(pdtype)
        # Carried in float64: the masses as the sum of the shards' masses (what the ring's
        # bookkeeping adds up too), and, for the centre, masses and weighted sums formed in
        # float64 as problem.prepare forms them, so that the float32 centre is the one
        # process's whatever order the ranks sum in.
        f64 = torch.float64
        wa64, wb64 = wa.to(f64), wb.to(f64)
        sx = torch.einsum("bn,bnd->bd", wa64, Xc.to(f64))[0]
        sy = torch.einsum("bm,bmd->bd", wb64, Yc.to(f64))[0]
        exact = torch.cat([wa64.sum(-1), wb64.sum(-1)])
        pack = torch.cat([flags, wa.sum(-1), wb.sum(-1)]).to(f64)
        pack = torch.cat([pack, exact, sx, sy, shard.to(f64)])
        pack = comm.all_reduce(pack.to(comm.device)).to(X.device)
        # masses rounded to the points' dtype, on the host too (ln of the nominal mass)
        host = pack[:4].to(pdtype).tolist()
        null_a, null_b = host[0] > 0, host[1] > 0
        ma, mb = pack[2:3].to(pdtype), pack[3:4].to(pdtype)
        mass64 = pack[4] + pack[5]
        pack = torch.cat([pack[:4], pack[6:]])
        if not host[2] > 0:
            raise ValueError("a_local must have a positive total mass over all ranks")
        if not host[3] > 0:
            raise ValueError("b_local must have a positive total mass over all ranks")
        balanced = opts.rho_x is None and opts.rho_y is None
        if balanced and (a is not None or b is not None):
            rtol = 1e-6 if pdtype == torch.float64 else 1e-4
            gap = abs(host[2] - host[3]) / max(host[2], host[3])
            if gap > rtol:
                raise ValueError(
                    "a and b must have equal total mass over all ranks in a balanced problem "
                    f"(relative gap {gap:.2e} > {rtol:g}); normalise them or pass rho_x/rho_y "
                    "for an unbalanced problem"
                )
        shards = pack[4 + 2 * d :].tolist()
        centre = ((pack[4 : 4 + d] + pack[4 + d : 4 + 2 * d]) / mass64).to(pdtype)[None]
        Xc = Xc - centre[:, None, :]
        Yc = Yc - centre[:, None, :]
        # One all-reduce (max): the statistics of the range checks and of the TF32 scale.
        st = comm.all_reduce(_side_stats(Xc, Yc, wa, wb).to(comm.device), dist.ReduceOp.MAX)
        vals = st.tolist()
        stats = _stats(vals, d, max(host[2], host[3]))
        kscale = 1.0
        if self.precision in ("tf32", "tf32x3") and x.dtype == torch.float32:
            kscale = kernel_scale(self.precision, vals[0])
        sx_ = centred_side(Xc, x.dtype, wa, opts.rho_x, self.precision, kscale, null_a)
        sy_ = centred_side(Yc, x.dtype, wb, opts.rho_y, self.precision, kscale, null_b)
        # Nominal masses as ``problem.prepare`` sets them: 1 for uniform weights, the x side's
        # for both sides of a balanced problem.
        one = torch.ones_like(ma)
        nom_x = one if a is None else ma
        nom_y = (one if a is None else ma) if balanced else (one if b is None else mb)
        lx = 0.0 if a is None else math.log(host[2])
        ly = lx if balanced else 0.0 if b is None else math.log(host[3])
        self.mass_x = Masses(ma, nom_x, a is None, tuple(shards[:W]), lx)
        self.mass_y = Masses(mb, nom_y, balanced or b is None, tuple(shards[W:]), ly)
        problem = Problem(sx_, sy_, False, self.precision, centre, stats)
        # "auto" resolved, the ladder, and the range checks, the plan floor of a solve with a
        # tolerance, the large-eps sides: from global statistics, so every rank decides alike.
        # "auto" resolves as for one process on the whole problem (its scores per half-step)
        problem, opts, eps_list = admit(
            problem, opts, long_iterations=self.impl.capabilities.long_iterations,
            work=self.n * self.m,
        )  # fmt: skip
        self.opts, self.eps_list = opts, eps_list
        self.problem = problem
        self.X, self.Y = self.problem.X, self.problem.Y
        self.centre = centre
        self.payloads = {}
        if self.mode == "gather":
            pts = comm.gather_dim1(
                [self._payload("X", True)[0], self._payload("Y", True)[0]],
                [self.sizes_x, self.sizes_y],
            )
            sqw = comm.gather_dim1(
                [self._payload("X", True)[1], self._payload("Y", True)[1]],
                [self.sizes_x, self.sizes_y],
            )
            kernels = self.impl.capabilities.kernels
            self.X_all = self._nominal(unpack(pts[0], sqw[0], self.X, kernels), "X")
            self.Y_all = self._nominal(unpack(pts[1], sqw[1], self.Y, kernels), "Y")

    def _nominal(self, side: Side, which: str) -> Side:
        """A gathered side whose nominal mass (``Side.nominal_mass``, the M of the large-eps
        soft-min's eps ln M) is exactly the one of the value (:class:`Masses`): the
        potentials carry eps ln M, and the value's first-order cancellation of it needs the
        same M to the last bit (a sum of the weights in another order differs by u·M, which
        eps multiplies)."""
        ms = self.mass_x if which == "X" else self.mass_y
        return replace(side, unit_mass=False, mass_of=ms.nominal.reshape(1, 1))

    def _payload(self, which: str, grad: bool) -> list[torch.Tensor]:
        key = (which, grad)
        if key not in self.payloads:
            side = self.X if which == "X" else self.Y
            self.payloads[key] = payload(side, self.impl.capabilities.kernels, grad)
        return self.payloads[key]

    def self_view(self, which: str) -> Sharded:
        """The self problem OT(z, z) of side ``which`` ("X" or "Y") of this joint problem: the
        same side (centring, operand scale, large-eps threshold), eps ladder and options, one
        potential (``problem.X is problem.Y``; the loop's self iteration)."""
        view = copy.copy(self)
        side = self.X if which == "X" else self.Y
        ms = self.mass_x if which == "X" else self.mass_y
        sizes = self.sizes_x if which == "X" else self.sizes_y
        view.X = view.Y = side
        view.problem = replace(self.problem, X=side, Y=side)
        view.mass_x = view.mass_y = ms
        view.sizes_x = view.sizes_y = sizes
        view.n = view.m = sum(sizes)
        view.payloads = {}
        view.is_self = True
        if self.mode == "gather":
            view.X_all = view.Y_all = self.X_all if which == "X" else self.Y_all
        return view

    # ----------------------------------------------------------------------------- sweeps

    def _cols_all(self, which: str, unit: bool) -> Side:
        cols = self.Y_all if which == "X" else self.X_all
        return replace(cols, unit_mass=True, mass_of=None) if unit else cols

    def sweep(self, f, g, eps: float, ops: dict[str, set[str]], unit: bool = False):
        """Soft-mins / envelope gradients of the local rows against all columns.

        Args:
            f: (1, n_local) potential of the local x shard.
            g: (1, m_local) potential of the local y shard (``f`` for a self problem).
            eps: entropic regularisation.
            ops: ``{"X": {...}, "Y": {...}}``, each a subset of {"softmin", "grad"}: for "X"
                the rows are the local x shard and the columns all of y (potential g). A
                self problem has only "X".
            unit: the soft-mins with the columns' nominal mass taken as 1 (no eps ln M term:
                the value's plan-mass gap at large eps).

        Returns:
            ``{"X": {"softmin": T (1, n_local), "grad": (1, n_local, d)}, "Y": {...}}``.
        """
        merges = {s: _Plain(eps) for s in ops}
        grads: dict[str, torch.Tensor] = {}
        if self.mode == "gather":
            want = [("Y" in ops, f, self.sizes_x), ("X" in ops, g, self.sizes_y)]
            parts = [(p, sz) for need, p, sz in want if need]
            full = iter(self.comm.gather_dim1([p for p, _ in parts], [sz for _, sz in parts]))
            f_all = next(full) if "Y" in ops else None
            g_all = next(full) if "X" in ops else None
            halves = {}
            if "X" in ops:
                halves["X"] = (self.X, self._cols_all("X", unit), self.Y_all, g_all, f, 1.0)
            if "Y" in ops:
                halves["Y"] = (self.Y, self._cols_all("Y", unit), self.X_all, f_all, g, 1.0)
            self._visit(halves, ops, eps, merges, grads)
        else:
            self._sweep_ring(f, g, eps, ops, unit, merges, grads)
        out = {s: {} for s in ops}
        for s in ops:
            if "softmin" in ops[s]:
                out[s]["softmin"] = merges[s].result()
            if "grad" in ops[s]:
                out[s]["grad"] = grads[s]
        return out

    def _visit(self, halves, ops, eps, merges, grads):
        """The backend calls against one set of columns.

        ``halves[side]`` is (rows, columns of the soft-min or None to skip it, columns of the
        gradient, column potential, row potential, the columns' share of the mass).
        Soft-min-only halves of both sides share one launch (``Backend.softmin_pair``: fused
        on Triton).
        """
        with section("kernels", self.X.x.device):
            self._visit_kernels(halves, ops, eps, merges, grads)

    def _visit_kernels(self, halves, ops, eps, merges, grads):
        prec = self.precision
        soft = {s: h for s, h in halves.items() if "softmin" in ops[s] and h[1] is not None}
        if len(soft) == 2 and ops["X"] == ops["Y"] == {"softmin"}:
            (r1, c1, _, p1, o1, mu1), (r2, c2, _, p2, o2, mu2) = soft["X"], soft["Y"]
            (_, t1), (_, t2) = self.impl.softmin_pair(
                (r1, c1, p1, o1, 1.0), (r2, c2, p2, o2, 1.0), eps, 0.0, True, prec
            )
            merges["X"].add(t1, mu1)
            merges["Y"].add(t2, mu2)
        else:
            for s, (rows, cols, _, col_pot, row_pot, mu) in soft.items():
                _, t = self.impl.softmin(rows, cols, col_pot, eps, row_pot, 0.0, 1.0, True, prec)
                merges[s].add(t, mu)
        for s, (rows, _, cols, col_pot, row_pot, _) in halves.items():
            if "grad" in ops[s]:
                G, _ = self.impl.transport_grad(rows, cols, row_pot, col_pot, eps, prec)
                grads[s] = G if s not in grads else grads[s] + G

    def _sweep_ring(self, f, g, eps, ops, unit, merges, grads):
        """The ring pass: the buffers of rank r are [y operands, y norms+weights, g] for the
        x rows and [x operands, x norms+weights, f] for the y rows."""
        grad = any("grad" in o for o in ops.values())
        large = eps >= self.X.large_eps
        sides = {"X": (self.X, self.Y, self.mass_y, g, f), "Y": (self.Y, self.X, self.mass_x, f, g)}
        if large:
            for s in ops:
                rows, _, ms, _, _ = sides[s]
                log_mass = 0.0 if unit else ms.log_nominal
                merges[s] = LargeMerge(rows, eps, log_mass)
        local = []
        for s in ops:
            cols_name = "Y" if s == "X" else "X"
            local += [*self._payload(cols_name, grad), sides[s][3]]
        fmt = {s: self._payload("Y" if s == "X" else "X", grad)[0] for s in ops}

        def shapes(r):
            out = []
            for s in ops:
                n_r = (self.sizes_y if s == "X" else self.sizes_x)[r]
                pts = fmt[s]
                out += [((1, n_r, pts.shape[-1]), pts.dtype), ((2, n_r), self.pdtype)]
                out += [((1, n_r), self.pdtype)]
            return out

        def visit(owner, bufs):
            halves = {}
            for i, s in enumerate(ops):
                rows, like, ms, _, row_pot = sides[s]
                pts, sqw, pot = bufs[3 * i : 3 * i + 3]
                kernels = self.impl.capabilities.kernels
                cols = like if owner == self.comm.rank else unpack(pts, sqw, like, kernels)
                mass = ms.shards[owner]
                soft = cols
                if large:
                    # columns at mass 1 for LargeMerge; a massless shard adds nothing
                    soft = unit_columns(cols, mass) if mass > 0 else None
                halves[s] = (rows, soft, cols, pot, row_pot, mass / sum(ms.shards))
            self._visit(halves, ops, eps, merges, grads)

        self.comm.ring(local, shapes, visit)

    def softmins(self, f, g, eps, sides: tuple[str, ...]) -> list[torch.Tensor]:
        """Raw soft-mins T of the requested sides ("X": of f's rows from g; "Y": from f)."""
        out = self.sweep(f, g, eps, {s: {"softmin"} for s in sides})
        return [out[s]["softmin"] for s in sides]

    # ---------------------------------------------------------------------------- solver

    def global_error(self, err: torch.Tensor) -> torch.Tensor:
        """The marginal error of the whole problem from this rank's part (all-reduce)."""
        return self.comm.all_reduce(err.to(self.comm.device)).to(err.device)

    def solve(self, compute_error: bool) -> SolveOutput:
        """The library's solver loop on this rank's rows, with sweeps over all columns and
        the convergence test on the global error (:class:`ShardedBackend`)."""
        st, _ = run(self.problem, ShardedBackend(self), self.eps_list, self.opts, value=False)
        err = st.marginal_error
        if not st.converged and compute_error:
            limits.check_plan(
                self.problem, st.eps,
                "the marginal error (compute_error=True; compute_error=False returns the "
                "value and the potentials)",
            )  # fmt: skip
            err = self.marginal_error(st.f, st.g, st.eps)
        f, g = self.balanced_gauge(st.f, st.g)
        return SolveOutput(f, g, st.eps, st.n_iters, st.converged, err, st.errors)

    def balanced_gauge(self, f, g):
        """``(f, g)`` of a balanced problem in the returned gauge ⟨a, f⟩ = ⟨b, g⟩ of every
        other solve (``result.balanced_gauge``), from the global weighted sums (one
        all-reduce, on every rank alike); a KL side or a self view keeps its potentials. The
        plan, the value and the point gradients read f + g and do not change."""
        X, Y, mx, my = self.X, self.Y, self.mass_x, self.mass_y
        if X is Y or X.rho is not None or Y.rho is not None:
            return f, g
        sums = torch.cat([(X.w * f).sum(-1), (Y.w * g).sum(-1)])
        t = self.comm.all_reduce(sums.to(self.comm.device)).to(f.device)
        sa = nominal_sum(mx.renormalised, t[0:1], mx.total, mx.nominal)
        sb = nominal_sum(my.renormalised, t[1:2], my.total, my.nominal)
        c = ((sb - sa) / (mx.nominal + my.nominal))[:, None].to(f.dtype)
        return f + c, g - c

    def marginal_error(self, f, g, eps) -> torch.Tensor:
        """(1,) global ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ of the plan (f, g) (collective)."""
        if self.is_self:
            (tf,) = self.softmins(f, f, eps, ("X",))
            # both marginals of a self plan are equal (solvers/loop.py)
            return self.global_error(2.0 * side_error(self.X, f, tf, eps))
        tf, tg = self.softmins(f, g, eps, ("X", "Y"))
        err = side_error(self.X, f, tf, eps) + side_error(self.Y, g, tg, eps)
        return self.global_error(err)

    def value(self, f, g, eps) -> torch.Tensor:
        """(1,) OT_eps from the dual, as ``objective.dual_value`` on the whole clouds: the
        weighted sums are all-reduced (one collective), the nominal masses are global.

        Two KL sides at large eps take the plan's mass gap from one more sweep, against the
        columns at mass 1 (``objective._plan_mass_gap``).
        """
        X, Y, mx, my = self.X, self.Y, self.mass_x, self.mass_y
        two_kl = X.rho is not None and Y.rho is not None
        large = two_kl and eps >= X.large_eps
        sums = [(X.w * phi_integrand(X, f)).sum(-1), (Y.w * phi_integrand(Y, g)).sum(-1)]
        if large:
            (t_hat,) = [self.sweep(f, g, eps, {"X": {"softmin"}}, unit=True)["X"]["softmin"]]
            sums.append((X.w * plan_gap_integrand(f, t_hat, eps)).sum(-1))
        elif two_kl:
            sums += [(X.w * relaxed_integrand(X, f)).sum(-1)]
            sums += [(Y.w * relaxed_integrand(Y, g)).sum(-1)]
        t = self.comm.all_reduce(torch.cat(sums).to(self.comm.device)).to(f.device)

        def nominal(ms: Masses, k: int):
            return nominal_sum(ms.renormalised, t[k : k + 1], ms.total, ms.nominal)

        phi = phi_from_sum(X, nominal(mx, 0)) + phi_from_sum(Y, nominal(my, 1))
        if large:
            gap = mx.nominal * my.nominal * (t[2:3] / mx.total)
        elif two_kl:
            gap = mass_gap_of(X.rho, Y.rho, mx.nominal, my.nominal, nominal(mx, 2), nominal(my, 3))
        else:
            gap = mass_gap_of(X.rho, Y.rho, mx.nominal, my.nominal)
        return phi - eps * gap


class _Plain:
    """The merge of per-shard soft-mins below the large-eps threshold (``merge_softmin``);
    in gather mode the one soft-min against all columns."""

    def __init__(self, eps: float):
        self.t = None
        self.eps = eps

    def add(self, t: torch.Tensor, mu: float) -> None:
        self.t = merge_softmin(self.t, t, self.eps)

    def result(self) -> torch.Tensor:
        return self.t


class ShardedBackend(Backend):
    """The soft-min primitive of a sharded problem, for the solver loop.

    Rows are this rank's shard of a side (``rows is sharded.X`` or ``sharded.Y``); the sweep
    runs them against every column of the other side (gather or ring mode). The loop's
    convergence test sees the error reduced over all ranks.
    """

    # sweeps over every rank's columns: no transports, and launches outside any one graph
    capabilities = Capabilities(
        transports=False, second_order=False, graph_safe=False, sharded=True
    )

    def __init__(self, sharded: Sharded):
        self.sh = sharded
        self.name = sharded.impl.name

    def _raw(self, rows: Side, old: torch.Tensor, col_pot: torch.Tensor, eps: float):
        if rows is self.sh.X:
            return self.sh.softmins(old, col_pot, eps, ("X",))[0]
        return self.sh.softmins(col_pot, old, eps, ("Y",))[0]

    def softmin(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
        t = self._raw(rows, old, col_pot, eps)
        return epilogue(old, t, alpha, beta), (t if want_raw else None)

    def symmetric_step(self, X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision,
                       phase="cold"):  # fmt: skip
        # the backend's fused plan sweep on this rank's block (_block.py), else a pair sweep
        out = _block.symmetric_step(self.sh, f, g, eps, alpha, beta_x, beta_y, want_raw, phase)
        if out is not None:
            return out
        tf, tg = self.sh.softmins(f, g, eps, ("X", "Y"))
        return epilogue(f, tf, alpha, beta_x), epilogue(g, tg, alpha, beta_y), tf, tg

    def half_step(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision,
                  phase="cold"):  # fmt: skip
        which = "X" if rows is self.sh.X else "Y"
        return _block.half_step(self.sh, which, col_pot, eps, old, alpha, beta, want_raw, phase)

    def self_step(self, X, f, eps, alpha, beta, want_raw, precision, phase="cold"):
        # one side against itself: the half-step of its rows with the same potential
        return _block.half_step(self.sh, "X", f, eps, f, alpha, beta, want_raw, phase)

    def reduce_error(self, err: torch.Tensor) -> torch.Tensor:
        return self.sh.global_error(err)

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.sh.global_error(t)
