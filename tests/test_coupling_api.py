"""couple / couple_indices and the torchcfm-style OTPlanSampler: shapes, modes, the near-exact
mode's distance to POT's exact OT, argument checks, and the sampler's documented behaviour
(against torchcfm itself where it is installed)."""

import math

import numpy as np
import ot
import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import OTPlanSampler


def _batches(n=64, shape=(2,), seed=0, m=None):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, *shape, generator=g)
    x1 = torch.rand(n if m is None else m, *shape, generator=g) * 2 + 0.5
    return x0, x1


def _pair_cost(a, b):
    return (a - b).flatten(1).square().sum(1).mean().item()


def _emd_cost(x0, x1):
    C = torch.cdist(x0.flatten(1).double(), x1.flatten(1).double()) ** 2
    return ot.emd2(ot.unif(len(x0)), ot.unif(len(x1)), C.numpy()), C


# ----- couple -----


def test_couple_images_shapes_and_indices():
    x0, x1 = _batches(48, (3, 4, 4))
    a, b = fs.couple(x0, x1, seed=1)
    i, j = fs.couple_indices(x0, x1, seed=1)
    assert a.shape == b.shape == x0.shape
    assert torch.equal(a, x0[i]) and torch.equal(b, x1[j])
    # default: every source sample once
    assert sorted(i.tolist()) == list(range(48))
    i2, _ = fs.couple_indices(x0, x1, seed=1, k=100, replace=True)
    assert i2.shape == (100,)


def test_couple_is_differentiable_through_the_indexing():
    x0, x1 = _batches(20)
    x0.requires_grad_(True)
    a, _ = fs.couple(x0, x1, seed=0)
    a.sum().backward()
    assert torch.equal(x0.grad, torch.ones_like(x0))


@pytest.mark.parametrize("shape", [(2,), (3, 4, 4)])
def test_modes_order_the_pair_cost(shape):
    x0, x1 = _batches(96, shape, seed=2)
    W, _ = _emd_cost(x0, x1)
    indep = _pair_cost(x0, x1)
    costs = {}
    for mode in ("entropic", "exact"):
        i, j = fs.couple_indices(x0, x1, mode=mode, seed=0)
        costs[mode] = _pair_cost(x0[i], x1[j])
    # sampled pairs: close to the exact OT cost, far below independent pairing
    assert W * 0.9 < costs["exact"] < W * 1.1 + 1e-9
    assert costs["entropic"] < W + 0.25 * (indep - W)


@pytest.mark.parametrize("shape", [(2,), (48,)])
def test_near_exact_plan_within_one_percent_of_emd(shape):
    # the documented gap: expected cost of the near-exact plan against ot.emd's exact cost
    x0, x1 = _batches(128, shape, seed=3)
    W, C = _emd_cost(x0, x1)
    P = OTPlanSampler("exact").get_map(x0, x1)
    gap = (float((torch.from_numpy(P) * C).sum()) - W) / W
    assert 0.0 <= gap + 1e-3 and gap < 0.01


def test_unbalanced_leaves_an_outlier():
    x0, x1 = _batches(64, seed=4)
    x1 = torch.cat([x1, torch.tensor([[30.0, 30.0]])])
    counts = {}
    for mode, rho in (("entropic", None), ("unbalanced", 0.1 * 30.0**2 / 10)):
        _, j = fs.couple_indices(x0, x1, mode=mode, rho=rho, k=3000, replace=True, seed=0)
        counts[mode] = int((j == 64).sum())
    assert counts["entropic"] > 20  # 3000 / 65 expected
    assert counts["unbalanced"] < counts["entropic"] / 4


def test_couple_argument_checks():
    x0, x1 = _batches(16)
    with pytest.raises(ValueError, match="eps"):
        fs.couple(x0, x1, eps=-1.0)
    with pytest.raises(ValueError, match="mode"):
        fs.couple(x0, x1, mode="partial")
    with pytest.raises(ValueError, match="rho"):
        fs.couple(x0, x1, rho=1.0)
    with pytest.raises(ValueError, match="features"):
        fs.couple(x0, torch.rand(16, 3))
    with pytest.raises(ValueError, match="k must be"):
        fs.couple(x0, x1, k=17)
    with pytest.raises(TypeError, match="x0"):
        fs.couple(x0.long(), x1)
    with pytest.raises(TypeError, match="x1"):
        fs.couple(x0, [1.0])
    bad = x1.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="finite|NaN"):
        fs.couple(x0, bad)
    with pytest.raises(ValueError, match="too small"):
        fs.couple(x0 * 100, x1 * 100, eps=1e-6, tol=None, n_iters=2)
    # nothing the caller owns is modified
    before = x0.clone()
    fs.couple(x0, x1, seed=0)
    assert torch.equal(before, x0)


# ----- OTPlanSampler: torchcfm's documented behaviour -----


def test_methods():
    for method in ("exact", "sinkhorn", "unbalanced"):
        OTPlanSampler(method=method)
    with pytest.raises(ValueError, match="partial"):
        OTPlanSampler(method="partial")
    with pytest.raises(ValueError, match="method"):
        OTPlanSampler(method="emd")
    with pytest.raises(ValueError, match="reg"):
        OTPlanSampler(method="sinkhorn", reg=0.0)


def test_sample_map_recovers_a_permutation():
    # a permutation plan drawn without replacement gives back every cell once
    n = 64
    perm = np.random.default_rng(0).permutation(n)
    pi = np.eye(n)[:, perm]
    i, j = OTPlanSampler("exact").sample_map(pi, batch_size=n, replace=False)
    rebuilt = np.zeros((n, n))
    rebuilt[i, j] = 1
    assert np.array_equal(rebuilt, pi)


