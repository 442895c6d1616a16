"""The once-per-solve scalars of backends/triton/sums.py against their torch formulas.

The plan step's "zero" and "second" shifts and the dual value of the potentials, each one
launch (interpreter on CPU, compiled on CUDA). Sizes cross the 1024-point block; weights
include zeros; every marginal kind (hard, KL) on either side.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flashsinkhorn.backends.triton import TritonBackend, sums
from flashsinkhorn.problem import prepare
from flashsinkhorn.solvers.objective import dual_value


def _problem(device, B=3, n=37, m=1030, d=17, rho_x=None, rho_y=None, cost="sqeuclidean"):
    g = torch.Generator().manual_seed(B * n + m)
    x = torch.rand(B, n, d, generator=g, dtype=torch.float64) * 2.0 + 1.0
    y = torch.randn(B, m, d, generator=g, dtype=torch.float64)
    a = torch.rand(B, n, generator=g, dtype=torch.float64)
    b = torch.rand(B, m, generator=g, dtype=torch.float64) * 3.0
    a[:, 3] = 0.0  # zero weights
    b[:, ::7] = 0.0
    if rho_x is None and rho_y is None:
        a, b = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    args = [t.to(device=device, dtype=torch.float32) for t in (x, y, a, b)]
    p = prepare(*args, rho_x=rho_x, rho_y=rho_y, precision="ieee", cost=cost)
    f = torch.randn(B, n, generator=g, dtype=torch.float64).to(device, torch.float32) + 4.0
    gg = torch.randn(B, m, generator=g, dtype=torch.float64).to(device, torch.float32) - 1.0
    return p, f, gg


def _wmean(w, v):
    w, v = w.double(), v.double()
    return (w * v).sum(-1) / w.sum(-1)


def _double(p):
    """The problem with weights and norms in float64 (what dual_value reads)."""
    side = lambda s: dataclasses.replace(s, w=s.w.double(), sq=s.sq.double())  # noqa: E731
    return dataclasses.replace(p, X=side(p.X), Y=side(p.Y))


# Large rho: the KL term rho Σ w (1 − e^{−f/rho}) must not cancel in float32.
RHOS = [(None, None), (0.5, None), (None, 2.0), (0.7, 1.3), (1e3, None), (1e4, 3e4)]


@pytest.mark.parametrize(("rho_x", "rho_y"), RHOS)
def test_fused_dual_value_matches_the_float64_formula(device, rho_x, rho_y):
    p, f, g = _problem(device, rho_x=rho_x, rho_y=rho_y)
    want = dual_value(_double(p), f.double(), g.double(), 0.3)  # torch formula in float64
    got = dual_value(p, f, g, 0.3, TritonBackend())
    assert got.shape == want.shape == (3,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # the float32 torch formula is as close
    torch.testing.assert_close(dual_value(p, f, g, 0.3).double(), want, rtol=1e-6, atol=1e-6)


def test_fused_dual_value_ignores_zero_weight_points(device):
    """A zero-weight point contributes nothing, whatever its potential (even inf)."""
    p, f, g = _problem(device, rho_x=0.5)
    f_inf = f.clone()
    f_inf[:, 3] = float("inf")  # a[:, 3] = 0
    got = dual_value(p, f_inf, g, 0.3, TritonBackend())
    torch.testing.assert_close(got, dual_value(p, f, g, 0.3, TritonBackend()), rtol=0, atol=0)


def test_dual_value_in_float64_uses_the_torch_formula():
    p, f, g = _problem(torch.device("cpu"))
    p64 = _double(p)
    assert p64.dtype == torch.float64
    assert TritonBackend().dual_value(p64, f.double(), g.double(), 0.3) is None
    got = dual_value(p64, f.double(), g.double(), 0.3, TritonBackend())
    assert got.dtype == torch.float64
    assert torch.equal(got, dual_value(p64, f.double(), g.double(), 0.3))


@pytest.mark.parametrize("lam", [1.0, 0.8])
def test_second_shift(device, lam):
    p, f, g = _problem(device)
    k, c = 1.0 - 0.5 / lam, -1.25
    got = sums.second_shift(p.X, p.Y, f, g, k, c)
    want = k * (_wmean(p.X.w, f) + _wmean(p.Y.w, g)) + c
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
@pytest.mark.parametrize("given_means", [True, False])
def test_zero_shift_is_c_minus_the_mean_cost(device, cost, given_means):
    p, _, _ = _problem(device, cost=cost)
    X, Y = p.X, p.Y
    if not given_means:  # sides made elsewhere: the means come from the points
        X, Y = dataclasses.replace(X, mean=None), dataclasses.replace(Y, mean=None)
    got = sums.zero_shift(X, Y, 0.75)
    x, y = p.X.x.double(), p.Y.x.double()
    sq = ((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1)
    wa = p.X.w.double() / p.X.w.double().sum(-1, keepdim=True)
    wb = p.Y.w.double() / p.Y.w.double().sum(-1, keepdim=True)
    mean_sq = torch.einsum("bi,bij,bj->b", wa, sq, wb)
    want = 0.75 - (mean_sq.sqrt() if cost == "euclidean" else mean_sq)
    assert math.isfinite(float(got.sum()))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
