"""Dual value and marginal errors of a pair of potentials."""

from __future__ import annotations

import torch

from ..backends.base import Backend
from ..problem import Problem, Side


def _phi(side: Side, pot: torch.Tensor) -> torch.Tensor:
    """(B,) −<w, φ*(−pot)>: <w, pot> for a hard marginal, rho <w, 1 − e^{−pot/rho}> for KL.

    A hard side whose nominal mass differs from its sum (the y side of a balanced problem)
    contributes M <w/Σw, pot>, so that eps log M in the potentials cancels the mass term
    exactly (docs/precision.md).
    """
    if side.rho is None:
        dot = (side.w * pot).sum(-1)
        return dot if side.mass_ref is None else side.mass_ref * (dot / side.mass)
    return side.rho * (side.w * -torch.expm1(-pot / side.rho)).sum(-1)


def plan_mass(problem: Problem, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(B,) mass of the plan at a fixed point, from the potentials alone.

    A hard marginal fixes it to that side's (nominal) mass; a KL-relaxed side at its fixed
    point has marginal w e^{−pot/rho}.
    """
    return _mass_gap(problem, f, g) + problem.X.nominal_mass * problem.Y.nominal_mass


def _mass_gap(problem: Problem, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(B,) mass(P) − M_x M_y without cancellation: eps multiplies it in the value, and at
    large eps both terms are ≈ M_x M_y (M the nominal masses)."""
    X, Y = problem.X, problem.Y
    mx, my = X.nominal_mass, Y.nominal_mass
    if X.rho is None:
        return mx * (1.0 - my)
    if Y.rho is None:
        return my * (1.0 - mx)
    # Σ w e^{−pot/rho} − M = Σ w expm1(−pot/rho) keeps the digits of a small exponent.
    ex = (X.w * torch.expm1(-f / X.rho)).sum(-1)
    ey = (Y.w * torch.expm1(-g / Y.rho)).sum(-1)
    return 0.5 * (ex + ey + mx * (1.0 - my) + my * (1.0 - mx))


def dual_value(
    problem: Problem, f: torch.Tensor, g: torch.Tensor, eps: float, backend: Backend | None = None
) -> torch.Tensor:
    """(B,) OT_eps from the dual: φ_x + φ_y − eps (mass(P) − m_a m_b).

    For probability weights and hard marginals this is <a, f> + <b, g>. With ``backend``, its
    fused reduction (``Backend.dual_value``) where it has one.
    """
    if backend is not None:
        fused = backend.dual_value(problem, f, g, eps)
        if fused is not None:
            return fused
    X, Y = problem.X, problem.Y
    return _phi(X, f) + _phi(Y, g) - eps * _mass_gap(problem, f, g)


def _target(side: Side, pot: torch.Tensor) -> torch.Tensor:
    """Marginal the plan must have at a fixed point: w, or w e^{−pot/rho} for a KL side."""
    return side.w if side.rho is None else side.w * torch.exp(-pot / side.rho)


def side_error(side: Side, pot: torch.Tensor, raw: torch.Tensor, eps: float) -> torch.Tensor:
    """(B,) L1 error of one marginal of the plan (pot, ·), given the soft-min ``raw`` of its side.

    The marginal of the current plan is w_i exp((pot_i − T_i) / eps).
    """
    marg = side.w * torch.exp((pot - raw) / eps)
    return (marg - _target(side, pot)).abs().sum(-1)


def marginals(
    problem: Problem, backend: Backend, f: torch.Tensor, g: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """((B, n), (B, m)) row and column marginals of the plan P(f, g), one pass per side."""
    X, Y = problem.X, problem.Y
    _, tf = backend.softmin(X, Y, g, eps, f, 0.0, 1.0, True, problem.precision)
    _, tg = backend.softmin(Y, X, f, eps, g, 0.0, 1.0, True, problem.precision)
    return X.w * torch.exp((f - tf) / eps), Y.w * torch.exp((g - tg) / eps)


def marginal_error(
    problem: Problem, backend: Backend, f: torch.Tensor, g: torch.Tensor, eps: float
) -> torch.Tensor:
    """(B,) ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ (KL sides: against their fixed-point marginals)."""
    ra, rb = marginals(problem, backend, f, g, eps)
    return (ra - _target(problem.X, f)).abs().sum(-1) + (rb - _target(problem.Y, g)).abs().sum(-1)
