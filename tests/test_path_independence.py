"""Results that do not depend on the path a call takes: one gauge for balanced potentials
whatever the schedule, acceleration, backend or problem kind; S(μ, μ) = 0 exactly on every
path; and the documented bound of how far below zero a divergence at a tolerance can fall
(docs/conventions.md)."""

from __future__ import annotations

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import distributed, otdd

D64 = torch.float64


def _clouds(n=30, m=23, seed=0, dtype=D64):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=dtype)
    y = torch.rand(m, 2, generator=g, dtype=dtype) * 0.8 + 0.1
    a = torch.rand(n, generator=g, dtype=dtype) + 0.5
    b = torch.rand(m, generator=g, dtype=dtype) + 0.5
    return x, y, a / a.sum(), b / b.sum()


TIGHT = dict(eps=0.1, tol=1e-11, n_iters=20000)
PATHS = {
    "alternating": dict(schedule="alternating", acceleration="none"),
    "alternating overrelax": dict(schedule="alternating", acceleration="overrelax"),
    "alternating anderson": dict(schedule="alternating", acceleration="anderson"),
    "symmetric": dict(schedule="symmetric", acceleration="none"),
    "fixed iterations": dict(tol=None, n_iters=1500),
    "multiscale": dict(path="multiscale"),
    "annealed": dict(scaling=0.5),
}


@pytest.mark.parametrize("weighted", [False, True])
def test_balanced_potentials_have_one_gauge_on_every_path(weighted):
    # Before, alternating gave ⟨a, f⟩ = 0.1089, ⟨b, g⟩ = 0.0021 where symmetric gave
    # 0.0554 / 0.0557 (300 × 200 points, eps 0.05): the potentials depended on the schedule.
    x, y, a, b = _clouds()
    if not weighted:
        a = b = None
    res = {k: fs.sinkhorn(x, y, a, b, **{**TIGHT, **kw}) for k, kw in PATHS.items()}
    C = torch.cdist(x, y) ** 2
    res["solve"] = fs.solve(C, a, b, **TIGHT)
    wa = a if weighted else torch.full((30,), 1 / 30, dtype=D64)
    wb = b if weighted else torch.full((23,), 1 / 23, dtype=D64)
    ref = res["alternating"]
    for name, r in res.items():
        torch.testing.assert_close(wa @ r.f, wb @ r.g, rtol=0, atol=1e-13, msg=name)
        torch.testing.assert_close(r.f, ref.f, rtol=0, atol=1e-8, msg=name)
        torch.testing.assert_close(r.g, ref.g, rtol=0, atol=1e-8, msg=name)
        torch.testing.assert_close(r.value, ref.value, rtol=1e-10, atol=0, msg=name)


def test_batched_problems_are_each_in_the_gauge():
    x, y, a, b = _clouds()
    xb, yb = torch.stack([x, 2 * x]), torch.stack([y, y])
    r = fs.sinkhorn(xb, yb, torch.stack([a, a]), torch.stack([b, b]), **TIGHT)
    torch.testing.assert_close((a * r.f).sum(-1), (b * r.g).sum(-1), rtol=0, atol=1e-13)
    one = fs.sinkhorn(x, y, a, b, **TIGHT)
    torch.testing.assert_close(r.f[0], one.f, rtol=0, atol=1e-9)


@pytest.mark.parametrize("tol", [None, 1e-6])
def test_the_gauge_is_formed_only_when_the_potentials_are_read(tol):
    # The shift costs reductions and launches (eight per call on the GPU): a call that reads
    # the value only must not pay for it, whether or not it has a tolerance to warn about.
    x, y, a, b = _clouds()
    C = torch.cdist(x, y) ** 2
    for res in (fs.sinkhorn(x, y, a, b, eps=0.1, tol=tol, n_iters=50),
                fs.solve(C, a, b, eps=0.1, tol=tol, n_iters=50)):  # fmt: skip
        assert res._gauged is None
        res.value.item()
        assert res._gauged is None
        assert res.f.shape == (x.shape[0],)
        assert res._gauged is not None


