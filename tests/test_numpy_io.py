"""NumPy in, NumPy out for sinkhorn and solve (a POT user's habit): same numbers as the
tensor call, the arrays' dtype kept, mixed array kinds refused naming the argument."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn._numpy import NumpyResult

rng = np.random.default_rng(5)
XN = rng.random((31, 3))
YN = rng.random((23, 3)) + 0.3
AN = rng.random(31) + 0.1
AN /= AN.sum()
CN = ((XN[:, None] - YN[None]) ** 2).sum(-1)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sinkhorn_numpy_matches_tensors_and_keeps_dtype(dtype):
    x, y, a = XN.astype(dtype), YN.astype(dtype), AN.astype(dtype)
    before = [v.copy() for v in (x, y, a)]
    res = fs.sinkhorn(x, y, a, eps=0.05)
    ref = fs.sinkhorn(torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(a), eps=0.05)
    assert isinstance(res, NumpyResult) and isinstance(res, fs.SinkhornResult)
    for got, want in ((res.f, ref.f), (res.g, ref.g)):
        assert type(got) is np.ndarray and got.dtype == dtype
        np.testing.assert_array_equal(got, want.numpy())
    assert type(res.value) is dtype and res.value == float(ref.value)
    assert type(res.marginal_error) is dtype
    ra, rb = res.marginals()
    assert type(ra) is np.ndarray and ra.dtype == dtype and rb.shape == (23,)
    np.testing.assert_array_equal(ra, ref.marginals()[0].numpy())
    v = rng.random((23, 2)).astype(dtype)
    np.testing.assert_array_equal(res.apply(v), ref.apply(torch.from_numpy(v)).numpy())
    u = rng.random(31).astype(dtype)
    np.testing.assert_array_equal(res.apply_T(u), ref.apply_T(torch.from_numpy(u)).numpy())
    np.testing.assert_array_equal(res.plan(), ref.plan().numpy())
    np.testing.assert_array_equal(res.barycentric_map(), ref.barycentric_map().numpy())
    assert res.converged and res.errors == ref.errors and res.n_iters == ref.n_iters
    for b, v in zip(before, (x, y, a), strict=True):  # nothing the caller owns is modified
        np.testing.assert_array_equal(b, v)


def test_solve_numpy_matches_tensors():
    res = fs.solve(CN, AN, eps=0.05)
    ref = fs.solve(torch.from_numpy(CN), torch.from_numpy(AN), eps=0.05)
    assert type(res.value) is np.float64 and res.value == pytest.approx(float(ref.value))
    np.testing.assert_array_equal(res.f, ref.f.numpy())
    assert res.plan().shape == (31, 23)


def test_batched_numpy_gives_arrays_of_values():
    xb = np.stack([XN, 2 * XN])
    res = fs.sinkhorn(xb, np.stack([YN, YN]), eps=0.05)
    assert res.value.shape == (2,) and res.value.dtype == np.float64
    assert res.marginal_error.shape == (2,) and res.f.shape == (2, 31)
    assert "value=[2 values in" in repr(res)


def test_read_only_arrays_are_accepted_without_warnings():
    x, y = XN.copy(), YN.copy()
    x.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = fs.sinkhorn(x, y, eps=0.05)
    assert res.converged


def test_labels_and_feature_map_as_numpy():
    lx, ly = np.arange(31) % 2, np.arange(23) % 3
    W = rng.random((3, 3))
    res = fs.sinkhorn(XN, YN, eps=0.05, label_x=lx, label_y=ly, label_cost=W,
                      feature_map=np.array([1.0, 2.0, 0.5]))  # fmt: skip
    ref = fs.sinkhorn(torch.from_numpy(XN), torch.from_numpy(YN), eps=0.05,
                      label_x=torch.from_numpy(lx), label_y=torch.from_numpy(ly),
                      label_cost=torch.from_numpy(W),
                      feature_map=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64))  # fmt: skip
    assert res.value == pytest.approx(float(ref.value), rel=1e-12)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: fs.sinkhorn(XN, torch.from_numpy(YN), eps=0.1), "y"),
        (lambda: fs.sinkhorn(XN, YN, torch.from_numpy(AN), eps=0.1), "a"),
        (lambda: fs.sinkhorn(torch.from_numpy(XN), YN, eps=0.1), "y"),
        (
            lambda: fs.sinkhorn(
                torch.from_numpy(XN), torch.from_numpy(YN), b=np.ones(23) / 23, eps=0.1
            ),
            "b",
        ),
        (
            lambda: fs.sinkhorn(
                XN,
                YN,
                eps=0.1,
                label_x=torch.zeros(31, dtype=torch.long),
                label_y=np.zeros(23, int),
                label_cost=np.ones((1, 1)),
            ),
            "label_x",
        ),
        (lambda: fs.solve(CN, torch.from_numpy(AN), eps=0.1), "a"),
        (lambda: fs.solve(torch.from_numpy(CN), AN, eps=0.1), "a"),
    ],
)
def test_mixed_numpy_and_torch_is_a_type_error_naming_the_argument(call, name):
    with pytest.raises(TypeError, match=rf"^{name} is a (torch\.Tensor|NumPy array) while"):
        call()


def test_bad_numpy_arrays_name_the_argument():
    with pytest.raises(TypeError, match="^x must have a real floating dtype"):
        fs.sinkhorn(XN.astype(int), YN, eps=0.1)
    with pytest.raises(TypeError, match="^x must be a numeric array"):
        fs.sinkhorn(np.array([["a", "b", "c"]]), YN, eps=0.1)
    with pytest.raises(ValueError, match="^C must"):
        fs.solve(np.ones(5), eps=0.1)
    res = fs.sinkhorn(XN, YN, eps=0.1)
    with pytest.raises(TypeError, match="^V must be a NumPy array"):
        res.apply(torch.ones(23, dtype=torch.float64))
