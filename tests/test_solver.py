"""The solver (torch backend, float64) against dense float64 references and closed forms."""

import math

import numpy as np
import pytest
import torch

import flashsinkhorn as fs

from . import reference as ref


def _cloud(n, d, seed, offset=0.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, d, generator=g, dtype=dtype) + offset


def _weights(n, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(n, generator=g, dtype=dtype) + 0.1
    return w / w.sum()


def _centre_potentials(f, g, a):
    """Potentials are defined up to (f + c, g − c): fix c by <a, f> = 0 for comparison."""
    c = (a * f).sum() / a.sum()
    return f - c, g + c


@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
@pytest.mark.parametrize("n,m,d", [(23, 31, 2), (40, 17, 5)])
def test_balanced_matches_dense_reference(schedule, n, m, d):
    x, y = _cloud(n, d, 1), _cloud(m, d, 2)
    a, b = _weights(n, 3), _weights(m, 4)
    eps = 0.05
    res = fs.sinkhorn(x, y, a, b, eps=eps, tol=1e-12, n_iters=20000, schedule=schedule)
    assert res.converged and res.backend == "torch" and res.precision == "ieee"
    f_ref, g_ref, P_ref = ref.solve(x.numpy(), y.numpy(), a.numpy(), b.numpy(), eps)
    value_ref = ref.primal(x.numpy(), y.numpy(), a.numpy(), b.numpy(), P_ref, eps)
    assert abs(res.value.item() - value_ref) <= 1e-9 * abs(value_ref)
    f, g = _centre_potentials(res.f, res.g, a)
    fr, gr = _centre_potentials(torch.from_numpy(f_ref), torch.from_numpy(g_ref), a)
    assert torch.allclose(f, fr, atol=1e-9) and torch.allclose(g, gr, atol=1e-9)
    C = torch.from_numpy(ref.cost(x.numpy(), y.numpy()))
    P = a[:, None] * b[None, :] * torch.exp((res.f[:, None] + res.g[None, :] - C) / eps)
    assert torch.allclose(P, torch.from_numpy(P_ref), atol=1e-11)
    assert res.marginal_error.item() <= 1e-12


@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
@pytest.mark.parametrize("rho_x,rho_y", [(0.5, 0.5), (None, 0.3), (2.0, None)])
def test_unbalanced_value_equals_primal(schedule, rho_x, rho_y):
    n, m, d, eps = 29, 21, 3, 0.1
    x, y = _cloud(n, d, 5), _cloud(m, d, 6, offset=0.3)
    a, b = _weights(n, 7), _weights(m, 8) * 1.5  # unequal masses are allowed here
    res = fs.sinkhorn(
        x, y, a, b, eps=eps, rho_x=rho_x, rho_y=rho_y, tol=1e-12, n_iters=20000, schedule=schedule
    )
    assert res.converged
    f_ref, g_ref, P_ref = ref.solve(
        x.numpy(), y.numpy(), a.numpy(), b.numpy(), eps, rho_x=rho_x, rho_y=rho_y
    )
    value_ref = ref.primal(x.numpy(), y.numpy(), a.numpy(), b.numpy(), P_ref, eps, rho_x, rho_y)
    assert abs(res.value.item() - value_ref) <= 1e-9 * abs(value_ref)
    # Unbalanced potentials are unique (no additive constant).
    assert torch.allclose(res.f, torch.from_numpy(f_ref), atol=1e-9)
    assert torch.allclose(res.g, torch.from_numpy(g_ref), atol=1e-9)


def test_unequal_mass_balanced_value():
    """Non-normalised but equal masses: the dual value keeps the −eps(mass − m_a m_b) term."""
    n, m, d, eps = 15, 18, 2, 0.2
    x, y = _cloud(n, d, 9), _cloud(m, d, 10)
    a, b = 3 * _weights(n, 11), 3 * _weights(m, 12)
    res = fs.sinkhorn(x, y, a, b, eps=eps, tol=1e-12, n_iters=20000)
    _, _, P = ref.solve(x.numpy(), y.numpy(), a.numpy(), b.numpy(), eps)
    value_ref = ref.primal(x.numpy(), y.numpy(), a.numpy(), b.numpy(), P, eps)
    assert abs(res.value.item() - value_ref) <= 1e-9 * abs(value_ref)


@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
def test_batched_equals_loop(schedule):
    B, n, m, d, eps = 3, 19, 26, 4, 0.1
    g = torch.Generator().manual_seed(0)
    x = torch.rand(B, n, d, generator=g, dtype=torch.float64)
    y = torch.rand(B, m, d, generator=g, dtype=torch.float64)
    a = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.1
    b = torch.rand(B, m, generator=g, dtype=torch.float64) + 0.1
    a, b = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    res = fs.sinkhorn(x, y, a, b, eps=eps, tol=None, n_iters=300, schedule=schedule)
    assert res.f.shape == (B, n) and res.g.shape == (B, m) and res.value.shape == (B,)
    for k in range(B):
        one = fs.sinkhorn(x[k], y[k], a[k], b[k], eps=eps, tol=None, n_iters=300, schedule=schedule)
        assert torch.allclose(res.f[k], one.f, atol=1e-12)
        assert torch.allclose(res.value[k], one.value, atol=1e-12)


def test_batched_convergence_waits_for_slowest_problem():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 20, 2, generator=g, dtype=torch.float64)
    y = torch.rand(2, 22, 2, generator=g, dtype=torch.float64)
    y[1] *= 4  # a harder problem
    res = fs.sinkhorn(x, y, eps=0.02, tol=1e-8, n_iters=5000)
    assert res.converged
    assert res.marginal_error.max().item() <= 1e-8


