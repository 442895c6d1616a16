"""Accelerated Sinkhorn (over-relaxation, Anderson mixing) and the "auto" defaults.

Every accelerated solve is checked against a tightly converged float64 reference, and the
reported marginal error against the error recomputed from the returned potentials: the
acceleration must not change what ``marginal_error`` means.
"""

from __future__ import annotations

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.options import ANDERSON_MIN_WORK, SinkhornOptions
from flashsinkhorn.solvers.acceleration import OMEGA_START, AdaptiveOmega, Anderson
from flashsinkhorn.solvers.objective import marginal_error

from .clouds import weighted_clouds as _clouds

PLAIN = dict(schedule="alternating", acceleration="none", scaling=None)


def _reference(x, y, a, b, eps, **kw):
    return fs.sinkhorn(x, y, a, b, eps=eps, tol=1e-12, n_iters=50_000, backend="torch",
                       **{**PLAIN, **kw})  # fmt: skip


def _recomputed_error(res):
    s = res.solution
    return s.problem.unbatch(marginal_error(s.problem, s.backend, s.f, s.g, s.eps))


CASES = [
    ("alternating", "overrelax"),
    ("alternating", "anderson"),
    ("symmetric", "overrelax"),
    ("symmetric", "anderson"),
]


@pytest.mark.parametrize("schedule,acceleration", CASES)
def test_accelerated_solve_matches_float64_reference(schedule, acceleration):
    x, y, a, b = _clouds()
    eps = 0.05
    ref = _reference(x, y, a, b, eps)
    res = fs.sinkhorn(x, y, a, b, eps=eps, tol=1e-9, n_iters=20_000, backend="torch",
                      schedule=schedule, acceleration=acceleration, scaling=None)  # fmt: skip
    assert res.converged and res.schedule == schedule and res.acceleration == acceleration
    assert abs(float(res.value - ref.value)) <= 1e-8
    # The reported error is the error of the returned plan, and it is below tol.
    err = float(res.marginal_error)
    assert err <= 1e-9
    assert abs(err - float(_recomputed_error(res))) <= 1e-14
    # The plan is the reference plan up to the potentials' constant.
    shift = float((res.f - ref.f).mean())
    assert torch.allclose(res.f - shift, ref.f, atol=1e-7)
    assert torch.allclose(res.g + shift, ref.g, atol=1e-7)


def test_acceleration_needs_fewer_iterations():
    x, y, a, b = _clouds(n=61, m=53, d=2, seed=1)
    eps = 0.005
    kw = dict(eps=eps, tol=1e-6, n_iters=20_000, backend="torch", scaling=None)
    plain = fs.sinkhorn(x, y, a, b, **{**kw, **PLAIN})
    anderson = fs.sinkhorn(x, y, a, b, **kw, schedule="alternating", acceleration="anderson")
    relax = fs.sinkhorn(x, y, a, b, **kw, schedule="alternating", acceleration="overrelax")
    assert plain.converged and anderson.converged and relax.converged
    assert anderson.n_iters * 3 <= plain.n_iters, (anderson.n_iters, plain.n_iters)
    assert relax.n_iters * 2 <= plain.n_iters, (relax.n_iters, plain.n_iters)


@pytest.mark.parametrize("acceleration", ["overrelax", "anderson"])
def test_batch_problems_keep_their_own_state(acceleration):
    # Three problems of very different difficulty (eps relative to their spread).
    x, y, a, b = _clouds(n=31, m=27, d=2, B=3, seed=2)
    scale = torch.tensor([0.2, 1.0, 3.0], dtype=x.dtype)[:, None, None]
    x, y = x * scale, y * scale
    eps = 0.02
    kw = dict(eps=eps, tol=1e-8, n_iters=20_000, backend="torch", scaling=None,
              schedule="alternating", acceleration=acceleration)  # fmt: skip
    res = fs.sinkhorn(x, y, a, b, **kw)
    assert res.converged
    assert bool((res.marginal_error <= 1e-8).all())
    assert torch.allclose(res.marginal_error, _recomputed_error(res), rtol=0, atol=1e-14)
    for i in range(3):
        ref = _reference(x[i], y[i], a[i], b[i], eps)
        assert abs(float(res.value[i] - ref.value)) <= 1e-7 * max(1.0, abs(float(ref.value)))


