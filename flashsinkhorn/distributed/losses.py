"""Differentiable sharded losses: :func:`ot_cost` and :func:`sinkhorn_divergence`.

Convention: the returned value is the global loss, identical on every rank. Call
``backward()`` on every rank (the backward is a collective): each rank then receives the
gradient of that one global loss with respect to its own shards, which is the slice of the
single-process gradient. Nothing is summed or averaged over ranks in the backward, so summing
the per-rank losses, or averaging gradients over ranks, would count the loss ``world`` times.

As in the single-process losses, a solve with a tolerance that stops at ``n_iters`` warns
(:class:`~flashsinkhorn.ConvergenceWarning`, once per call, on every rank: the convergence
facts are global, so a filter that turns the warning into an exception stops every rank
alike), and gradients below the float32 plan floor raise (``limits.check_plan``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _validation as V
from .. import limits
from .._convergence import SolveReport, report, warn_unconverged
from ..autograd.guard import guard_second_order
from ..autograd.ot_cost import relaxed_weight_grad
from ..option_table import document_options
from ..options import public_options
from ._checks import SHARDED_DOCS
from ._comm import require_group
from ._engine import Sharded
from .solver import _run


def _agreed_needs(sh: Sharded, need: list[bool]) -> list[bool]:
    """The gradients some rank needs (one all-reduce): the backward sweeps are collectives,
    so every rank must run the same ones even where its own shards need none."""
    t = torch.tensor([float(v) for v in need], dtype=torch.float32, device=sh.comm.device)
    return [v > 0 for v in sh.comm.all_reduce(t, dist.ReduceOp.MAX).tolist()]


def _point_ops(sh: Sharded, need: list[bool]) -> dict[str, set[str]]:
    """The sweep of the gradients of OT(x, y): point gradients, and for a problem with a KL
    side the soft-mins of the weight gradients."""
    balanced = sh.X.rho is None and sh.Y.rho is None
    ops = {"X": set(), "Y": set()}
    for k, side in ((0, "X"), (1, "Y")):
        if need[k]:
            ops[side].add("grad")
        if not balanced and need[2 + k]:
            ops[side].add("softmin")
    return {k: v for k, v in ops.items() if v}


class _DistOTCost(torch.autograd.Function):
    """``apply(x_local, y_local, a_local, b_local, solved)`` → global OT_eps (0-d).

    ``solved``: ``(sharded problem, SolveOutput, value)`` of the finished sharded solve of
    these shards (run outside this function)."""

    @staticmethod
    def forward(ctx, x, y, a, b, solved):
        sh, out, value = solved
        ctx.sh, ctx.out = sh, out
        ctx.save_for_backward(x, y, a, b)
        return value[0].clone()

    @staticmethod
    def backward(ctx, grad_out):
        x, y, a, b = ctx.saved_tensors
        sh: Sharded = ctx.sh
        out = ctx.out
        limits.check_plan(sh.problem, out.eps, "gradients")
        need = list(ctx.needs_input_grad[:4])
        need[2] = need[2] and a is not None
        need[3] = need[3] and b is not None
        ops = _point_ops(sh, _agreed_needs(sh, need))
        grads = [None] * 4
        with torch.no_grad():
            go = grad_out.reshape(()).to(sh.pdtype)
            res = sh.sweep(out.f, out.g, out.eps, ops) if ops else {}
            for k, side, t in ((0, "X", x), (1, "Y", y)):
                if need[k]:
                    grads[k] = (res[side]["grad"][0] * go).to(t.dtype)
            for k, side, w in ((2, "X", a), (3, "Y", b)):
                if need[k]:
                    pot = out.f if side == "X" else out.g
                    raw = res.get(side, {}).get("softmin")
                    gw = _weight_grad(sh, side, pot, raw, out.eps) * go
                    grads[k] = gw.reshape(w.shape).to(w.dtype)
        gx, gy, ga, gb = guard_second_order(tuple(grads), (x, y, a, b))
        return gx, gy, ga, gb, None


def _weight_grad(sh: Sharded, side: str, pot, raw, eps: float) -> torch.Tensor:
    """(n_local,) gradient of the dual value w.r.t. this rank's weights of one side.

    Balanced: the potential (GeomLoss convention). With a KL side: the partial derivative of
    the dual objective (``autograd.ot_cost.relaxed_weight_grad``), with the global mass of
    the other side.
    """
    if sh.X.rho is None and sh.Y.rho is None:
        return pot[0]
    R = sh.X if side == "X" else sh.Y
    other = sh.mass_y if side == "X" else sh.mass_x
    return relaxed_weight_grad(R, pot, raw, eps, other.total)[0]


def _options(group, mode, **kw) -> dict:
    return dict(group=group, mode=mode, compute_error=False, **kw)


@document_options(**SHARDED_DOCS)
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

    A collective, in the forward and in the backward (both modes: the ranks agree on the
    gradients needed, then sweep): call it, and ``backward``, on every rank. Problem and
    options as in :func:`flashsinkhorn.distributed.sinkhorn`.
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
        group, mode: as in :func:`flashsinkhorn.distributed.sinkhorn`.
        {options}

    Returns:
        A 0-d tensor, the global value, identical on every rank (float32, or float64 for
        float64 points). Its gradient w.r.t. each local input is the slice of the
        single-process gradient: do not sum it over ranks.

    Warns (:class:`~flashsinkhorn.ConvergenceWarning`) once, on every rank, when the solve has
    a ``tol`` and stops at ``n_iters``.

    Raises:
        RuntimeError: when no process group is initialised, or on a second derivative.
        ValueError, TypeError: for invalid arguments, on every rank; below the float32 plan
            floor, by ``backward()``, on every rank.
    """
    options = _options(group, mode, **public_options(locals()))
    solved = _run(x_local, y_local, a_local, b_local, **options)
    reports = [report("OT(x, y)", solved[1])]
    value = _DistOTCost.apply(x_local, y_local, a_local, b_local, solved)
    warn_unconverged("flashsinkhorn.distributed.ot_cost", reports, n_iters, tol)
    return value


