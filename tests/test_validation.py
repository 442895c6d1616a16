"""Bad input gets a ValueError/TypeError naming the argument, before any kernel runs."""

import math

import pytest
import torch

import flashsinkhorn as fs

X = torch.rand(10, 3)
Y = torch.rand(12, 3)


def call(x=X, y=Y, a=None, b=None, **kw):
    kw.setdefault("eps", 0.1)
    return fs.sinkhorn(x, y, a, b, **kw)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(x=torch.rand(10, 3), y=torch.rand(12, 4)), ValueError, "feature dimension"),
        (dict(x=torch.rand(2, 10, 3), y=torch.rand(3, 12, 3)), ValueError, "batch size"),
        (dict(x=torch.rand(2, 10, 3), y=torch.rand(12, 3)), ValueError, "both be 2-D"),
        (dict(x=torch.rand(10)), ValueError, "x must be 2-D"),
        (dict(y=torch.rand(1, 2, 3, 4)), ValueError, "y must be 2-D"),
        (dict(x=torch.rand(0, 3)), ValueError, "x must not be empty"),
        (dict(y=torch.rand(12, 0)), ValueError, "y must not be empty"),
        (dict(x=torch.ones(10, 3, dtype=torch.int64)), TypeError, "x must have a real floating"),
        (
            dict(y=torch.ones(12, 3, dtype=torch.complex64)),
            TypeError,
            "y must have a real floating",
        ),
        (dict(x=[[0.0, 1.0]]), TypeError, "x must be a torch.Tensor"),
        (dict(x=X.double()), TypeError, "same dtype"),
        (dict(eps=0.0), ValueError, "eps must be finite and > 0"),
        (dict(eps=-1.0), ValueError, "eps must be finite and > 0"),
        (dict(eps=math.inf), ValueError, "eps must be finite"),
        (dict(eps=math.nan), ValueError, "eps must be finite"),
        (dict(eps="0.1"), TypeError, "eps must be"),
        (dict(a=-torch.ones(10) / 10), ValueError, "a must be non-negative"),
        (dict(b=torch.full((12,), math.nan)), ValueError, "b must be finite"),
        (dict(a=torch.ones(11) / 11), ValueError, "a must have shape"),
        (dict(b=torch.ones(2, 12) / 12), ValueError, "b must have shape"),
        (dict(a=torch.zeros(10)), ValueError, "a must have a positive total mass"),
        (dict(a=torch.ones(10, dtype=torch.int32)), TypeError, "a must have a real floating"),
        (dict(a=torch.ones(10) / 5), ValueError, "equal total mass"),
        (dict(x=torch.full((10, 3), math.nan)), ValueError, "x must not contain NaN"),
        (dict(y=torch.full((12, 3), math.inf)), ValueError, "y must not contain NaN"),
        (dict(schedule="jacobi"), ValueError, "schedule must be one of"),
        (dict(backend="keops"), ValueError, "backend must be one of"),
        (dict(precision="fp8"), ValueError, "precision must be one of"),
        (dict(n_iters=0), ValueError, "n_iters must be >= 1"),
        (dict(n_iters=2.5), TypeError, "n_iters must be an int"),
        (dict(tol=-1e-3), ValueError, "tol must be finite and > 0"),
        (dict(check_every=0), ValueError, "check_every must be >= 1"),
        (dict(scaling=1.5), ValueError, "scaling must be in"),
        (dict(scaling=0.0), ValueError, "scaling must be finite and > 0"),
        (dict(diameter=-2.0), ValueError, "diameter must be finite and > 0"),
        (dict(rho_x=0.0), ValueError, "rho_x must be finite and > 0"),
        (dict(rho_y=-1.0), ValueError, "rho_y must be finite and > 0"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        call(**kwargs)


def test_unequal_mass_is_fine_when_unbalanced():
    res = call(a=torch.ones(10) / 5, rho_x=1.0, rho_y=1.0)
    assert torch.isfinite(res.value)


def test_triton_refuses_float64():
    with pytest.raises(ValueError, match="backend='triton' supports"):
        call(x=X.double(), y=Y.double(), backend="triton")


def test_weight_shapes_accepted():
    a = torch.ones(10) / 10
    r1 = call(a=a)
    r2 = call(a=a[:, None])
    assert torch.equal(r1.value, r2.value)
    xb, yb = X.expand(2, 10, 3), Y.expand(2, 12, 3)
    r3 = fs.sinkhorn(xb, yb, a, None, eps=0.1)  # shared (n,) weights for a batch
    assert r3.value.shape == (2,)


def _poisoned(t, value, where=(3, 1)):
    t = t.clone()
    t[where] = value
    return t


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(x=_poisoned(X, math.nan)), "x must not contain NaN"),
        (dict(y=_poisoned(Y, math.inf)), "y must not contain NaN"),
        (dict(x=_poisoned(X, -math.inf), y=_poisoned(Y, math.nan)), "x must not contain NaN"),
        # a huge finite coordinate next to an infinite one: the centred maximum is not finite
        (dict(x=_poisoned(X, 3e38), y=_poisoned(Y, math.inf)), "y must not contain NaN"),
        (dict(x=_poisoned(X, math.nan), a=torch.ones(10) / 10), "x must not contain NaN"),
        (dict(a=-torch.ones(10) / 10, y=_poisoned(Y, math.nan)), "a must be non-negative"),
        (dict(b=torch.ones(12) / 6), "equal total mass"),
        (dict(a=torch.zeros(10), b=torch.ones(12) / 12), "a must have a positive total mass"),
    ],
)
def test_value_checks_every_precision(kwargs, match, precision):
    # The checks share one synchronisation; with "tf32"/"tf32x3" the points' finiteness is read
    # from the operand scale's reduction (problem.prepare). Each path must still name the input.
    with pytest.raises(ValueError, match=match):
        call(precision=precision, backend="torch", **kwargs)


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_uniform_weights_skip_checks_but_not_zero_weights(precision):
    # None weights are built uniform (no checks needed); given weights with zeros still mark
    # the side as having null points, which changes nothing in the value.
    a = torch.ones(10) / 10
    a0 = a.clone()
    a0[0] = 0.0
    a0 = a0 / a0.sum()
    r_none = call(precision=precision, backend="torch")
    r_given = call(a=a, precision=precision, backend="torch")
    assert torch.allclose(r_none.value, r_given.value, rtol=1e-6, atol=0)
    r_zero = call(a=a0, precision=precision, backend="torch")
    assert torch.isfinite(r_zero.value) and r_zero.solution.problem.X.has_null
    assert not r_none.solution.problem.X.has_null
