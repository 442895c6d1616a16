"""eps ladders: computed from logarithms (no overflow for huge diameters, starts within the
potentials' range), bounded in length, and still GeomLoss's ladder wherever that one is
finite."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import solvers
from flashsinkhorn.autograd.samples_loss import geomloss_eps_list
from flashsinkhorn.solvers import eps_schedule, geometric_ladder


def _clouds(dtype):
    g = torch.Generator().manual_seed(3)
    return torch.rand(50, 3, generator=g, dtype=dtype), torch.rand(40, 3, generator=g,
                                                                   dtype=dtype) + 0.5  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("diameter", [1e30, 1e200])
def test_huge_diameter_anneals_to_the_same_solution(dtype, diameter):
    # diameter=1e200 raised OverflowError (diameter² in Python floats); 1e30 gave NaN in
    # float32 (the ladder started at eps = 1e60, beyond the float32 range).
    x, y = _clouds(dtype)
    ref = fs.sinkhorn(x, y, eps=0.1, scaling=None, tol=1e-6)
    res = fs.sinkhorn(x, y, eps=0.1, scaling=0.5, diameter=diameter, tol=1e-6)
    assert ref.converged and res.converged
    assert abs(res.value.item() - ref.value.item()) <= 1e-5 * abs(ref.value.item())
    for loss in (fs.ot_cost, fs.sinkhorn_divergence):
        want = loss(x, y, eps=0.1, scaling=None, tol=1e-6)
        got = loss(x, y, eps=0.1, scaling=0.5, diameter=diameter, tol=1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(fs.SamplesLoss(diameter=diameter)(x, y))


def test_ladder_starts_within_the_potentials_range():
    for dtype in (torch.float32, torch.float64):
        ladder = eps_schedule(0.1, 0.5, 1e200, dtype=dtype)
        assert ladder[0] == pytest.approx(math.sqrt(torch.finfo(dtype).max))
        assert ladder[-1] == 0.1 and all(math.isfinite(e) for e in ladder)
        assert all(r >= s for r, s in zip(ladder, ladder[1:], strict=False))
    # a start within the range is kept
    assert eps_schedule(0.005, 0.7, 2.0, dtype=torch.float32)[0] == 4.0


@pytest.mark.parametrize("scaling,eps", [(0.999999999, 1e-3), (0.9999, 1e-3)])
def test_too_long_ladder_is_refused(scaling, eps):
    # scaling=0.999999999 tried to allocate a 32.6 GiB array of ladder values.
    x, y = _clouds(torch.float32)
    match = rf"scaling={scaling!r} would anneal eps .* steps, more than the 10,000 allowed"
    with pytest.raises(ValueError, match=match):
        fs.sinkhorn(x, y, eps=eps, scaling=scaling)
    with pytest.raises(ValueError, match=match):
        fs.ot_cost(x, y, eps=eps, scaling=scaling)
    with pytest.raises(ValueError, match=match):
        fs.SamplesLoss(blur=math.sqrt(eps), scaling=scaling)(x, y)


def test_ladder_length_bound_is_exact():
    steps = solvers.MAX_ANNEALING_STEPS
    assert steps == 10_000
    for n, ok in ((steps, True), (steps + 1, False)):
        stop = 0.99**n * 1.0001  # arange(0, log stop, log 0.99) has exactly n values
        if ok:
            assert len(geometric_ladder(1.0, stop, 0.99)) == n + 2
        else:
            with pytest.raises(ValueError, match="more than the 10,000 allowed"):
                geometric_ladder(1.0, stop, 0.99)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize(
    "diameter,blur,scaling", [(3.7, 0.05, 0.5), (1.2, 0.01, 0.9), (0.3, 0.2, 0.7), (0.1, 0.2, 0.5)]
)
def test_geomloss_ladder_unchanged(p, diameter, blur, scaling):
    # GeomLoss's own formula (numpy), where it is finite.
    if diameter <= blur:
        want = [diameter**p, blur**p]
    else:
        steps = np.arange(p * np.log(diameter), p * np.log(blur), p * np.log(scaling))
        want = [diameter**p, *np.exp(steps).tolist(), blur**p]
    got = geomloss_eps_list(diameter, blur, scaling, p)
    assert len(got) == len(want)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