def test_single_target_point_closed_form():
    """All mass goes to the single point: OT_eps = Σ a_i ‖x_i − y‖² for every eps."""
    x, a = _cloud(17, 3, 13), _weights(17, 14)
    y = torch.tensor([[0.3, -0.2, 0.5]], dtype=torch.float64)
    for eps in (0.01, 1.0):
        res = fs.sinkhorn(x, y, a, None, eps=eps, tol=1e-12)
        expected = (a * ((x - y) ** 2).sum(1)).sum()
        assert torch.allclose(res.value, expected, rtol=1e-12)


def test_gaussian_closed_form_1d():
    """1-D Gaussians: entropic OT has a closed form (Janati et al. 2020, eps = 2σ²).

    The measures are discretised at quantiles (n = 500 and 1000).
    """
    from scipy.stats import norm

    def quantiles(n, mean, sd):
        return torch.tensor(norm.ppf((np.arange(n) + 0.5) / n) * sd + mean)[:, None]

    def closed(m1, s1, m2, s2, eps):
        sig2 = eps / 2
        D = math.sqrt(4 * s1**2 * s2**2 + sig2**2)
        return (
            (m1 - m2) ** 2
            + s1**2
            + s2**2
            - D
            + sig2 * (1 - math.log(2 * sig2))
            + sig2 * math.log(D + sig2)
        )

    m1, s1, m2, s2, eps = 0.2, 0.5, -0.4, 1.1, 0.5
    exact = closed(m1, s1, m2, s2, eps)
    vals = {}
    for n in (500, 1000):
        res = fs.sinkhorn(
            quantiles(n, m1, s1), quantiles(n, m2, s2), eps=eps, tol=1e-10, n_iters=5000
        )
        vals[n] = res.value.item()
    # Quantile discretisation loses O(1/n) of the variance: the error halves with n, and one
    # Richardson step removes it.
    assert abs(vals[1000] - exact) < 0.52 * abs(vals[500] - exact)
    assert abs(2 * vals[1000] - vals[500] - exact) / exact < 1e-5


def test_translation_invariance_float32():
    """Clouds offset by 1e3 in float32 give the value of the centred problem."""
    x, y = _cloud(40, 3, 15, dtype=torch.float32), _cloud(45, 3, 16, dtype=torch.float32)
    base = fs.sinkhorn(x.double(), y.double(), eps=0.01, tol=1e-9, n_iters=5000)
    far = fs.sinkhorn(x + 1e3, y + 1e3, eps=0.01, tol=1e-5, n_iters=5000)
    assert far.converged
    # The offset itself rounds the fp32 coordinates by up to 6e-5.
    assert abs(far.value.item() - base.value.item()) <= 2e-3 * base.value.item()


def test_annealing_schedule_and_result():
    x, y = _cloud(30, 2, 17), _cloud(25, 2, 18)
    plain = fs.sinkhorn(x, y, eps=0.005, tol=1e-10, n_iters=20000)
    annealed = fs.sinkhorn(x, y, eps=0.005, tol=1e-10, n_iters=20000, scaling=0.7)
    assert annealed.converged and annealed.eps == 0.005
    assert abs(annealed.value.item() - plain.value.item()) <= 1e-8
    # The ladder starts at diameter² and takes one iteration per value above eps.
    ladder = fs.solvers.eps_schedule(0.005, 0.7, 2.0)
    assert ladder[0] == 4.0 and ladder[-1] == 0.005
    assert all(r > s for r, s in zip(ladder[1:-1], ladder[2:], strict=False))


