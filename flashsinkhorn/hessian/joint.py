"""The joint Hessian of OT_eps(x, y) applied to a direction (A_x, A_y), from one solve.

Notation (docs/hvp.md): P the plan of the computed potentials, â = P1, b̂ = Pᵀ1 its induced
marginals, D_ij = x_i − y_j, E_ij = A_x,i − A_y,j, s_ij = D_ij·E_ij, p_i = x_i·A_x,i,
q_j = y_j·A_y,j. The gradient is G_x,i = 2 Σ_j P_ij D_ij and, since
dP_ij = P_ij (u_i + v_j − 2 s_ij) / eps with (u, v) the potential derivatives,

    dG_x,i = 2 Σ_j P_ij E_ij + (2/eps) Σ_j P_ij (u_i + v_j − 2 s_ij) D_ij.

(u, v) solve the linearised marginal constraints [[diag â, P], [Pᵀ, diag b̂]] (u; v) = (r₁; r₂)
with r₁ = 2 Σ_j P_ij s_ij, r₂ = 2 Σ_i P_ij s_ij; eliminating u leaves the Schur system
(diag b̂ − Pᵀ diag(â)⁻¹ P) v = r₂ − Pᵀ(r₁/â), solved by CG with streaming matvecs. Every sum
above expands into transports P V of a few stacked columns and one Hadamard-weighted transport
(P ∘ [X, A_x][A_y, Y]ᵀ) Y; the y side is the same with the roles exchanged. Nothing n × m is
ever stored: memory is O((n + m) d).
"""

from __future__ import annotations

import torch

from .. import limits
from ..result import SinkhornResult
from .cg import CGInfo, cg_solve


