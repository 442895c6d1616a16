"""Public HVP entry points: :class:`HessianOperator` (torch side) and :func:`hvp`.

The Hessian of OT_eps(x, y) w.r.t. one cloud (``wrt="x"`` or ``"y"``), or of the debiased
divergence S = OT(x, y) − ½ OT(x, x) − ½ OT(y, y), applied to directions of that cloud's shape.
The operator solves once (twice with ``debias=True``: OT(y, y) does not depend on x) and then
answers any number of products from the cached plans; see docs/hvp.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _validation as V
from .._convergence import report, reported_as, warn_unconverged
from ..engine import solve_points
from ..options import DEFAULT_CG_MAX_ITER, DEFAULT_CG_TOL, DEFAULT_TAU, HVPOptions, SinkhornOptions
from .cg import CGInfo
from .joint import TransportHessian

WRT = ("x", "y")


@dataclass
class HVPResult:
    """A Hessian–vector product and the diagnostics of the Schur solves behind it.

    Attributes:
        hvp: the product, same shape as the direction ``A``.
        cg_iters: CG iterations, summed over the solves (one per OT term: two with debias).
        residual: largest final *true* relative residual ‖rhs − S_τ w‖ / ‖rhs‖ over the solves
            and the batch (a Python float).
        converged: every CG solve reached ``cg_tol`` (the Sinkhorn solves behind the plan
            are reported by their own ``ConvergenceWarning``, and by
            ``HessianOperator.results``).
        info: the :class:`~flashsinkhorn.hvp.cg.CGInfo` of each solve.
    """

    hvp: torch.Tensor
    cg_iters: int
    residual: float
    converged: bool
    info: list[CGInfo] = field(default_factory=list)


class HessianOperator:
    """Torch-side Hessian of OT_eps (or of the debiased divergence) w.r.t. ``x`` or ``y``.

    The constructor runs the Sinkhorn solve(s); :meth:`matvec` / :meth:`apply` then reuse the
    cached plans (induced marginals, P y, Pᵀ x), so each product costs 2 K_CG + O(1) streaming
    transports. Directions have the shape of the differentiated cloud ((n, d) or (B, n, d)).

    Args:
        x: (n, d) or (B, n, d) source points.
        y: (m, d) or (B, m, d) target points.
        a: weights of x, default uniform.
        b: weights of y, default uniform.
        eps: entropic regularisation.
        wrt: "x" or "y", the cloud the Hessian is taken with respect to.
        debias: Hessian of S = OT(x, y) − ½ OT(x, x) − ½ OT(y, y) instead of OT(x, y).
        tau: relative Schur damping >= 0 (S + tau·diag(b̂)); 0 solves the singular system on
            the complement of the constant vector (exact Moore–Penrose HVP).
        cg_tol: true relative residual at which CG stops (default 1e-6).
        cg_max_iter: CG iteration cap (default 500).
        cg_check_every: CG iterations between two host-side tests (default 10).
        warm_start: start each Schur solve from the previous solution of the same term
            (helps when consecutive directions are close, e.g. inexact Newton refinements).
        **solver_options: forwarded to :func:`flashsinkhorn.sinkhorn` (n_iters, tol,
            schedule, scaling, backend, precision, ...; not rho_x/rho_y). Defaults here are
            ``n_iters=1000, tol=1e-6`` (tighter than sinkhorn's: the HVP differentiates
            the plan, so it is worth solving it well).

    Attributes:
        results: the :class:`~flashsinkhorn.SinkhornResult` of each solve (their
            ``converged``); a solve with a ``tol`` that stops at ``n_iters`` also warns
            (:class:`~flashsinkhorn.ConvergenceWarning`).

    Raises:
        ValueError, TypeError: invalid arguments, naming the argument.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
        *,
        eps: float,
        wrt: str = "x",
        debias: bool = False,
        tau: float = DEFAULT_TAU,
        cg_tol: float = DEFAULT_CG_TOL,
        cg_max_iter: int = DEFAULT_CG_MAX_ITER,
        cg_check_every: int = 10,
        warm_start: bool = False,
        **solver_options,
    ):
        V.check_choice("wrt", wrt, WRT)
        debias = V.check_bool("debias", debias)
        warm_start = V.check_bool("warm_start", warm_start)
        V.check_points("x", x)
        V.check_points("y", y)
        V.check_pair(x, y)
        for key in ("rho_x", "rho_y"):
            if solver_options.get(key) is not None:
                raise ValueError(f"{key}: HVPs are implemented for balanced OT only")
        from ..costs import check_default_cost

        check_default_cost(solver_options, "the HVP")
        if solver_options.get("path") == "multiscale":
            raise ValueError(
                "path: HVPs are not available on path='multiscale'; use 'auto' or 'streaming'"
            )
        hv = HVPOptions.build(tau=tau, cg_tol=cg_tol, cg_max_iter=cg_max_iter,
                              cg_check_every=cg_check_every)  # fmt: skip
        self.tau, self.cg_tol, self.cg_max_iter = hv.tau, hv.cg_tol, hv.cg_max_iter
        self.check_every = hv.cg_check_every
        opts = SinkhornOptions.build(x, y, **{"n_iters": 1000, "tol": 1e-6, **solver_options,
                                              "eps": eps})  # fmt: skip
        self.wrt = wrt
        self.warm_start = warm_start
        self.batched = x.dim() == 3
        own = x if wrt == "x" else y
        self.shape = tuple(own.shape)
        self.dtype = own.dtype
        self.device = own.device
        # (coefficient, cached plan, mode): "x"/"y" a one-sided block of OT(x, y); "both" the
        # sum of all blocks of a self-transport OT(z, z), the Hessian of z ↦ OT(z, z).
        res = solve_points(x, y, a, b, opts)
        self.results = [res]
        self.terms = [(1.0, TransportHessian(res), wrt)]
        if debias:
            z, w = (x, a) if wrt == "x" else (y, b)
            res_self = solve_points(z, z, w, w, opts.for_self_transport())
            self.results.append(res_self)
            self.terms.append((-0.5, TransportHessian(res_self), "both"))
        labels = ("OT(x, y)", f"OT({wrt}, {wrt})")
        reports = [report(lab, r) for lab, r in zip(labels, self.results, strict=False)]
        warn_unconverged("HessianOperator", reports, opts.n_iters, opts.tol)
        self._w0: list[torch.Tensor | None] = [None] * len(self.terms)
        self.last: HVPResult | None = None
        self.n_matvec = 0

    def _check_direction(self, A: object) -> torch.Tensor:
        if not isinstance(A, torch.Tensor) or not A.is_floating_point():
            raise TypeError(f"A must be a real floating torch.Tensor, got {type(A).__name__}")
        if tuple(A.shape) != self.shape:
            raise ValueError(
                f"A must have the shape of {self.wrt} {self.shape}, got {tuple(A.shape)}"
            )
        if A.device != self.device:
            raise ValueError(f"A must be on {self.device}, got {A.device}")
        return A if self.batched else A.unsqueeze(0)

    def apply(self, A: torch.Tensor) -> HVPResult:
        """Hessian times ``A`` (shape of the differentiated cloud), with diagnostics."""
        Ab = self._check_direction(A).detach()
        total = None
        infos = []
        opts = dict(
            tau=self.tau, cg_tol=self.cg_tol, cg_max_iter=self.cg_max_iter,
            check_every=self.check_every,
        )  # fmt: skip
        for k, (coef, op, mode) in enumerate(self.terms):
            w0 = self._w0[k] if self.warm_start else None
            if mode == "x":
                H, _, info, v = op.apply(Ab, None, want_y=False, w0=w0, **opts)
            elif mode == "y":
                _, H, info, v = op.apply(None, Ab, want_x=False, w0=w0, **opts)
            else:
                Hx, Hy, info, v = op.apply(Ab, Ab, w0=w0, **opts)
                H = Hx + Hy
            self._w0[k] = v
            infos.append(info)
            total = coef * H if total is None else total + coef * H
        out = total if self.batched else total[0]
        result = HVPResult(
            hvp=out.to(self.dtype),
            cg_iters=sum(i.iters for i in infos),
            residual=max(float(i.residual.max()) for i in infos),
            converged=all(i.converged for i in infos),
            info=infos,
        )
        self.last = result
        self.n_matvec += 1
        return result

    def matvec(self, A: torch.Tensor) -> torch.Tensor:
        """Hessian times ``A``; diagnostics of the call are in :attr:`last`."""
        return self.apply(A).hvp

    __matmul__ = matvec

    def dense(self) -> torch.Tensor:
        """The full (n·d, n·d) Hessian by n·d products (small problems and tests only)."""
        if self.batched:
            raise ValueError("dense() is for unbatched problems")
        N = self.shape[0] * self.shape[1]
        eye = torch.eye(N, dtype=self.dtype, device=self.device)
        cols = [self.matvec(eye[k].reshape(self.shape)).reshape(-1) for k in range(N)]
        return torch.stack(cols, 1)


