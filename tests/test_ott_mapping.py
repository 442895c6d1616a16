"""The mapping to OTT-JAX's unbalanced problem (docs/conventions.md): OTT regularises with the
entropy relative to 1, we with KL(P | a⊗b), so with the same (a, b, tau) the plans differ;
OTT's plan for the weights a^{1/tau_a}, b^{1/tau_b} is ours for (a, b, rho).

OTT-JAX is not a dependency: its fixed point is written here from its definitions, in float64.
Its primal problem is min_P <C, P> − eps H(P) + rho_a KL(P1 | a) + rho_b KL(Pᵀ1 | b) with
H(P) = −Σ P_ij (log P_ij − 1), tau = rho / (rho + eps) (tau = 1: a hard marginal), and
P_ij = exp((f_i + g_j − C_ij) / eps); stationarity gives the updates below.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashsinkhorn as fs

EPS = 0.3


def _ott_plan(C, a, b, eps, tau_a, tau_b, iters=20_000):
    """OTT's alternating updates g ← tau_b (eps log b − eps LSE_i((f_i − C_ij)/eps)), then
    f ← tau_a (eps log a − eps LSE_j((g_j − C_ij)/eps)), to the fixed point."""
    f = torch.zeros(C.shape[0], dtype=C.dtype)
    g = torch.zeros(C.shape[1], dtype=C.dtype)
    for _ in range(iters):
        g = tau_b * (eps * b.log() - eps * torch.logsumexp((f[:, None] - C) / eps, 0))
        f_new = tau_a * (eps * a.log() - eps * torch.logsumexp((g[None, :] - C) / eps, 1))
        done = float((f_new - f).abs().max()) < 1e-15
        f = f_new
        if done:
            break
    return torch.exp((f[:, None] + g[None, :] - C) / eps), f, g


def _problem():
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    y = torch.randn(5, 2, generator=gen, dtype=torch.float64) * 0.8 + 0.4
    a = torch.rand(7, generator=gen, dtype=torch.float64) + 0.1
    b = torch.rand(5, generator=gen, dtype=torch.float64) + 0.1
    return x, y, a / a.sum(), 1.3 * b / b.sum()


def _tau(rho):
    return 1.0 if rho is None else rho / (rho + EPS)


def _ours(x, y, a, b, rho_x, rho_y):
    return fs.sinkhorn(x, y, a, b, eps=EPS, rho_x=rho_x, rho_y=rho_y, tol=1e-13,
                       n_iters=200_000, scaling=None, backend="torch")  # fmt: skip


@pytest.mark.parametrize("rho_x,rho_y", [(0.5, 2.0), (0.5, None), (None, 0.7), (1.0, 1.0)])
def test_ott_plan_with_powered_weights_is_ours(rho_x, rho_y):
    x, y, a, b = _problem()
    if rho_x is None or rho_y is None:  # a hard marginal fixes the mass
        b = b / b.sum()
    C = torch.cdist(x, y) ** 2
    ta, tb = _tau(rho_x), _tau(rho_y)
    res = _ours(x, y, a, b, rho_x, rho_y)
    assert res.converged
    P_ott, f_ott, g_ott = _ott_plan(C, a ** (1 / ta), b ** (1 / tb), EPS, ta, tb)
    torch.testing.assert_close(res.plan(), P_ott, rtol=1e-9, atol=1e-13)
    if rho_x is not None and rho_y is not None:  # potentials are unique: F = f + eps log a
        torch.testing.assert_close(res.f + EPS * a.log(), f_ott, rtol=0, atol=1e-9)
        torch.testing.assert_close(res.g + EPS * b.log(), g_ott, rtol=0, atol=1e-9)
    # and the other way round: OTT's (a, b, tau) is ours with weights a^tau_a, b^tau_b
    P_ab, _, _ = _ott_plan(C, a, b, EPS, ta, tb)
    ours = _ours(x, y, a**ta, b**tb, rho_x, rho_y)
    torch.testing.assert_close(ours.plan(), P_ab, rtol=1e-9, atol=1e-13)


def test_same_weights_give_different_plans():
    # The mapping tau = rho / (rho + eps) alone is not enough: with the same a, b the plans
    # differ (here by tens of percent), also for uniform weights.
    x, y, _, _ = _problem()
    C = torch.cdist(x, y) ** 2
    a = torch.full((7,), 1 / 7, dtype=torch.float64)
    b = torch.full((5,), 1 / 5, dtype=torch.float64)
    rho = 0.5
    P_ott, _, _ = _ott_plan(C, a, b, EPS, _tau(rho), _tau(rho))
    P = _ours(x, y, a, b, rho, rho).plan()
    assert float((P - P_ott).abs().max() / P_ott.abs().max()) > 0.1
    # balanced (tau = 1): the same plan
    P_ott, _, _ = _ott_plan(C, a, b, EPS, 1.0, 1.0)
    torch.testing.assert_close(_ours(x, y, a, b, None, None).plan(), P_ott, rtol=1e-8,
                               atol=1e-13)  # fmt: skip
    assert math.isclose(float(P_ott.sum()), 1.0, rel_tol=1e-12)