@pytest.mark.parametrize("acceleration", ["overrelax", "anderson"])
@pytest.mark.parametrize("rho", [(1.0, 1.0), (0.5, None), (None, 2.0)])
def test_unbalanced_and_semi_unbalanced(acceleration, rho):
    x, y, a, b = _clouds(seed=3)
    b = 1.3 * b
    rho_x, rho_y = rho
    eps = 0.05
    ref = _reference(x, y, a, b, eps, rho_x=rho_x, rho_y=rho_y)
    res = fs.sinkhorn(x, y, a, b, eps=eps, tol=1e-9, n_iters=20_000, backend="torch",
                      rho_x=rho_x, rho_y=rho_y, schedule="alternating",
                      acceleration=acceleration, scaling=None)  # fmt: skip
    assert res.converged
    assert abs(float(res.value - ref.value)) <= 1e-7
    assert abs(float(res.marginal_error) - float(_recomputed_error(res))) <= 1e-14


@pytest.fixture(scope="module")
def small_eps_reference():
    """Clouds at eps = 0.002 and their float64 reference, shared by the accelerations: the
    plain reference takes about 38,000 iterations (13 s on one core), the solves under test
    a few hundred."""
    x, y, a, b = _clouds(seed=4)
    eps = 0.002
    return (x, y, a, b), eps, _reference(x, y, a, b, eps)


@pytest.mark.parametrize("acceleration", ["overrelax", "anderson"])
def test_annealing_then_acceleration(small_eps_reference, acceleration):
    (x, y, a, b), eps, ref = small_eps_reference
    res = fs.sinkhorn(x, y, a, b, eps=eps, tol=1e-8, n_iters=20_000, backend="torch",
                      schedule="alternating", acceleration=acceleration, scaling=0.5)  # fmt: skip
    assert res.converged
    assert abs(float(res.value - ref.value)) <= 1e-7


def test_safeguard_drops_a_bad_fixed_omega():
    relax = AdaptiveOmega(2, "alternating", fixed=1.99)
    relax.update([1.0, 1.0], 10)
    relax.update([2.0, 0.5], 10)  # problem 0 grew: back to the plain iteration
    assert relax.omega == [1.0, 1.99]
    relax.update([1.5, 0.4], 10)
    assert relax.omega == [1.0, 1.99]  # a fixed factor is never raised again


def test_solve_with_too_large_omega_still_converges():
    x, y, a, b = _clouds(n=41, m=35, d=2, seed=5)
    res = fs.sinkhorn(x, y, a, b, eps=0.01, tol=1e-7, n_iters=20_000, backend="torch",
                      schedule="alternating", acceleration="overrelax", omega=1.999,
                      scaling=None)  # fmt: skip
    ref = _reference(x, y, a, b, 0.01)
    assert res.converged
    assert abs(float(res.value - ref.value)) <= 1e-6


def test_adaptive_omega_from_plain_and_over_relaxed_rates():
    # Symmetric schedule: ω starts at 1 and is set from three steady plain windows.
    sym = AdaptiveOmega(1, "symmetric")
    for k in range(4):  # plain averaged rate (1 + σ)/2 = 0.9 per iteration
        sym.update([0.9 ** (10 * k)], 10)
    sigma = 2 * 0.9 - 1
    assert abs(sym.omega[0] - 4 / (3 - sigma)) < 1e-9
    # Alternating: ω starts at OMEGA_START and Young's relation corrects it from the observed
    # over-relaxed rate. For κ = 0.95 at ω = 1.5 the rate λ solves (λ + ω − 1)² = λ ω² κ.
    alt = AdaptiveOmega(1, "alternating")
    w0 = OMEGA_START
    kappa = 0.95
    p = 2 * (w0 - 1) - w0 * w0 * kappa
    lam = (-p + (p * p - 4 * (w0 - 1) ** 2) ** 0.5) / 2
    alt.update([1.0], 10)
    alt.update([lam**10], 10)
    best = 2 / (1 + (1 - kappa) ** 0.5)
    assert abs(alt.omega[0] - best) < 1e-9
    # At the optimal factor the rate is ω − 1: nothing more to correct.
    alt.update([lam**10 * (best - 1) ** 10], 10)
    alt.update([lam**10 * (best - 1) ** 20], 10)
    assert abs(alt.omega[0] - best) < 1e-9


