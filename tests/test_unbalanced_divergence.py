"""Unbalanced Sinkhorn divergences need the same relaxation on both marginals (docs/transport.md,
"Unbalanced divergences"): with rho_x == rho_y the divergence is zero on identical inputs,
symmetric and nonnegative; with rho_x != rho_y (semi-unbalanced included) it is refused."""

from __future__ import annotations

import pytest
import torch

import flashsinkhorn as fs

F64 = dict(tol=1e-11, n_iters=100_000, scaling=None, backend="torch")


def _clouds():
    g = torch.Generator().manual_seed(5)
    x = torch.rand(50, 3, generator=g, dtype=torch.float64)
    y = torch.rand(40, 3, generator=g, dtype=torch.float64) + 0.5
    return x, y


@pytest.mark.parametrize("rho_x,rho_y", [(0.3, None), (None, 0.3), (0.3, 1.0), (1.0, 0.3)], ids=str)
def test_different_relaxations_are_refused(rho_x, rho_y):
    # rho_x=0.3, rho_y=None gave S(x, x) = 0.0035 and S(x, y) != S(y, x), silently.
    x, y = _clouds()
    match = r"needs rho_x == rho_y: both None \(balanced\) or the same number"
    with pytest.raises(ValueError, match=match):
        fs.sinkhorn_divergence(x, x, eps=0.1, rho_x=rho_x, rho_y=rho_y)
    with pytest.raises(ValueError, match=match):
        fs.SinkhornDivergence(eps=0.1, rho_x=rho_x, rho_y=rho_y)
    # ot_cost itself is defined for any pair
    assert torch.isfinite(fs.ot_cost(x, y, eps=0.1, rho_x=rho_x, rho_y=rho_y))


@pytest.mark.parametrize("rho", [None, 0.3])
def test_equal_relaxations_give_a_divergence(rho):
    x, y = _clouds()
    a = torch.rand(50, dtype=torch.float64, generator=torch.Generator().manual_seed(6)) + 0.1
    a = a / a.sum() * (1.0 if rho is None else 1.7)  # unequal masses when relaxed
    kw = dict(eps=0.1, rho_x=rho, rho_y=rho, **F64)
    assert abs(fs.sinkhorn_divergence(x, x, a, a, **kw).item()) < 1e-10
    s_xy = fs.sinkhorn_divergence(x, y, a, None, **kw).item()
    s_yx = fs.sinkhorn_divergence(y, x, None, a, **kw).item()
    assert s_xy > 0 and abs(s_xy - s_yx) < 1e-10 * s_xy


def _semi(x, y, a, b, eps, rho):
    """The self-consistent semi-unbalanced debiasing: every term relaxes x's side only."""

    def ot(u, v, wu, wv):
        return fs.ot_cost(u, v, wu, wv, eps=eps, rho_x=rho, **F64).item()

    return ot(x, y, a, b) - 0.5 * ot(x, x, a, a) - 0.5 * ot(y, y, b, b)


def test_semi_unbalanced_debiasing_is_not_nonnegative():
    # Why a semi-unbalanced divergence is refused rather than defined: the only debiasing with
    # S(a, a) = 0 (every term relaxing the first marginal) is negative here. a and b have the
    # same mass, mean and variance, a has the heavier fourth moment; at large eps the sign is
    # that of −(Var_a ‖x‖² − Var_b ‖y‖²) / (4 eps) (docs/transport.md).
    d = torch.float64
    x = torch.tensor([[0.0], [2**0.5], [-(2**0.5)]], dtype=d)
    a = torch.tensor([0.5, 0.25, 0.25], dtype=d)
    y = torch.tensor([[1.0], [-1.0]], dtype=d)
    b = torch.tensor([0.5, 0.5], dtype=d)
    assert abs(_semi(x, x, a, a, 10.0, 0.01)) < 1e-10
    assert _semi(x, y, a, b, 10.0, 0.01) < -1e-2
    assert _semi(y, x, b, a, 10.0, 0.01) > 1e-2
    # the balanced and the (symmetric) unbalanced divergences are positive on the same data
    for rho in (None, 0.01):
        s = fs.sinkhorn_divergence(x, y, a, b, eps=10.0, rho_x=rho, rho_y=rho, **F64)
        assert s.item() > 0