def _divergence_terms(x, y, a, b, options, reports):
    """``(terms, S)``: the three solves of the divergence and its (1,) value. One sharded
    problem serves them, as ``engine.solve_divergence`` does: OT(x, y) on it, OT(x, x) and
    OT(y, y) on its self views (the same centring, operand scale, eps ladder and large-eps
    threshold; one potential, one soft-min per iteration). How each solve ended is appended
    to ``reports``."""
    options = dict(options)
    group = options.pop("group")
    rho = (options["rho_x"], options["rho_y"])
    sh = Sharded(x, y, a, b, group=group, extra_check=lambda: V.check_divergence_rho(*rho),
                 **options)  # fmt: skip
    # global statistics: every rank raises alike
    limits.check_divergence(sh.problem, sh.opts.eps, sh.opts.tol)
    terms = []
    with torch.no_grad():
        for label, prob in (
            ("OT(x, y)", sh), ("OT(x, x)", sh.self_view("X")), ("OT(y, y)", sh.self_view("Y"))
        ):  # fmt: skip
            out = prob.solve(False)
            reports.append(report(label, out))
            terms.append((prob, out, prob.value(out.f, out.g, out.eps)))
        div = terms[0][2] - 0.5 * (terms[1][2] + terms[2][2])
        if sh.X.rho is not None:
            # the unbalanced debiasing term eps/2 (m_a − m_b)² of losses.divergence_points
            div = div + 0.5 * sh.opts.eps * (sh.mass_x.nominal - sh.mass_y.nominal) ** 2
    return terms, div