def test_anderson_safeguard_rejects_a_mixed_iterate_that_raises_the_error():
    u0 = torch.zeros(1, 4, dtype=torch.float64)
    mixer = Anderson(u0, memory=3)
    r = torch.ones(1, 4, dtype=torch.float64)
    u1 = mixer.step(u0, u0 + r, torch.tensor([1.0], dtype=torch.float64))
    assert torch.equal(u1, u0 + r)  # no history yet: the plain step
    u2 = mixer.step(u1, u1 + 0.5 * r, torch.tensor([0.5], dtype=torch.float64))
    # u2 is mixed; its error is reported higher than u1's: back to the plain step from u1.
    u3 = mixer.step(u2, u2 + 0.1 * r, torch.tensor([0.9], dtype=torch.float64))
    assert torch.equal(u3, u1 + 0.5 * r)
    assert int(mixer.rejected) == 1


def test_auto_resolves_by_tolerance_and_eps():
    base = SinkhornOptions.build(eps=0.01)
    assert (base.schedule, base.acceleration, base.scaling) == ("auto", "auto", "auto")
    r = base.resolve(scale=1.0)
    assert (r.schedule, r.acceleration, r.scaling) == ("alternating", "overrelax", None)
    assert base.resolve(scale=100.0).scaling == 0.5
    assert base.resolve(scale=1e6).scaling == 0.7
    assert base.resolve(scale=1.0, work=10**8).acceleration == "overrelax"
    assert base.resolve(scale=1.0, work=ANDERSON_MIN_WORK).acceleration == "anderson"
    fixed = SinkhornOptions.build(eps=0.01, tol=None).resolve(scale=1e6)
    assert (fixed.schedule, fixed.acceleration, fixed.scaling) == ("symmetric", "none", None)
    sym = SinkhornOptions.build(eps=0.01, schedule="symmetric").resolve(scale=1.0)
    assert (sym.schedule, sym.acceleration) == ("symmetric", "none")
    explicit = SinkhornOptions.build(eps=0.01, scaling=None).resolve(scale=1e6)
    assert explicit.scaling is None


def test_default_call_reports_what_ran():
    x, y, a, b = _clouds()
    res = fs.sinkhorn(x, y, a, b, eps=0.05, backend="torch")
    assert (res.schedule, res.acceleration) == ("alternating", "overrelax")
    assert res.converged and float(res.marginal_error) <= 1e-3
    fixed = fs.sinkhorn(x, y, a, b, eps=0.05, backend="torch", tol=None, n_iters=5)
    assert (fixed.schedule, fixed.acceleration, fixed.n_iters) == ("symmetric", "none", 5)


@pytest.mark.parametrize(
    "kw,exc",
    [
        (dict(acceleration="fast"), ValueError),
        (dict(acceleration=None), ValueError),
        (dict(omega=2.0), ValueError),
        (dict(omega=0.0), ValueError),
        (dict(omega="1.5"), TypeError),
        (dict(anderson_memory=0), ValueError),
        (dict(anderson_memory=2.5), TypeError),
        (dict(scaling="fast"), ValueError),
        (dict(schedule="jacobi"), ValueError),
    ],
)
def test_bad_acceleration_arguments(kw, exc):
    x, y, a, b = _clouds()
    with pytest.raises(exc, match=next(iter(kw))):
        fs.sinkhorn(x, y, a, b, eps=0.1, backend="torch", **kw)


@pytest.mark.parametrize("schedule", ["alternating", "symmetric"])
def test_triton_accelerated_matches_torch(device, schedule):
    x, y, a, b = _clouds(n=45, m=33, d=5, seed=6, dtype=torch.float32)
    kw = dict(eps=0.05, tol=1e-5, n_iters=2000, schedule=schedule, acceleration="anderson",
              scaling=None, precision="ieee")  # fmt: skip
    ref = fs.sinkhorn(x, y, a, b, backend="torch", **kw)
    got = fs.sinkhorn(*(t.to(device) for t in (x, y, a, b)), backend="triton", **kw)
    assert got.converged and float(got.marginal_error) <= 1e-5
    assert abs(float(got.value) - float(ref.value)) <= 1e-5 * abs(float(ref.value)) + 1e-6
