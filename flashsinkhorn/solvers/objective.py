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
    return nominal_sum(side.renormalised, (side.w * t).sum(-1), side.mass, side.nominal_mass)


def nominal_weighted_sum(side: Side, t: torch.Tensor) -> torch.Tensor:
    """(B,) Σ_i w_i t_i with the weights at the side's nominal mass (:func:`_sum`)."""
    return _sum(side, t)


def nominal_sum(renormalised: bool, dot, mass, nominal):
    """M · dot / Σw for a renormalised side (:func:`_sum`), else the plain weighted sum ``dot``.

    Split from :func:`_sum` so that a sharded problem can reduce ``dot`` and the mass over its
    ranks first (flashsinkhorn/distributed).
    """
    return nominal * (dot / mass) if renormalised else dot


def phi_integrand(side: Side, pot: torch.Tensor) -> torch.Tensor:
    """The t of :func:`_phi` = (1 or rho) · <w, t>: pot for a hard marginal,
    1 − e^{−pot/rho} for KL (the factor rho is applied to the sum, :func:`phi_from_sum`)."""
    return pot if side.rho is None else -torch.expm1(-pot / side.rho)


def phi_from_sum(side: Side, total: torch.Tensor) -> torch.Tensor:
    """:func:`_phi` from the nominal sum of :func:`phi_integrand`."""
    return total if side.rho is None else side.rho * total


def _phi(side: Side, pot: torch.Tensor) -> torch.Tensor:
    """(B,) −<w, φ*(−pot)>: <w, pot> for a hard marginal, rho <w, 1 − e^{−pot/rho}> for KL
    (weights at the nominal mass, :func:`_sum`)."""
    return phi_from_sum(side, _sum(side, phi_integrand(side, pot)))


def plan_mass(problem: Problem, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(B,) mass of the plan at a fixed point, from the potentials alone.

    A hard marginal fixes it to that side's (nominal) mass; a KL-relaxed side at its fixed
    point has marginal w e^{−pot/rho}.
    """
    return _mass_gap(problem, f, g) + problem.X.nominal_mass * problem.Y.nominal_mass


def mass_gap_of(rho_x, rho_y, mx, my, ex=None, ey=None):
    """mass(P) − M_x M_y of the dual value from the nominal masses M and, for two KL sides,
    the sums ex = M_x <a/Σa, expm1(−f/rho_x)> and ey likewise (:func:`_mass_gap`)."""
    if rho_x is None:
        return mx * (1.0 - my)
    if rho_y is None:
        return my * (1.0 - mx)
    return 0.5 * (ex + ey + mx * (1.0 - my) + my * (1.0 - mx))


def relaxed_integrand(side: Side, pot: torch.Tensor) -> torch.Tensor:
    """expm1(−pot/rho): Σ w e^{−pot/rho} − M = Σ w expm1(−pot/rho) keeps the digits of a
    small exponent."""
    return torch.expm1(-pot / side.rho)


def _mass_gap(problem: Problem, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(B,) mass(P) − M_x M_y without cancellation: eps multiplies it in the value, and at
    large eps both terms are ≈ M_x M_y (M the nominal masses)."""
    X, Y = problem.X, problem.Y
    ex = ey = None
    if X.rho is not None and Y.rho is not None:
        ex, ey = _sum(X, relaxed_integrand(X, f)), _sum(Y, relaxed_integrand(Y, g))
    return mass_gap_of(X.rho, Y.rho, X.nominal_mass, Y.nominal_mass, ex, ey)


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
    mean = (X.w * plan_gap_integrand(f, t_hat, eps)).sum(-1) / X.mass
    return X.nominal_mass * Y.nominal_mass * mean


def plan_gap_integrand(f: torch.Tensor, t_hat: torch.Tensor, eps: float) -> torch.Tensor:
    """expm1((f − T̂)/eps), whose a-weighted mean times M_x M_y is the plan's mass gap at
    large eps (:func:`_plan_mass_gap`)."""
    return torch.expm1((f - t_hat) / eps)


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