def test_diameter_argument_is_used():
    x, y = _cloud(10, 2, 19), _cloud(12, 2, 20)
    r1 = fs.sinkhorn(x, y, eps=0.1, tol=None, n_iters=1, scaling=0.5, diameter=10.0)
    r2 = fs.sinkhorn(x, y, eps=0.1, tol=None, n_iters=1, scaling=0.5, diameter=1.0)
    assert r1.n_iters > r2.n_iters  # a larger diameter means a longer ladder


def test_fixed_iteration_mode_counts_exactly():
    x, y = _cloud(10, 2, 21), _cloud(12, 2, 22)
    res = fs.sinkhorn(x, y, eps=0.1, tol=None, n_iters=7)
    assert res.n_iters == 7 and not res.converged and res.errors == []
    assert res.marginal_error.item() >= 0


def test_convergence_reports_error_of_returned_plan():
    x, y = _cloud(30, 3, 23), _cloud(31, 3, 24)
    res = fs.sinkhorn(x, y, eps=0.05, tol=1e-6, check_every=5)
    assert res.converged and res.n_iters % 5 == 0
    known = res.marginal_error.clone()
    res._error = None  # recompute from the potentials
    assert torch.allclose(res.marginal_error, known, rtol=1e-8, atol=1e-15)
    ra, rb = res.marginals()
    assert ra.shape == (30,) and rb.shape == (31,)


def test_zero_weights_and_duplicates():
    x, y = _cloud(12, 2, 25), _cloud(14, 2, 26)
    x[5] = x[4]  # duplicate point
    a = _weights(12, 27)
    a[3] = 0.0
    a = a / a.sum()
    res = fs.sinkhorn(x, y, a, None, eps=0.05, tol=1e-11, n_iters=20000)
    assert torch.isfinite(res.f).all() and torch.isfinite(res.value)
    keep = torch.arange(12) != 3
    sub = fs.sinkhorn(x[keep], y, a[keep], None, eps=0.05, tol=1e-11, n_iters=20000)
    assert abs(res.value.item() - sub.value.item()) <= 1e-10


def test_identical_clouds_and_single_points():
    x = _cloud(9, 2, 28)
    res = fs.sinkhorn(x, x.clone(), eps=0.1, tol=1e-10, scaling=0.5)
    assert torch.isfinite(res.value)
    one = fs.sinkhorn(x[:1], x[:1].clone(), eps=0.1, tol=1e-10, scaling=0.5)
    assert one.value.item() == pytest.approx(0.0, abs=1e-12)


def test_inputs_not_modified_and_grad_mode_kept():
    x = _cloud(10, 2, 29).requires_grad_()
    y = _cloud(11, 2, 30)
    a = _weights(10, 31)
    copies = [t.detach().clone() for t in (x, y, a)]
    res = fs.sinkhorn(x, y, a, eps=0.1)
    assert torch.is_grad_enabled()
    for t, c in zip((x, y, a), copies, strict=True):
        assert torch.equal(t.detach(), c)
    assert not res.f.requires_grad


def test_inference_mode():
    x, y = _cloud(10, 2, 32), _cloud(11, 2, 33)
    with torch.inference_mode():
        res = fs.sinkhorn(x, y, eps=0.1)
    assert torch.isfinite(res.value)


@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
@pytest.mark.parametrize("tol", [1e-9, None])
@pytest.mark.parametrize("rho", [None, 0.5])
def test_zero_weight_potentials_match_final_softmin(schedule, tol, rho):
    # Zero-weight points feed no update, so nothing in the loop corrects their potentials:
    # the returned f there must still be the (damped) soft-min of the returned g.
    x, y = _cloud(13, 3, 40), _cloud(11, 3, 41)
    a = _weights(13, 42)
    a[[2, 7]] = 0.0
    a = a / a.sum()
    b = _weights(11, 43)
    b[4] = 0.0
    b = b / b.sum()
    eps = 0.05
    res = fs.sinkhorn(
        x, y, a, b, eps=eps, tol=tol, n_iters=3000 if tol else 40, schedule=schedule,
        rho_x=rho, rho_y=rho, backend="torch",
    )  # fmt: skip
    lam = 1.0 if rho is None else 1.0 / (1.0 + eps / rho)
    C = torch.cdist(x, y) ** 2
    f_ref = -lam * eps * torch.logsumexp((res.g - C) / eps + b.log(), dim=1)
    g_ref = -lam * eps * torch.logsumexp((res.f[:, None] - C) / eps + a.log()[:, None], dim=0)
    assert torch.allclose(res.f[[2, 7]], f_ref[[2, 7]], rtol=0, atol=1e-12)
    assert torch.allclose(res.g[4], g_ref[4], rtol=0, atol=1e-12)
