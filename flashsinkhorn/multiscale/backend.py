"""The block-sparse backend of the multiscale path.

It implements the :class:`~flashsinkhorn.backends.base.Backend` primitives (soft-min,
transport, envelope gradient) on the caller's point order, so the solver loop, the result
object and the autograd functions run unchanged on it. Inside, each side is sorted along a
Morton curve and cut into tiles (clustering.py); a soft-min visits only the tile pairs of a
:class:`~.bounds.Pattern` and its cost is O(n · visited neighbours).

The pattern of the solve is rebuilt from the current potentials when eps changes and when a
convergence test finds that the potentials have moved so far that the bound of the skipped
mass exceeds its budget (a pattern is built to half of it, :data:`BUILD_FRACTION`). Each
soft-min that may feed a test (``want_raw``) records its patterns and potentials;
:meth:`MultiscaleBackend.bound_error`, called by a test, evaluates that bound for the tested
plan and adds it to the measured error, so the error the loop tests (and ``marginal_error``
reports) bounds that of the *untruncated* plan:

    ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ <= measured error of the visited plan + U_now + U_prev,

U the bound of the mass outside a pattern (bounds.py) for the pattern of this soft-min and of
the previous one (the "exact" marginal of the schedule was computed with that one). Both are
replaced by their maximum, counted twice. Derivation: docs/multiscale.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..backends.base import Backend, Capabilities
from ..problem import Problem, Side
from . import sparse_torch
from .bounds import Pattern, build_pattern
from .clustering import TILE, Layout, build_layout

#: Fraction of ``tol`` that the skipped mass may take: the budget of the skipped bound U is
#: TRUNCATION_FRACTION · tol / 2 (the error bound counts 2 U). Each halving of the budget
#: moves the skipping threshold by at most ln 2 nats: 2.4 % more pairs on 1M-point surfaces
#: (7.40M to 7.58M), while the bound the tests add to the measured error shrinks with it;
#: at 0.1 it was a tenth of tol and kept the 1M-point mixture onto shell 10 iterations
#: longer above tol.
TRUNCATION_FRACTION = 0.025
#: The tolerance the truncation budget is a fraction of when ``tol`` is None (fixed
#: iterations): a mass error of 1e-6.
UNTESTED_TOL = 4e-5
#: Share of the budget a new pattern's skipped bound may fill. The rest is room for the
#: potentials to move before the pattern is stale: a pattern built to the full budget goes
#: stale at almost every test (1M-point mixture onto shell, tests every 2 iterations: 83
#: patterns and 166 iterations instead of 36).
BUILD_FRACTION = 0.5
#: A pattern is also rebuilt at a test whose measured error is REBUILD_DROP times below the
#: first test's on that pattern (None: never): potentials nearer convergence give tighter
#: bounds (1M-point surfaces: 7.9M pairs instead of 9.9M for the last iterations).
REBUILD_DROP: float | None = 4.0


@dataclass
class MultiscaleState:
    """Everything one multiscale solve changes as it runs, in one object owned by that solve
    (the :class:`MultiscaleBackend` bound to its problem): the soft-mins update the pattern
    fields, the convergence tests the staleness, and :func:`~.solver.solve_multiscale`
    records its coarse stage here. Nothing else holds state between two soft-mins."""

    #: the solve's current pattern, and the one the previous soft-min used
    pattern: Pattern | None = None
    last: Pattern | None = None
    #: (pattern, previous pattern, layouts, sorted potentials, eps) of the soft-min a
    #: convergence test reads, evaluated by ``bound_error``
    pending: tuple | None = None
    #: the skipped-mass bound exceeded its budget at the last test: rebuild at the next step
    stale: bool = False
    #: the first measured error on the current pattern (REBUILD_DROP)
    first_err: tuple[Pattern, float] | None = None
    #: patterns built by the solve
    rebuilds: int = 0
    #: iterations of the coarse solve and its last eps (None before the coarse stage ran)
    coarse_iters: int | None = None
    eps_coarse: float | None = None
    #: Morton layouts by point tensor (id -> (tensor, layout)), built once per side
    layouts: dict[int, tuple[torch.Tensor, Layout]] = field(default_factory=dict)


class MultiscaleBackend(Backend):
    """Block-sparse soft-mins over Morton tiles (torch operations, or the Triton kernel for
    float32 on a backend with compiled kernels).

    The backend is bound to one problem: its :attr:`state` (:class:`MultiscaleState`) is the
    state of that problem's solve. The two sides of the problem are told apart from other
    sides (the lift's centroids, a gradient's self transport) by their point tensors.

    Args:
        base: the dense backend of this device and dtype (runs the coarse solve and the lift).
        problem: the problem of the solve (its sides' layouts are built here).
        tol: the solve's tolerance (None: :data:`UNTESTED_TOL`), which sets the budget of
            the skipped mass.
    """

    path = "multiscale"

    def __init__(self, base: Backend, problem: Problem, tol: float | None):
        self.base = base
        self.name = base.name
        self.problem = problem
        kernels = base.capabilities.kernels
        self.capabilities = Capabilities(
            transports=True, second_order=False, graph_safe=False, kernels=kernels,
            strategy="multiscale",
        )  # fmt: skip
        self.kernel = kernels and problem.dtype == torch.float32
        # the pattern search is float64 whatever the problem's dtype
        self.search_kernel = kernels
        self.budget = 0.5 * TRUNCATION_FRACTION * (UNTESTED_TOL if tol is None else tol)
        self.state = MultiscaleState()

    # ----- layouts and patterns -----

    def layout(self, side: Side) -> Layout:
        """The Morton layout of a side, built once per point tensor."""
        key = id(side.x)
        got = self.state.layouts.get(key)
        if got is not None and got[0] is side.x:
            return got[1]
        lay = build_layout(side.x, side.w, side.sq.dtype)
        self.state.layouts[key] = (side.x, lay)
        return lay

    def _orientation(self, rows: Side, cols: Side) -> str | None:
        """ "xy" or "yx" for the solve's two sides (by their point tensors), else None."""
        X, Y = self.problem.X, self.problem.Y
        if rows.x is X.x and cols.x is Y.x:
            return "xy"
        if rows.x is Y.x and cols.x is X.x:
            return "yx"
        return None

    def _build(self, lx, ly, f, g, eps, self_problem) -> Pattern:
        self.state.rebuilds += 1
        return build_pattern(
            lx, ly, f, g, eps, BUILD_FRACTION * self.budget, self_problem, self.search_kernel
        )

    def _solve_pattern(self, lx, ly, f, g, eps) -> Pattern:
        """The solve's pattern at ``eps``, rebuilt at (f, g) when eps changed or it is stale."""
        st = self.state
        p = st.pattern
        if p is None or p.eps != eps or st.stale:
            p = st.pattern = self._build(lx, ly, f, g, eps, self.problem.X is self.problem.Y)
            st.stale = False
        return p

    # ----- the primitives -----

    def softmin(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
        lr, lc = self.layout(rows), self.layout(cols)
        cs = lc.sort(col_pot)
        orient = self._orientation(rows, cols)
        if orient is None:
            # a side the solve does not know: a pattern of its own, for these potentials
            pat = self._build(lr, lc, lr.sort(old), cs, eps, rows.x is cols.x)
            orient = "xy"
        else:
            st = self.state
            pat = st.pattern
            # the row potential in sorted order is needed for a rebuild and for the bound
            if want_raw or pat is None or pat.eps != eps or st.stale:
                rs = lr.sort(old)
                lx, ly = (lr, lc) if orient == "xy" else (lc, lr)
                f, g = (rs, cs) if orient == "xy" else (cs, rs)
                pat = self._solve_pattern(lx, ly, f, g, eps)
                if want_raw:
                    # evaluated by bound_error, only for the soft-min a test reads
                    last = st.last if st.last is not None else pat
                    st.pending = (pat, last, lx, ly, f, g, eps)
            st.last = pat
        shift = None
        if self.kernel and beta > 0.0:
            # at a fixed point old = alpha·old + beta·T, so the row's log-sum-exp is expected
            # near −T/eps with T = (1 − alpha)·old/beta (the kernel checks and recomputes the
            # rows where this estimate was too far off); a padding row repeats a point and
            # takes that point's estimate
            shift = lr.sort(old, fill=None) * (-(1.0 - alpha) / (beta * eps))
        lse, _ = self._lse(lr, lc, cs, eps, pat.csr[orient], shift=shift)
        T = lr.unsort(-eps * lse)
        out = beta * T if alpha == 0.0 else alpha * old + beta * T
        return out, (T if want_raw else None)

    def bound_error(self, err: torch.Tensor) -> torch.Tensor:
        """The measured error of the visited plan plus the recorded bound of the skipped mass;
        marks the pattern stale when that bound exceeds its budget (one synchronisation, at
        a convergence test)."""
        st = self.state
        if st.pending is None:
            return err
        pat, last, lx, ly, f, g, eps = st.pending
        st.pending = None
        u_now = pat.skipped_bound(lx, ly, f, g, eps)
        u_last = u_now if last is pat else last.skipped_bound(lx, ly, f, g, eps)
        # one synchronisation for both
        stale, worst = torch.stack(
            [(u_now > self.budget).any().double(), err.max().double()]
        ).tolist()
        st.stale = stale > 0
        if REBUILD_DROP is not None:
            seen = st.first_err
            if seen is None or seen[0] is not pat:
                st.first_err = (pat, worst)
            elif worst * REBUILD_DROP <= seen[1]:
                st.stale = True
        return err + 2.0 * torch.maximum(u_now, u_last).to(err.dtype)

    def _lse(
        self, lr: Layout, lc: Layout, cs, eps, csr, bary: bool = False, values=None, shift=None
    ):
        """((B, N_r) log-sum-exp over the visited tiles (sorted rows), barycentres or value
        sums (B, N_r, p) when asked, else None). shift: (B, N_r) an estimate of the result
        (the kernel's fast path; ignored by the torch path)."""
        B = lr.B
        hc = cs / eps + lc.logw  # (B, N_c), −inf on padding
        rowptr, cols = csr
        xr, xc = lr.x.reshape(-1, 3), lc.x.reshape(-1, 3)
        if self.kernel and values is None:
            from ..backends.triton.sparse import sparse_lse

            sh = None if shift is None else shift.reshape(-1)
            lse, out = sparse_lse(xr, xc, hc.reshape(-1), rowptr, cols, eps, bary, TILE, shift=sh)
        else:
            vals = xc if bary else values
            lse, out = sparse_torch.sparse_lse(xr, xc, hc.reshape(-1), rowptr, cols, eps, vals)
        lse = lse.reshape(B, -1).to(cs.dtype)
        return lse, (None if out is None else out.reshape(B, lr.N, -1))

    def _plan(self, rows, cols, row_pot, col_pot, eps):
        """Layouts, sorted potentials and the (rowptr, cols) CSR of a pattern of the plan
        (row_pot, col_pot) with its rows' tiles as keys: the solve's pattern when its bound of
        the skipped mass at these potentials is within the budget (the gradient after a
        converged solve: no rebuild, and no second pattern in memory), else a new one."""
        lr, lc = self.layout(rows), self.layout(cols)
        rs, cs = lr.sort(row_pot), lc.sort(col_pot)
        orient = self._orientation(rows, cols)
        pat = self.state.pattern
        if orient is not None and pat is not None and pat.eps == eps:
            lx, ly = (lr, lc) if orient == "xy" else (lc, lr)
            f, g = (rs, cs) if orient == "xy" else (cs, rs)
            if bool((pat.skipped_bound(lx, ly, f, g, eps) <= self.budget).all()):
                return lr, lc, rs, cs, pat.csr[orient]
        pat = self._build(lr, lc, rs, cs, eps, rows.x is cols.x)
        return lr, lc, rs, cs, pat.csr["xy"]

    def transport_grad(self, rows, cols, row_pot, col_pot, eps, precision):
        """(2 (diag(â) x − P y), â) on the plan restricted to a pattern whose skipped mass at
        these potentials is below the budget (:meth:`_plan`)."""
        lr, lc, rs, cs, csr = self._plan(rows, cols, row_pot, col_pot, eps)
        lse, bary = self._lse(lr, lc, cs, eps, csr, bary=True)
        marg = torch.exp(rs / eps + lr.logw + lse)  # â_i = a_i exp(f_i/eps + L_i)
        marg = torch.nan_to_num(marg, nan=0.0)
        d = rows.x.shape[-1]
        x = lr.x[..., :d]
        grad = 2.0 * marg[..., None] * (x - bary[..., :d].to(x.dtype))
        return lr.unsort(grad).to(rows.sq.dtype), lr.unsort(marg)

    def plan_argmax(self, rows, cols, col_pot, eps, precision, idx=None, seed=None):
        """Every column of a visited row, swept by the base backend (the pattern's truncation
        is for sums; an argmax or a draw of the untruncated plan costs one sweep)."""
        return self.base.plan_argmax(rows, cols, col_pot, eps, precision, idx, seed)

    def transport(self, rows, cols, row_pot, col_pot, eps, V, A, Bw, precision):
        """(P ∘ A Bwᵀ) V and P 1 on the plan restricted to a pattern whose skipped mass at these
        potentials is below the budget (torch operations)."""
        lr, lc, rs, cs, csr = self._plan(rows, cols, row_pot, col_pot, eps)
        dtype = rows.sq.dtype
        vals = None
        if V is not None:
            vals = lc.sort(V.to(dtype))
            if A is not None:
                # Σ_j P_ij (A_i · Bw_j) V_j = Σ_r A_ir Σ_j P_ij Bw_jr V_j
                bw = lc.sort(Bw.to(dtype))
                vals = (bw[..., :, None] * vals[..., None, :]).reshape(lr.B, lc.N, -1)
            vals = vals.reshape(-1, vals.shape[-1])
        hc = cs / eps + lc.logw
        rowptr, cidx = csr
        xr, xc = lr.x.reshape(-1, 3), lc.x.reshape(-1, 3)
        lse, out = sparse_torch.sparse_lse(xr, xc, hc.reshape(-1), rowptr, cidx, eps, vals)
        lse = lse.reshape(lr.B, -1)
        marg = torch.nan_to_num(torch.exp(rs / eps + lr.logw + lse), nan=0.0)
        res = None
        if out is not None:
            out = out.reshape(lr.B, lr.N, -1) * marg[..., None]
            if A is not None:
                r = A.shape[-1]
                out = (lr.sort(A.to(dtype))[..., :, None] * out.reshape(lr.B, lr.N, r, -1)).sum(2)
            res = lr.unsort(out)
        return res, lr.unsort(marg)