def hvp(
    x: torch.Tensor,
    y: torch.Tensor,
    A: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    wrt: str = "x",
    debias: bool = False,
    tau: float = DEFAULT_TAU,
    cg_tol: float = DEFAULT_CG_TOL,
    cg_max_iter: int = DEFAULT_CG_MAX_ITER,
    cg_check_every: int = 10,
    **solver_options,
) -> HVPResult:
    r"""Hessian of OT_eps(x, y) (or of the debiased divergence) w.r.t. ``x`` or ``y`` times A.

    $(\nabla_x^2\, \mathrm{OT}_\varepsilon)\, A$ for ``wrt="x"``, with
    $\nabla_x \mathrm{OT}_\varepsilon = 2\,(\mathrm{diag}(P\mathbf{1})\, x - P y)$.

    Streaming (Theorem 5 / Appendix F of the FlashSinkhorn paper): an explicit term from P y,
    row-wise products and one Hadamard-weighted transport, and an implicit term from the
    Schur-complement system solved by CG on transport–vector products; the plan's induced
    marginals (paper G.1) make it the exact Hessian of the plan actually computed. Memory
    O((n + m) d). For many products at one point build a :class:`HessianOperator` once.

    Args:
        x: (n, d) or (B, n, d) source points.
        y: (m, d) or (B, m, d) target points.
        A: direction, shape of ``x`` (``wrt="x"``) or of ``y`` (``wrt="y"``).
        a: weights of x, (n,) or (B, n); default uniform.
        b: weights of y, (m,) or (B, m); default uniform.
        eps: entropic regularisation (cost C_ij = ‖x_i − y_j‖²).
        wrt: "x" or "y".
        debias: differentiate S = OT(x, y) − ½ OT(x, x) − ½ OT(y, y) instead.
        tau: relative Schur damping >= 0; 0 is the undamped (Moore–Penrose) product.
        cg_tol: true relative residual at which CG stops.
        cg_max_iter: CG iteration cap.
        cg_check_every: CG iterations between host-side convergence tests.
        **solver_options: forwarded to :func:`flashsinkhorn.sinkhorn` (``n_iters``, ``tol``,
            ``schedule``, ``scaling``, ``backend``, ``precision``, ...).

    Returns:
        An :class:`HVPResult`: ``.hvp`` (shape of A, dtype of the points), ``.cg_iters``,
        ``.residual`` (true relative residual), ``.converged``, ``.info``.

    Raises:
        ValueError, TypeError: invalid arguments (shape of A, wrt, tau < 0, ...), naming them.

    Examples:
        >>> import torch
        >>> import flashsinkhorn as fs
        >>> x, y = torch.rand(50, 3), torch.rand(60, 3)
        >>> A = torch.randn(50, 3)                        # a direction, shape of x
        >>> res = fs.hvp(x, y, A, eps=0.5)                # ∇²ₓ OT_eps · A
        >>> res.hvp.shape, res.converged
        (torch.Size([50, 3]), True)
    """
    V.check_choice("wrt", wrt, WRT)
    own = x if wrt == "x" else y
    if isinstance(A, torch.Tensor) and isinstance(own, torch.Tensor) and A.shape != own.shape:
        raise ValueError(f"A must have the shape of {wrt} {tuple(own.shape)}, got {tuple(A.shape)}")
    with reported_as("hvp"):
        op = HessianOperator(
            x, y, a, b, eps=eps, wrt=wrt, debias=debias, tau=tau, cg_tol=cg_tol,
            cg_max_iter=cg_max_iter, cg_check_every=cg_check_every, **solver_options,
        )  # fmt: skip
    return op.apply(A)
