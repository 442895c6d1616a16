"""mHC arguments: the projection and both layers check their inputs like the OT API (bools
and floats are not integers, numbers are finite, shapes are exact), and the projection refuses
logits it cannot project instead of returning NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashsinkhorn.mhc import (
    HyperConnection,
    HyperConnectionReference,
    sinkhorn_knopp,
    sinkhorn_knopp_reference,
)

LAYERS = [HyperConnection, HyperConnectionReference]


@pytest.mark.parametrize("cls", LAYERS)
@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(dim=True), TypeError, "dim must be an int"),
        (dict(dim=4.0), TypeError, "dim must be an int"),
        (dict(dim=0), ValueError, "dim must be >= 1"),
        (dict(n_streams=True), TypeError, "n_streams must be an int"),
        (dict(n_streams=2.0), TypeError, "n_streams must be an int"),
        (dict(n_iters=False), TypeError, "n_iters must be an int"),
        (dict(variant="exp"), ValueError, "variant must be one of"),
        (dict(eps=math.nan), ValueError, "eps must be finite and >= 0"),
        (dict(eps=-1e-6), ValueError, "eps must be finite and >= 0"),
        (dict(eps="a"), TypeError, "eps must be a finite number"),
        (dict(rms_eps=math.nan), ValueError, "rms_eps must be finite and > 0"),
        (dict(rms_eps=math.inf), ValueError, "rms_eps must be finite and > 0"),
        (dict(rms_eps=0.0), ValueError, "rms_eps must be finite and > 0"),
        (dict(alpha_init=math.inf), ValueError, "alpha_init must be finite"),
        (dict(alpha_init=math.nan), ValueError, "alpha_init must be finite"),
        (dict(alpha_init=True), TypeError, "alpha_init must be a finite number"),
        (dict(dtype=torch.int64), TypeError, "dtype must be a floating torch.dtype"),
    ],
)
def test_layer_arguments(cls, kw, exc, match):
    with pytest.raises(exc, match=match):
        cls(**{"dim": 4, "n_streams": 2, **kw})


@pytest.mark.parametrize("cls", LAYERS)
def test_layer_accepts_numpy_and_0d_tensor_numbers(cls):
    layer = cls(np.int64(4), torch.tensor(2), n_iters=np.int32(3), alpha_init=np.float32(0.1))
    assert (layer.dim, layer.n_streams, layer.n_iters) == (4, 2, 3)
    assert all(type(v) is int for v in (layer.dim, layer.n_streams, layer.n_iters))
    assert layer.alpha_pre.item() == pytest.approx(0.1)


def _layer(cls, backend):
    torch.manual_seed(0)
    kw = {} if cls is HyperConnectionReference else {"backend": backend}
    return cls(5, 2, n_iters=3, **kw)


CASES = [(HyperConnectionReference, None), (HyperConnection, "torch"), (HyperConnection, "triton")]


@pytest.mark.parametrize("cls,backend", CASES, ids=["reference", "torch", "triton"])
@pytest.mark.parametrize(
    "branch,exc,match",
    [
        (lambda u: u[..., :1], ValueError, r"branch output must have shape \(3, 5\).*got \(3, 1\)"),
        (lambda u: u[:1], ValueError, r"branch output must have shape \(3, 5\).*got \(1, 5\)"),
        (lambda u: u.sum(), ValueError, r"branch output must have shape \(3, 5\).*got \(\)"),
        (lambda u: None, TypeError, "branch output must be a floating torch.Tensor"),
        (lambda u: u.long(), TypeError, "branch output must be a floating torch.Tensor"),
    ],
)
def test_branch_of_the_wrong_shape_is_refused(cls, backend, branch, exc, match, device):
    # A (3, 1) or (1, 5) output used to broadcast into every stream of every token.
    layer = _layer(cls, backend).to(device)
    x = torch.randn(3, 2, 5, device=device)
    with pytest.raises(exc, match=match):
        layer(x, branch)


@pytest.mark.parametrize("cls,backend", CASES, ids=["reference", "torch", "triton"])
def test_branch_of_the_right_shape_runs(cls, backend, device):
    layer = _layer(cls, backend).to(device)
    x = torch.randn(3, 2, 5, device=device)
    out = layer(x, lambda u: 2.0 * u)
    assert out.shape == x.shape and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("cls", LAYERS)
def test_layer_input_on_another_device(cls):
    layer = cls(4, 2)
    with pytest.raises(ValueError, match="x must be on the device of the layer's parameters"):
        layer(torch.randn(3, 2, 4, device="meta"))


def test_triton_layer_without_cuda_or_interpreter(monkeypatch):
    layer = HyperConnection(4, 2, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        layer(torch.randn(3, 2, 4))
    with pytest.raises(TypeError, match="backend='triton' supports x of dtype"):
        HyperConnection(4, 2, backend="triton", dtype=torch.float64)(
            torch.randn(3, 2, 4, dtype=torch.float64)
        )


# ----- the projection -----


def test_projection_triton_without_cuda_or_interpreter(monkeypatch):
    # Triton itself said "0 active drivers"; the OT API's message and exception instead.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors .*got logits on"):
        sinkhorn_knopp(torch.zeros(2, 3, 3), backend="triton")


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(eps="a"), TypeError, "eps must be a finite number >= 0"),
        (dict(eps=math.nan, variant="deepseek"), ValueError, "eps must be finite and >= 0"),
        (dict(eps=math.inf, variant="deepseek"), ValueError, "eps must be finite and >= 0"),
        (dict(eps=True), TypeError, "eps must be a finite number"),
        (dict(n_iters=np.float64(3.0)), TypeError, "n_iters must be an int"),
        (dict(check_finite="yes"), TypeError, "check_finite must be a bool"),
        (dict(backend=None), ValueError, "backend must be one of"),
    ],
)
def test_projection_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        sinkhorn_knopp(torch.zeros(2, 3, 3), **kw)


def test_projection_reference_arguments():
    with pytest.raises(TypeError, match="eps must be a finite number"):
        sinkhorn_knopp_reference(torch.zeros(2, 3, 3), eps="a")
    with pytest.raises(TypeError, match="n_iters must be an int"):
        sinkhorn_knopp_reference(torch.zeros(2, 3, 3), n_iters=True)


@pytest.mark.parametrize("shape", [(3, 0, 0), (0, 0), (2, 1, 0)])
def test_empty_matrices_are_refused(shape):
    with pytest.raises(ValueError, match=r"\(\.\.\., n, n\) with n >= 1"):
        sinkhorn_knopp(torch.zeros(shape))


def test_empty_batch_is_fine():
    assert sinkhorn_knopp(torch.zeros(0, 3, 3)).shape == (0, 3, 3)


def test_numpy_and_tensor_numbers():
    m = torch.randn(4, 3, 3)
    ref = sinkhorn_knopp(m, 7, variant="deepseek", eps=1e-3)
    for n_iters, eps in ((np.int64(7), np.float32(1e-3)), (torch.tensor(7), torch.tensor(1e-3))):
        out = sinkhorn_knopp(m, n_iters, variant="deepseek", eps=eps)
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "where,value,match",
    [
        ((0, 1, 2), math.inf, r"NaN or \+inf"),
        ((1, 0, 0), math.nan, r"NaN or \+inf"),
        ((0, slice(None), 1), -math.inf, "a column of -inf"),
        ((1, 2, slice(None)), -math.inf, "a row of -inf"),
    ],
)
def test_logits_without_a_projection_are_refused(backend, where, value, match, device):
    # +inf used to come back as NaN; a zero row or column cannot be normalised either.
    m = torch.randn(2, 3, 3, device=device)
    m[where] = value
    with pytest.raises(ValueError, match=match):
        sinkhorn_knopp(m, backend=backend)
    assert bool(torch.isnan(sinkhorn_knopp(m, backend=backend, check_finite=False)).any())


def test_minus_inf_entries_are_zeros(device):
    m = torch.randn(2, 3, 3, device=device)
    m[0, 0, 1] = -math.inf
    p = sinkhorn_knopp(m, 30)
    assert p[0, 0, 1] == 0 and bool(torch.isfinite(p).all())
    torch.testing.assert_close(p.sum(-2), torch.ones(2, 3, device=device))


def test_meta_logits_give_meta_shapes():
    out = sinkhorn_knopp(torch.zeros(2, 3, 3, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3, 3)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_streams=0), "num_streams must be >= 1"),
        (dict(num_streams=True), "num_streams must be an int"),
        (dict(sinkhorn_iters=0), "sinkhorn_iters must be >= 1"),
        (dict(num_streams=8, backend="triton"), "supports num_streams <= 7"),
    ],
)
def test_split_layer_errors_name_its_own_arguments(kw, match):
    # SplitHyperConnection calls the counts num_streams and sinkhorn_iters: its errors must
    # not name HyperConnection's n_streams / n_iters, which its caller never passed.
    from flashsinkhorn.mhc import SplitHyperConnection

    with pytest.raises((ValueError, TypeError), match=match):
        SplitHyperConnection(8, **kw)
