"""Pairs drawn from a streamed plan: frequencies against the dense float64 plan (chi-square),
wrong samplers rejected by the same test, the row argmax, rows without replacement."""

import math
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

import flashsinkhorn as fs
from flashsinkhorn.backends import gumbel
from flashsinkhorn.coupling.sampling import draw_rows
from tests.clouds import weighted_clouds

DRAWS = 20000


def _problem(seed=0, n=7, m=6, B=None):
    """A small plan with visibly non-uniform b and potentials: every cell has mass, none
    dominates (eps at the scale of the cost differences)."""
    x, y, a, _ = weighted_clouds(n=n, m=m, d=2, B=B, seed=seed)
    b = torch.arange(1, m + 1, dtype=torch.float64) ** 2
    b = (b / b.sum()).expand(*x.shape[:-2], m).contiguous()
    res = fs.sinkhorn(x, y, a, b, eps=0.05, backend="torch", tol=1e-12, n_iters=5000)
    return res


def _counts(i, j, n, m):
    c = torch.zeros(n * m, dtype=torch.float64)
    c.index_add_(0, i * m + j, torch.ones_like(i, dtype=torch.float64))
    return c


def _pvalue(i, j, P):
    n, m = P.shape
    obs = _counts(i, j, n, m)
    exp = P.reshape(-1) / P.sum() * len(i)
    return chisquare(obs.numpy(), exp.numpy()).pvalue


def test_pairs_match_the_dense_plan():
    res = _problem()
    i, j = fs.sample_pairs(res, DRAWS, seed=1)
    P = res.plan()
    assert i.shape == j.shape == (DRAWS,) and i.dtype == torch.int64
    assert _pvalue(i, j, P) > 1e-3
    # the plan is far from the product of its marginals: the test can tell them apart
    indep = torch.outer(P.sum(1), P.sum(0))
    assert _pvalue(i, j, indep) < 1e-12


def _wrong_columns(res, rows, seed, drop):
    """j | i drawn with the streamed Gumbel-max, but ignoring b or the potential g."""
    sol = res.solution
    X, Y = sol.problem.X, sol.problem.Y
    g = sol.g
    if drop == "b":
        Y = replace(Y, logw=torch.zeros_like(Y.logw))
    else:
        g = torch.zeros_like(g)
    return sol.backend.plan_argmax(X, Y, g, sol.eps, "ieee", rows, seed)


@pytest.mark.parametrize("drop", ["b", "potentials"])
def test_chi_square_rejects_a_wrong_sampler(drop):
    res = _problem()
    gen = torch.Generator().manual_seed(1)
    rows = draw_rows(res, DRAWS, True, gen)
    seed = gumbel.seed_words(gen, torch.device("cpu"))
    cols = _wrong_columns(res, rows, seed, drop)
    assert _pvalue(rows[0], cols[0], res.plan()) < 1e-12
    # the right sampler on the same rows and seed passes
    good = res.solution.backend.plan_argmax(
        res.solution.problem.X, res.solution.problem.Y, res.solution.g, res.eps, "ieee", rows,
        seed,
    )  # fmt: skip
    assert _pvalue(rows[0], good[0], res.plan()) > 1e-3


def test_batched_pairs_per_problem():
    res = _problem(seed=3, B=2)
    i, j = fs.sample_pairs(res, DRAWS, seed=5)
    assert i.shape == j.shape == (2, DRAWS)
    P = res.plan()
    for k in range(2):
        assert _pvalue(i[k], j[k], P[k]) > 1e-3
    # the two problems draw different noise (the draw counter runs over the batch)
    assert not torch.equal(j[0], j[1])


def test_cost_matrix_result():
    x, y, a, b = weighted_clouds(n=6, m=8, d=2, seed=4)
    C = torch.cdist(x, y) ** 2 + torch.rand(6, 8, generator=torch.Generator().manual_seed(0))
    res = fs.solve(C, a, b, eps=0.05, tol=1e-12, n_iters=5000)
    i, j = fs.sample_pairs(res, DRAWS, seed=2)
    P = res.plan()
    assert _pvalue(i, j, P) > 1e-3
    assert torch.equal(fs.plan_argmax(res), P.argmax(1))


def test_argmax_matches_the_dense_plan():
    x, y, a, b = weighted_clouds(n=41, m=33, d=3, B=2, seed=6)
    res = fs.sinkhorn(x, y, a, b, eps=0.01, backend="torch")
    assert torch.equal(fs.plan_argmax(res), res.plan().argmax(-1))


def test_rows_without_replacement():
    res = _problem(n=9, m=5)
    i, j = fs.sample_pairs(res, 9, replace=False, seed=0)
    assert sorted(i.tolist()) == list(range(9))
    i, _ = fs.sample_pairs(res, 4, replace=False, seed=0)
    assert len(set(i.tolist())) == 4
    with pytest.raises(ValueError, match="k must be <= n"):
        fs.sample_pairs(res, 10, replace=False)


def test_reproducible_from_seed_generator_and_global_rng():
    res = _problem()
    a = fs.sample_pairs(res, 50, seed=11)
    b = fs.sample_pairs(res, 50, generator=torch.Generator().manual_seed(11))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    torch.manual_seed(3)
    c = fs.sample_pairs(res, 50)
    torch.manual_seed(3)
    d = fs.sample_pairs(res, 50)
    assert all(torch.equal(u, v) for u, v in zip(c, d, strict=True))
    assert not torch.equal(a[1], fs.sample_pairs(res, 50, seed=12)[1])


def test_argument_checks():
    res = _problem()
    with pytest.raises(ValueError, match="k"):
        fs.sample_pairs(res, 0)
    with pytest.raises(ValueError, match="generator or seed"):
        fs.sample_pairs(res, 3, seed=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="seed"):
        fs.sample_pairs(res, 3, seed=-1)
    with pytest.raises(TypeError, match="generator"):
        fs.sample_pairs(res, 3, generator=7)
    with pytest.raises(TypeError, match="result"):
        fs.sample_pairs("plan", 3)


def test_float32_plan_floor():
    # eps far below what float32 potentials resolve: an error, not a wrong sample
    x = torch.rand(20, 2) * 100
    y = torch.rand(20, 2) * 100
    res = fs.sinkhorn(x, y, eps=1e-3, tol=None, n_iters=1, scaling=None, backend="torch")
    with pytest.raises(ValueError, match="too small"):
        fs.sample_pairs(res, 5)
    with pytest.raises(ValueError, match="too small"):
        fs.plan_argmax(res)


def test_gumbel_noise_is_standard():
    # -log2(-log2 u) = G / ln 2 + log2(ln 2) for a standard Gumbel G: mean (γ + ln ln 2) / ln 2
    # and variance π² / (6 ln² 2) (γ Euler's constant); 10^5 values, tolerances ~5 sigma
    seed = torch.tensor([123, 456])
    keys = gumbel.draw_keys(seed, torch.arange(200))[:, None]
    g = gumbel.gumbel2(seed, keys, torch.arange(500)).double()
    ln2 = math.log(2.0)
    assert abs(g.mean().item() - (0.5772156649 + math.log(ln2)) / ln2) < 0.03
    assert abs(g.var().item() - math.pi**2 / (6 * ln2**2)) < 0.3
    # no two draws share their noise
    assert torch.unique(g.reshape(-1)).numel() > 0.99 * g.numel()