class _DistDivergence(torch.autograd.Function):
    """``apply(x_local, y_local, a_local, b_local, terms, div)`` → global S_eps (0-d), from
    the finished solves ``terms`` and value ``div`` of :func:`_divergence_terms` (run outside
    this function)."""

    @staticmethod
    def forward(ctx, x, y, a, b, terms, div):
        ctx.terms = terms
        ctx.save_for_backward(x, y, a, b)
        return div[0].clone()

    @staticmethod
    def backward(ctx, grad_out):
        x, y, a, b = ctx.saved_tensors
        (sh, xy, _), (sx, xx, _), (sy, yy, _) = ctx.terms
        eps = xy.eps
        limits.check_plan(sh.problem, eps, "gradients")
        need = list(ctx.needs_input_grad[:4])
        need[2] = need[2] and a is not None
        need[3] = need[3] and b is not None
        agreed = _agreed_needs(sh, need)
        relaxed = sh.X.rho is not None
        grads = [None] * 4
        with torch.no_grad():
            go = grad_out.reshape(()).to(sh.pdtype)
            res = sh.sweep(xy.f, xy.g, eps, _point_ops(sh, agreed)) if any(agreed) else {}
            selfs = []
            for k, (view, out) in enumerate(((sx, xx), (sy, yy))):
                ops = {"grad"} if agreed[k] else set()
                if relaxed and agreed[2 + k]:
                    ops.add("softmin")
                r = view.sweep(out.f, out.f, eps, {"X": ops})["X"] if ops else {}
                selfs.append(r)
            for k, side, t in ((0, "X", x), (1, "Y", y)):
                if need[k]:
                    G = res[side]["grad"] - selfs[k]["grad"]
                    grads[k] = (G[0] * go).to(t.dtype)
            for k, side, w, view, out in ((2, "X", a, sx, xx), (3, "Y", b, sy, yy)):
                if not need[k]:
                    continue
                pot = xy.f if side == "X" else xy.g
                gw = _weight_grad(sh, side, pot, res.get(side, {}).get("softmin"), eps)
                gw = gw - _weight_grad(view, "X", out.f, selfs[k - 2].get("softmin"), eps)
                if relaxed:
                    # d/dm of eps/2 (m_a − m_b)²
                    sign = 1.0 if side == "X" else -1.0
                    gw = gw + sign * eps * (sh.mass_x.nominal - sh.mass_y.nominal)
                grads[k] = (gw * go).reshape(w.shape).to(w.dtype)
        gx, gy, ga, gb = guard_second_order(tuple(grads), (x, y, a, b))
        return gx, gy, ga, gb, None, None


@document_options(**SHARDED_DOCS)
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

    The semantics of :func:`flashsinkhorn.sinkhorn_divergence`: one sharded problem serves the
    three solves (the self terms are one-potential solves of its sides, with its centring,
    operand scale and eps ladder; with ``scaling`` all three anneal from the diameter of the
    global bounding box of both clouds); KL-relaxed marginals, with ``rho_x == rho_y``, add
    the debiasing term eps/2 (m_a − m_b)² with global masses. A collective, forward and
    backward; same gradient convention as :func:`ot_cost`. Warns
    (:class:`~flashsinkhorn.ConvergenceWarning`) once, on every rank, when a solve with a
    ``tol`` stops at ``n_iters``.

    Args:
        x_local, y_local, a_local, b_local: this rank's shards, as in :func:`ot_cost`.
        group, mode: as in :func:`flashsinkhorn.distributed.sinkhorn`.
        {options}

    Returns:
        A 0-d tensor, identical on every rank, differentiable w.r.t. the local shards.

    Raises:
        RuntimeError: when no process group is initialised, or on a second derivative.
        ValueError, TypeError: for invalid arguments (``rho_x != rho_y`` included) on every
            rank; below the float32 plan floor, by ``backward()``, on every rank.
    """
    require_group(group)
    options = _options(group, mode, **public_options(locals()))
    reports: list[SolveReport] = []
    terms, div = _divergence_terms(x_local, y_local, a_local, b_local, options, reports)
    value = _DistDivergence.apply(x_local, y_local, a_local, b_local, terms, div)
    where = "flashsinkhorn.distributed.sinkhorn_divergence"
    warn_unconverged(where, reports, n_iters, tol)
    return value