def test_get_map_is_a_plan():
    x0, x1 = _batches(40, (2, 2, 2), seed=5)
    for method in ("exact", "sinkhorn"):
        pi = OTPlanSampler(method).get_map(x0, x1)
        assert isinstance(pi, np.ndarray) and pi.shape == (40, 40)
        assert abs(pi.sum() - 1.0) < 1e-3
        assert np.abs(pi.sum(1) - 1 / 40).sum() < 2e-3


def test_sample_plan_pairs_rows_of_the_inputs():
    x0, x1 = _batches(32, (2, 2, 2), seed=6)
    s = OTPlanSampler("sinkhorn", reg=0.5)
    a, b = s.sample_plan(x0, x1)
    assert a.shape == b.shape == x0.shape
    rows0 = {tuple(r.tolist()) for r in x0.flatten(1)}
    rows1 = {tuple(r.tolist()) for r in x1.flatten(1)}
    assert all(tuple(r.tolist()) in rows0 for r in a.flatten(1))
    assert all(tuple(r.tolist()) in rows1 for r in b.flatten(1))
    a2, _ = s.sample_plan(x0, x1, replace=False)
    assert sorted(tuple(r.tolist()) for r in a2.flatten(1)) == sorted(rows0)


def test_sample_plan_reproducible_with_torch_seed():
    x0, x1 = _batches(32, seed=7)
    s = OTPlanSampler("exact")
    torch.manual_seed(1980)
    a = s.sample_plan(x0, x1)
    torch.manual_seed(1980)
    b = s.sample_plan(x0, x1)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_sample_plan_with_labels_follows_the_pairs():
    x0, x1 = _batches(30, seed=8)
    y0, y1 = torch.arange(30), torch.arange(30) + 100
    a, b, la, lb = OTPlanSampler("unbalanced", reg=0.3).sample_plan_with_labels(x0, x1, y0, y1)
    assert torch.equal(a, x0[la]) and torch.equal(b, x1[lb - 100])
    out = OTPlanSampler("sinkhorn", reg=0.3).sample_plan_with_labels(x0, x1)
    assert out[2] is None and out[3] is None


def test_sample_trajectory():
    g = torch.Generator().manual_seed(9)
    X = torch.randn(24, 4, 2, generator=g) + torch.arange(4.0)[None, :, None]
    # the near-exact plans of these spread-out slices stop short of tol=1e-3 at the sampler's
    # 1000 iterations, and say so (the draws below need only the support of the plans)
    with pytest.warns(fs.ConvergenceWarning, match="stopped at n_iters=1000"):
        T = OTPlanSampler("exact").sample_trajectory(X)
    assert T.shape == X.shape
    assert torch.equal(T[:, 0], X[:, 0])
    for t in range(4):
        rows = {tuple(r.tolist()) for r in X[:, t]}
        assert all(tuple(r.tolist()) in rows for r in T[:, t])


def test_normalize_cost_scales_reg():
    x0, x1 = _batches(24, seed=10)
    top = float((torch.cdist(x0.double(), x1.double()) ** 2).max())
    p1 = OTPlanSampler("sinkhorn", reg=0.05, normalize_cost=True).get_map(x0, x1)
    p2 = OTPlanSampler("sinkhorn", reg=0.05 * top).get_map(x0, x1)
    assert np.abs(p1 - p2).sum() < 1e-4


# ----- against torchcfm itself -----


def test_against_torchcfm():
    tc = pytest.importorskip("torchcfm.optimal_transport")
    x0, x1 = _batches(50, (2, 2, 2), seed=11)
    ours, theirs = OTPlanSampler("sinkhorn", reg=0.5), tc.OTPlanSampler("sinkhorn", reg=0.5)
    p_ours, p_theirs = ours.get_map(x0, x1), theirs.get_map(x0, x1)
    # the same entropic plan, up to the two solvers' marginal tolerances
    assert np.abs(p_ours - p_theirs).sum() < 5e-3
    # sample_map: the same draws from the same NumPy seed
    saved = np.random.get_state()  # noqa: NPY002  (both samplers read NumPy's global RNG)
    try:
        np.random.seed(1980)  # noqa: NPY002
        a = ours.sample_map(p_theirs, 50)
        np.random.seed(1980)  # noqa: NPY002
        b = theirs.sample_map(p_theirs, 50)
    finally:
        np.random.set_state(saved)  # noqa: NPY002
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    # exact: within 1 % of ot.emd's cost
    C = (torch.cdist(x0.flatten(1).double(), x1.flatten(1).double()) ** 2).numpy()
    e_ours = (OTPlanSampler("exact").get_map(x0, x1) * C).sum()
    e_theirs = (tc.OTPlanSampler("exact").get_map(x0, x1) * C).sum()
    assert abs(e_ours - e_theirs) / e_theirs < 0.01
    # unbalanced: same objective family (KL relaxation reg_m), close plans after normalising
    u_ours = OTPlanSampler("unbalanced", reg=0.5, reg_m=1.0).get_map(x0, x1)
    u_theirs = tc.OTPlanSampler("unbalanced", reg=0.5, reg_m=1.0).get_map(x0, x1)
    assert math.isfinite(u_ours.sum())
    assert np.abs(u_ours / u_ours.sum() - u_theirs / u_theirs.sum()).sum() < 0.05