def test_what_reads_the_potentials_is_unchanged_by_the_gauge():
    # The plan, the transports, the value and the gradients read f + g: the gauge moves
    # nothing else. The weight gradient of ot_cost is f itself, in the same gauge.
    x, y, a, b = _clouds()
    r = fs.sinkhorn(x, y, a, b, **TIGHT)
    C = torch.cdist(x, y) ** 2
    P = a[:, None] * b[None, :] * torch.exp((r.f[:, None] + r.g[None, :] - C) / TIGHT["eps"])
    torch.testing.assert_close(r.plan(), P, rtol=1e-12, atol=1e-15)
    V = torch.rand(23, 3, dtype=D64)
    torch.testing.assert_close(r.apply(V), P @ V, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(P.sum(1), a, rtol=0, atol=1e-9)
    aa = a.clone().requires_grad_()
    fs.ot_cost(x, y, aa, b, **TIGHT).backward()
    torch.testing.assert_close(aa.grad, r.f, rtol=0, atol=1e-9)


def test_sharded_potentials_are_in_the_gauge(one_rank):
    # The sharded solve (one gloo rank) shifts its potentials after the loop, as every other
    # solve's result: the same f and g, and the same weight gradient of ot_cost.
    x, y, a, b = _clouds()
    ref = fs.sinkhorn(x, y, a, b, **TIGHT)
    r = distributed.sinkhorn(x, y, a, b, **TIGHT)
    torch.testing.assert_close(a @ r.f, b @ r.g, rtol=0, atol=1e-13)
    torch.testing.assert_close(r.f, ref.f, rtol=0, atol=1e-8)
    torch.testing.assert_close(r.g, ref.g, rtol=0, atol=1e-8)
    aa = a.clone().requires_grad_()
    distributed.ot_cost(x, y, aa, b, **TIGHT).backward()
    torch.testing.assert_close(aa.grad, ref.f, rtol=0, atol=1e-8)


def test_unbalanced_potentials_are_not_shifted():
    # A KL-relaxed marginal fixes the constant: no gauge to choose, the fixed point is kept.
    x, y, a, b = _clouds()
    r = fs.sinkhorn(x, y, a, b, rho_x=0.5, rho_y=0.5, **TIGHT)
    f_fixed = (
        -0.5
        / (0.5 + TIGHT["eps"])
        * TIGHT["eps"]
        * torch.logsumexp(
            torch.log(b)[None, :] + (r.g[None, :] - torch.cdist(x, y) ** 2) / TIGHT["eps"], dim=1
        )
    )
    torch.testing.assert_close(r.f, f_fixed, rtol=0, atol=1e-9)


# ------------------------------------------------------------------------- S(μ, μ) = 0

SELF_PATHS = {
    "torch": dict(),
    "torch symmetric": dict(schedule="symmetric"),
    "multiscale": dict(path="multiscale"),
    "unbalanced": dict(rho_x=1.0, rho_y=1.0),
    "fixed iterations": dict(tol=None, n_iters=20),
}


@pytest.mark.parametrize("path", list(SELF_PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, D64])
def test_divergence_of_identical_clouds_is_exactly_zero(path, dtype):
    # Before: sinkhorn_divergence(x, x.clone()) was −1.7e-7 (400 points, float64) and the
    # multiscale path −8.6e-6 at the default tolerance, so sqrt(S) was NaN.
    # the block-sparse soft-mins are slow on the CPU: fewer points there
    x, _, a, _ = _clouds(n=40 if path == "multiscale" else 150, dtype=dtype)
    kw = dict(eps=0.02, **SELF_PATHS[path])
    xx = x.clone().requires_grad_()
    for y, wy in ((x, a), (x.clone(), a.clone()), (x.clone(), None)):
        wx = a if wy is not None else None
        s = fs.sinkhorn_divergence(xx, y, wx, wy, **kw)
        assert s.item() == 0.0, (path, s.item())
        (gx,) = torch.autograd.grad(s, xx)
        assert torch.count_nonzero(gx) == 0
        assert fs.SinkhornDivergence(**kw)(x, y, wx, wy).item() == 0.0


def test_identical_clouds_on_the_streaming_kernels(device):
    # three fixed iterations: the interpreted kernels cost about 0.1 s a launch on the CPU,
    # and the identity holds after any number of iterations
    x, _, a, _ = _clouds(n=37, dtype=torch.float32)
    x, a = x.to(device), a.to(device)
    kw = dict(eps=0.5, tol=None, n_iters=3, backend="triton")
    s = fs.sinkhorn_divergence(x, x.clone(), a, a.clone(), **kw)
    assert s.item() == 0.0


def test_identical_batch_members_and_samples_loss():
    x, y, a, b = _clouds(n=50, m=50)
    # the first problem of the batch is identical, the second is not
    xb, yb = torch.stack([x, x]), torch.stack([x.clone(), y])
    s = fs.sinkhorn_divergence(xb, yb, eps=0.02)
    assert s[0].item() == 0.0 and s[1].item() > 1e-3
    for loss in (fs.SamplesLoss(blur=0.1), fs.SamplesLoss(blur=0.1, reach=1.0)):
        assert loss(x, x.clone()).item() == 0.0
        assert loss(a, x, a.clone(), x.clone()).item() == 0.0
        assert loss(x, y).item() > 1e-3
    # different weights on the same points are different measures
    assert fs.sinkhorn_divergence(x, x.clone(), a, b, eps=0.02).item() > 0.0


def test_label_augmented_identity_needs_equal_labels():
    x, _, _, _ = _clouds(n=40)
    lab = torch.arange(40) % 3
    W = torch.rand(3, 3, dtype=D64)
    W = W + W.T
    W.fill_diagonal_(0.0)
    kw = dict(eps=0.05, label_cost=W)
    assert fs.sinkhorn_divergence(x, x.clone(), label_x=lab, label_y=lab.clone(), **kw) == 0.0
    other = fs.sinkhorn_divergence(x, x.clone(), label_x=lab, label_y=lab.roll(1), **kw)
    assert other.item() > 0.0
    # OTDD numbers the second dataset's classes after the first's: never compared equal
    assert otdd.otdd_distance(x, lab, x.clone(), lab, eps=0.05).item() >= 0.0


# ------------------------------------------------------- how far below zero S can fall

BOUND_PATHS = {
    "alternating": dict(schedule="alternating"),
    "symmetric": dict(schedule="symmetric"),
    "anderson": dict(acceleration="anderson"),
    "multiscale": dict(path="multiscale"),
}


@pytest.mark.parametrize("path", list(BOUND_PATHS))
@pytest.mark.parametrize("tol", [1e-2, 1e-3])
def test_negative_part_of_a_divergence_within_the_documented_bound(path, tol):
    # S ≥ −tol·(R + eps), R the cost range (diameter²): weak duality bounds every term's value
    # by its optimum, the gap of OT(x, y) by tol·R and the mass term by eps·tol/2
    # (docs/conventions.md). Clouds a hair apart: S is then tiny and the truncation shows.
    x, _, a, _ = _clouds(n=60 if path == "multiscale" else 200, seed=1)
    y = x + 1e-4 * torch.randn(x.shape, dtype=D64, generator=torch.Generator().manual_seed(2))
    eps = 0.01
    s = fs.sinkhorn_divergence(x, y, a, a, eps=eps, tol=tol, **BOUND_PATHS[path])
    both = torch.cat([x, y])
    R = float(((both.amax(0) - both.amin(0)) ** 2).sum())
    assert s.item() >= -tol * (R + eps), (path, s.item())
