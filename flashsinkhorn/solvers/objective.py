"""Dual value and marginal errors of a pair of potentials."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..backends.base import Backend
from ..problem import Problem, Side


def _sum(side: Side, t: torch.Tensor) -> torch.Tensor:
    """(B,) Σ_i w_i t_i with the weights scaled to the side's nominal mass M, M <w/Σw, t>
    (``Side.nominal_mass``: 1 for uniform weights, the x side's mass for the y side of a
    balanced problem), so that eps ln M in the potentials meets the same M in the mass term."""
    dot = (side.w * t).sum(-1)
    return side.nominal_mass * (dot / side.mass) if side.renormalised else dot


def _phi(side: Side, pot: torch.Tensor) -> torch.Tensor:
    """(B,) −<w, φ*(−pot)>: <w, pot> for a hard marginal, rho <w, 1 − e^{−pot/rho}> for KL
    (weights at the nominal mass, :func:`_sum`)."""
    if side.rho is None:
        return _sum(side, pot)
    return side.rho * _sum(side, -torch.expm1(-pot / side.rho))


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
    ex = _sum(X, torch.expm1(-f / X.rho))
    ey = _sum(Y, torch.expm1(-g / Y.rho))
    return 0.5 * (ex + ey + mx * (1.0 - my) + my * (1.0 - mx))


def dual_value(
    problem: Problem, f: torch.Tensor, g: torch.Tensor, eps: float, backend: Backend | None = None
) -> torch.Tensor:
    """(B,) OT_eps from the dual: φ_x + φ_y − eps (mass(P) − m_a m_b).

    For probability weights and hard marginals this is <a, f> + <b, g>. With ``backend``, its
    fused reduction (``Backend.dual_value``) where it has one.
    """
    X, Y = problem.X, problem.Y
    if backend is not None and X.rho is not None and Y.rho is not None and eps >= X.large_eps:
        return _phi(X, f) + _phi(Y, g) - eps * _plan_mass_gap(problem, backend, f, g, eps)
    if backend is not None:
        fused = backend.dual_value(problem, f, g, eps)
        if fused is not None:
            return fused
    return _phi(X, f) + _phi(Y, g) - eps * _mass_gap(problem, f, g)


def _plan_mass_gap(problem: Problem, backend: Backend, f, g, eps: float) -> torch.Tensor:
    """(B,) mass(P) − M_x M_y of two KL sides at large eps, from one soft-min pass.

    There the fixed-point identity mass(P) = Σ a e^{−f/rho} leaves the O(1/eps) part of the
    mass below float32's resolution of e^{−f/rho} ≈ M_y, and eps multiplies the loss. Instead,
    with T̂ the soft-min of g against the columns' weights scaled to mass 1 (exactly what the
    large-eps soft-min computes before adding −eps ln M_y), mass(P) = M_y Σ_i a_i
    e^{(f_i − T̂_i)/eps}, and the gap is M_x M_y <a/Σa, expm1((f − T̂)/eps)>: every term keeps
    its digits (docs/precision.md).
    """
    X, Y = problem.X, problem.Y
    unit = replace(Y, unit_mass=True, mass_of=None)
    _, t_hat = backend.softmin(X, unit, g, eps, f, 0.0, 1.0, True, problem.precision)
    mean = (X.w * torch.expm1((f - t_hat) / eps)).sum(-1) / X.mass
    return X.nominal_mass * Y.nominal_mass * mean


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
    """(B,) ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ (KL sides: against their fixed-point marginals); for a
    backend that visits part of the plan, an upper bound of it (``Backend.bound_error``)."""
    ra, rb = marginals(problem, backend, f, g, eps)
    err = (ra - _target(problem.X, f)).abs().sum(-1) + (rb - _target(problem.Y, g)).abs().sum(-1)
    return backend.bound_error(err)