def _rowdot(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (u * v).sum(-1)


def _inv(t: torch.Tensor) -> torch.Tensor:
    """1 / t where t > 0, else 0 (a point with no induced mass carries no constraint)."""
    return torch.where(t > 0, 1.0 / torch.where(t > 0, t, torch.ones_like(t)), torch.zeros_like(t))


class TransportHessian:
    """Cached plan of one balanced solve, applying the joint Hessian of OT_eps in (x, y).

    Built once per solve; every :meth:`apply` reuses the induced marginals and the barycentric
    products P y, Pᵀ x (computed on first need), so repeated matvecs (Lanczos, Newton-CG) cost
    2 K_CG + O(1) streaming transports each. Works on the batched (B, n, d) internal form.

    Args:
        res: a :class:`~flashsinkhorn.SinkhornResult` of a balanced problem (no rho).

    Raises:
        ValueError: for an unbalanced problem (rho_x or rho_y set).
    """

    def __init__(self, res: SinkhornResult):
        problem = res.solution.problem
        if problem.X.rho is not None or problem.Y.rho is not None:
            raise ValueError(
                "rho_x/rho_y: Hessian-vector products are implemented for balanced OT only"
            )
        limits.check_plan(problem, res.eps, "Hessian-vector products")
        self.res = res
        self.problem = problem
        self.impl = res.solution.backend
        self.eps = float(res.eps)
        self.dtype = problem.dtype
        self.x = problem.X.x.to(self.dtype)
        self.y = problem.Y.x.to(self.dtype)
        self._Py = self._PtX = None
        with torch.no_grad():
            _, self.am = self._transport(False, None)
            _, self.bm = self._transport(True, None)
        self.am_inv, self.bm_inv = _inv(self.am), _inv(self.bm)

    # ----- streaming primitives -----

    def _transport(self, transpose, V, A=None, Bw=None):
        pr = self.problem
        R, C, fr, fc = (pr.Y, pr.X, self.res.solution.g, self.res.solution.f) if transpose else (
            pr.X, pr.Y, self.res.solution.f, self.res.solution.g)  # fmt: skip
        return self.impl.transport(R, C, fr, fc, self.eps, V, A, Bw, pr.precision)

    def P(self, V: torch.Tensor) -> torch.Tensor:
        """P V for V (B, m, k)."""
        return self._transport(False, V.contiguous())[0]

    def Pt(self, U: torch.Tensor) -> torch.Tensor:
        """Pᵀ U for U (B, n, k)."""
        return self._transport(True, U.contiguous())[0]

    @property
    def Py(self) -> torch.Tensor:
        if self._Py is None:
            self._Py = self.P(self.y)
        return self._Py

    @property
    def PtX(self) -> torch.Tensor:
        if self._PtX is None:
            self._PtX = self.Pt(self.x)
        return self._PtX

    def schur(self, v: torch.Tensor, tau: float) -> torch.Tensor:
        """(S + tau diag b̂) v with S = diag b̂ − Pᵀ diag(â)⁻¹ P; v (B, m)."""
        Pv = self.P(v[..., None])[..., 0]
        return (1.0 + tau) * self.bm * v - self.Pt((Pv * self.am_inv)[..., None])[..., 0]

    # ----- the HVP -----

    @torch.no_grad()
    def apply(
        self,
        Ax: torch.Tensor | None,
        Ay: torch.Tensor | None,
        *,
        want_x: bool = True,
        want_y: bool = True,
        tau: float = 1e-5,
        cg_tol: float = 1e-6,
        cg_max_iter: int = 500,
        check_every: int = 10,
        w0: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, CGInfo, torch.Tensor]:
        """Joint Hessian times (Ax, Ay).

        Args:
            Ax: (B, n, d) direction on x, or None for zero.
            Ay: (B, m, d) direction on y, or None for zero.
            want_x: return the x block of the product.
            want_y: return the y block of the product.
            tau: relative Schur damping (S + tau diag b̂); 0 solves on the complement of ones.
            cg_tol: true relative residual at which CG stops.
            cg_max_iter: CG iteration cap.
            check_every: CG iterations between host-side convergence tests.
            w0: (B, m) warm start for the Schur solve.

        Returns:
            ``(Hx (B, n, d) or None, Hy (B, m, d) or None, CGInfo, v (B, m) Schur solution)``.
        """
        x, y, am, bm, eps = self.x, self.y, self.am, self.bm, self.eps
        Ax = None if Ax is None else Ax.to(self.dtype)
        Ay = None if Ay is None else Ay.to(self.dtype)
        p = None if Ax is None else _rowdot(x, Ax)
        q = None if Ay is None else _rowdot(y, Ay)

        # r₁/2 = Σ_j P_ij s_ij = â p − Py·A_x − x·(P A_y) + P q.
        half_r1 = torch.zeros_like(am)
        PAy = Pq = Pqy = None
        if Ax is not None:
            half_r1 = half_r1 + am * p - _rowdot(self.Py, Ax)
        if Ay is not None:
            out = self.P(torch.cat([Ay, q[..., None], q[..., None] * y], -1))
            d = Ay.shape[-1]
            PAy, Pq, Pqy = out[..., :d], out[..., d], out[..., d + 1 :]
            half_r1 = half_r1 - _rowdot(x, PAy) + Pq
        r1 = 2.0 * half_r1

        # Column side in one pass: Pᵀ [A_x, p, p x, r₁/â].
        cols = [(r1 * self.am_inv)[..., None]]
        if Ax is not None:
            cols = [Ax, p[..., None], p[..., None] * x] + cols
        out = self.Pt(torch.cat(cols, -1))
        Pt_r1 = out[..., -1]
        half_r2 = torch.zeros_like(bm)
        PtAx = Ptp = Ptpx = None
        if Ax is not None:
            d = Ax.shape[-1]
            PtAx, Ptp, Ptpx = out[..., :d], out[..., d], out[..., d + 1 : 2 * d + 1]
            half_r2 = half_r2 - _rowdot(y, PtAx) + Ptp
        if Ay is not None:
            half_r2 = half_r2 + bm * q - _rowdot(self.PtX, Ay)
        r2 = 2.0 * half_r2

        rhs = r2 - Pt_r1
        precond = _inv((1.0 + tau) * bm)
        v, info = cg_solve(
            lambda t: self.schur(t, tau), rhs, precond, tol=cg_tol, max_iter=cg_max_iter,
            check_every=check_every, project=(tau == 0), x0=w0,
        )  # fmt: skip

        out = self.P(torch.cat([v[..., None], v[..., None] * y], -1))
        Pv, Pvy = out[..., 0], out[..., 1:]
        u = (r1 - Pv) * self.am_inv

        Hx = Hy = None
        if want_x:
            # Σ_j P_ij (u_i + v_j) D_ij
            T1 = u[..., None] * (am[..., None] * x - self.Py) + x * Pv[..., None] - Pvy
            # Σ_j P_ij s_ij D_ij = x r₁/2 − [p Py − (P ∘ (X A_yᵀ + A_x Yᵀ)) Y + P(q y)]
            T2 = x * half_r1[..., None]
            fa, fb = [], []
            if Ax is not None:
                T2 = T2 - p[..., None] * self.Py
                fa.append(Ax)
                fb.append(y)
            if Ay is not None:
                T2 = T2 - Pqy
                fa.append(x)
                fb.append(Ay)
            Had = self._transport(False, y, torch.cat(fa, -1), torch.cat(fb, -1))[0]
            T2 = T2 + Had
            Hx = (2.0 / eps) * (T1 - 2.0 * T2)
            if Ax is not None:
                Hx = Hx + 2.0 * am[..., None] * Ax
            if Ay is not None:
                Hx = Hx - 2.0 * PAy
        if want_y:
            out = self.Pt(torch.cat([u[..., None], u[..., None] * x], -1))
            Ptu, Ptux = out[..., 0], out[..., 1:]
            T1 = v[..., None] * (bm[..., None] * y - self.PtX) + y * Ptu[..., None] - Ptux
            T2 = y * half_r2[..., None]
            fa, fb = [], []
            if Ay is not None:
                T2 = T2 - q[..., None] * self.PtX
                fa.append(Ay)
                fb.append(x)
            if Ax is not None:
                T2 = T2 - Ptpx
                fa.append(y)
                fb.append(Ax)
            Had = self._transport(True, x, torch.cat(fa, -1), torch.cat(fb, -1))[0]
            T2 = T2 + Had
            Hy = (2.0 / eps) * (T1 - 2.0 * T2)
            if Ay is not None:
                Hy = Hy + 2.0 * bm[..., None] * Ay
            if Ax is not None:
                Hy = Hy - 2.0 * PtAx
        return Hx, Hy, info, v
