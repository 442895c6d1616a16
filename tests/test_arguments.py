"""Arguments across the public API: bools are bools, numbers are finite real numbers given as
Python numbers, NumPy scalars or 0-d tensors (alike everywhere), and a wrong value raises a
ValueError or TypeError naming the argument before anything is solved."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import otdd

X = torch.rand(9, 3, generator=torch.Generator().manual_seed(0))
Y = torch.rand(7, 3, generator=torch.Generator().manual_seed(1)) + 0.5
L1 = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1, 1])
L2 = torch.tensor([0, 1, 2, 0, 1, 2, 0])


FIXED = {"eps": 0.5, "tol": None, "n_iters": 3}


def _solve(**kw):
    return fs.sinkhorn(X, Y, **{**FIXED, **kw})


# Every public entry point that takes solver options, with one keyword changed.
CALLS = {
    "sinkhorn": _solve,
    "ot_cost": lambda **kw: fs.ot_cost(X, Y, **{**FIXED, **kw}),
    "sinkhorn_divergence": lambda **kw: fs.sinkhorn_divergence(X, Y, **{**FIXED, **kw}),
    "SinkhornDivergence": lambda **kw: fs.SinkhornDivergence(**{**FIXED, **kw})(X, Y),
    "hvp": lambda **kw: fs.hvp(X, Y, torch.ones_like(X), **{**FIXED, **kw}),
    "class_distance_matrix": lambda **kw: otdd.class_distance_matrix(
        X, L1, Y, L2, **{**FIXED, **kw}
    ),
    "otdd_distance": lambda **kw: otdd.otdd_distance(X, L1, Y, L2, **{**FIXED, **kw}),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize(
    "value", [0.5, np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor(0.5).double()]
)
def test_numbers_accepted_alike_everywhere(name, value):
    ref = CALLS[name]()
    out = CALLS[name](eps=value)
    got = out.hvp if isinstance(out, fs.HVPResult) else getattr(out, "value", out)
    want = ref.hvp if isinstance(ref, fs.HVPResult) else getattr(ref, "value", ref)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize(
    "value,exc,match",
    [
        (True, TypeError, "eps must be a finite positive number, got bool"),
        (np.bool_(True), TypeError, "eps must be"),
        (torch.tensor(True), TypeError, "eps must be .*torch.bool"),
        ("0.5", TypeError, "eps must be"),
        (None, TypeError, "eps must be"),
        (torch.tensor([0.5]), ValueError, r"eps must be .*shape \(1,\)"),
        (math.nan, ValueError, "eps must be finite and > 0"),
        (math.inf, ValueError, "eps must be finite and > 0"),
        (10**400, ValueError, "eps must be finite and > 0, got inf"),
        (torch.tensor(-1.0), ValueError, "eps must be finite and > 0"),
    ],
)
def test_bad_numbers_refused_alike_everywhere(name, value, exc, match):
    with pytest.raises(exc, match=match):
        CALLS[name](eps=value)


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("value", ["no", None, 1, np.int64(0), torch.tensor(True)])
def test_check_finite_must_be_a_bool(name, value):
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        CALLS[name](check_finite=value)


@pytest.mark.parametrize("value", [np.int64(5), np.int32(5), torch.tensor(5), np.array(5)])
def test_integers_accepted_as_numpy_and_0d_tensors(value):
    assert _solve(n_iters=value).n_iters == 5
    assert _solve(check_every=value, tol=1e-3, n_iters=1000).converged


@pytest.mark.parametrize(
    "value,exc",
    [(5.0, TypeError), (True, TypeError), (torch.tensor(5.0), TypeError), (0, ValueError)],
)
def test_integers_refuse_floats_and_bools(value, exc):
    with pytest.raises(exc, match="n_iters must"):
        _solve(n_iters=value)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(tol=np.float64(1e-3)), None, None),
        (dict(hvp_options={"tau": torch.tensor(1e-4)}), None, None),
        (dict(hvp_options={"tau": True}), TypeError, "tau must be a finite number >= 0"),
        (dict(hvp_options={"tau": math.nan}), ValueError, "tau must be finite and >= 0"),
        (dict(hvp_options={"cg_max_iter": 2.0}), TypeError, "cg_max_iter must be an int"),
        (dict(feature_weight=np.float32(2.0)), None, None),
        (dict(feature_weight=torch.tensor(2.0)), None, None),
        (dict(feature_weight=True), TypeError, "feature_weight must be a finite number"),
        (dict(feature_weight=math.inf), ValueError, "feature_weight must be finite"),
        (dict(omega=np.float64(1.5), acceleration="overrelax"), None, None),
        (dict(scaling=np.float64(0.5)), None, None),
        (dict(scaling=True), TypeError, "scaling must be"),
    ],
)
def test_other_numeric_options(kw, exc, match):
    if exc is None:
        assert torch.isfinite(fs.ot_cost(X, Y, eps=0.5, **kw))
    else:
        with pytest.raises(exc, match=match):
            fs.ot_cost(X, Y, eps=0.5, **kw)


# ----- SamplesLoss -----


@pytest.mark.parametrize("flag", ["debias", "potentials", "verbose", "check_finite"])
@pytest.mark.parametrize("value", ["no", None, 0, 1.0])
def test_samples_loss_flags_are_bools(flag, value):
    # debias='no' used to switch the debiasing on (a non-empty string is truthy).
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        fs.SamplesLoss(**{flag: value})


def test_samples_loss_numbers():
    ref = fs.SamplesLoss(blur=0.3)(X, Y)
    for blur in (np.float32(0.3), torch.tensor(0.3)):
        torch.testing.assert_close(fs.SamplesLoss(blur=blur)(X, Y), ref)
    assert fs.SamplesLoss(p=np.int64(2), debias=np.bool_(True))(X, Y).shape == ()
    with pytest.raises(TypeError, match="p must be 1 or 2"):
        fs.SamplesLoss(p="2")
    with pytest.raises(ValueError, match="p must be 1 or 2"):
        fs.SamplesLoss(p=1.5)
    with pytest.raises(TypeError, match="blur must be"):
        fs.SamplesLoss(blur=True)
    with pytest.raises(ValueError, match="truncate must be finite"):
        fs.SamplesLoss(truncate=math.nan)
    with pytest.raises(ValueError, match="backend must be one of"):
        fs.SamplesLoss(backend=["torch"])


# ----- other entry points -----


def test_plan_max_elements_must_be_an_int():
    res = _solve()
    with pytest.raises(TypeError, match="max_elements must be an int"):
        res.plan(max_elements="big")
    with pytest.raises(TypeError, match="max_elements must be an int"):
        res.plan(max_elements=1e9)
    assert res.plan(max_elements=np.int64(63)).shape == (9, 7)
    with pytest.raises(ValueError, match="max_elements"):
        res.plan(max_elements=62)


def test_hessian_operator_flags_are_bools():
    for flag in ("debias", "warm_start"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            fs.HessianOperator(X, Y, eps=0.5, **{flag: "yes"})


def test_otdd_flags_and_numbers():
    for kw in (dict(differentiable="no"), dict(progress=None)):
        with pytest.raises(TypeError, match="must be a bool"):
            otdd.class_distance_matrix(X, L1, Y, L2, eps=0.5, **kw)
    for kw in (dict(differentiable_w=1), dict(progress="no")):
        with pytest.raises(TypeError, match="must be a bool"):
            otdd.otdd_distance(X, L1, Y, L2, eps=0.5, **kw)
    with pytest.raises(TypeError, match="label_weight must be a finite number"):
        otdd.otdd_distance(X, L1, Y, L2, eps=0.5, label_weight=True)
    with pytest.raises(TypeError, match="max_batch_elements must be an int"):
        otdd.class_distance_matrix(X, L1, Y, L2, eps=0.5, max_batch_elements=1e6)
    a = otdd.otdd_distance(X, L1, Y, L2, eps=0.5, tol=None, n_iters=3, label_weight=0.5)
    b = otdd.otdd_distance(
        X, L1, Y, L2, eps=0.5, tol=None, n_iters=3, label_weight=torch.tensor(0.5)
    )
    torch.testing.assert_close(a, b)


# ----- meta tensors -----


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, y: fs.sinkhorn(x, y, eps=0.5),
        lambda x, y: fs.ot_cost(x, y, eps=0.5),
        lambda x, y: fs.sinkhorn_divergence(x, y, eps=0.5),
        lambda x, y: fs.SamplesLoss()(x, y),
        lambda x, y: fs.hvp(x, y, torch.ones_like(x), eps=0.5),
    ],
    ids=["sinkhorn", "ot_cost", "sinkhorn_divergence", "SamplesLoss", "hvp"],
)
def test_meta_tensors_are_a_clear_error(fn):
    with pytest.raises(ValueError, match="x is a meta tensor"):
        fn(X.to("meta"), Y.to("meta"))


def test_meta_number_is_a_clear_error():
    with pytest.raises(ValueError, match="eps must be .*meta tensor"):
        _solve(eps=torch.tensor(0.5, device="meta"))


# ----- OTDD names the argument at fault -----


def test_otdd_names_the_dataset_with_nan():
    x1 = X.clone()
    x1[2, 1] = math.nan
    for fn in (otdd.class_distance_matrix, otdd.otdd_distance):
        with pytest.raises(ValueError, match="x1 must not contain NaN"):
            fn(x1, L1, Y, L2, eps=0.5)
        with pytest.raises(ValueError, match="x2 must not contain NaN"):
            fn(X, L1, x1[:7], L2, eps=0.5)


def test_otdd_names_the_weights_of_an_empty_class():
    a1 = torch.where(L1 == 1, 1.0, 0.0)
    a1 = a1 / a1.sum()
    for fn in (otdd.class_distance_matrix, otdd.otdd_distance):
        with pytest.raises(ValueError, match=r"a1 is zero on every point of classes \[0\] of l1"):
            fn(X, L1, Y, L2, eps=0.5, a1=a1)


def test_otdd_names_unequal_masses():
    with pytest.raises(ValueError, match="a1 and a2 must have the same total mass"):
        otdd.otdd_distance(X, L1, Y, L2, eps=0.5, a1=torch.full((9,), 0.5))
    with pytest.raises(ValueError, match="a2 must have a positive total mass"):
        otdd.otdd_distance(X, L1, Y, L2, eps=0.5, a2=torch.zeros(7))


# ----- a forced dense path checks its memory first -----


def test_forced_dense_path_checks_memory_before_allocating():
    # K would be 2e6 × 2e6 fp32 values (16 TB): refused with the bytes and the alternative,
    # before anything of size n·m exists (the test would not finish otherwise).
    x = torch.rand(2_000_000, 3)
    with pytest.raises(ValueError, match=r"16,000,000,000,000 bytes .*path='streaming'"):
        fs.sinkhorn(x, x, eps=0.5, path="dense", backend="triton")


def test_tuning_override_checks_its_values():
    from flashsinkhorn import tuning

    with pytest.raises(TypeError, match="plan_step must be a bool"):
        with tuning.override(plan_step="no"):
            pass
    with pytest.raises(ValueError, match="softmin_split must be >= 1"):
        with tuning.override(softmin_split=0):
            pass
    with pytest.raises(ValueError, match="prepare_path must be one of"):
        with tuning.override(prepare_path="cuda"):
            pass
    with tuning.override(softmin_split=np.int64(3), plan_step=np.bool_(False)) as t:
        assert t.softmin_split == 3 and t.plan_step is False
    assert tuning.TUNING.softmin_split is None and tuning.TUNING.plan_step is True
