"""The entry points under torch.autocast: autocast's float32-op behaviour (``_boundary.py``).

Half inputs produced under autocast are cast to float32 and the solve runs with autocast off,
so a call under autocast gives exactly what the same call gives without it on the float32
inputs; float32 inputs are unaffected. CPU bfloat16 here; CUDA float16/bfloat16 under ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

import flashsinkhorn as fs

CALLS = {
    "ot_cost": lambda x, y: fs.ot_cost(x, y, eps=0.1),
    "sinkhorn_divergence": lambda x, y: fs.sinkhorn_divergence(x, y, eps=0.1, scaling=0.7),
    "SamplesLoss": lambda x, y: fs.SamplesLoss(blur=0.3)(x, y),
    "SinkhornDivergence": lambda x, y: fs.SinkhornDivergence(eps=0.1, rho_x=1.0, rho_y=1.0)(x, y),
    # (elementwise ops: autocast leaves them in the inputs' dtype)
    "solve": lambda x, y: fs.solve(((x[:, :, None] - y[:, None]) ** 2).sum(-1), eps=0.1).value,
}


def data(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 37, 8, generator=g)
    y = torch.randn(2, 29, 8, generator=g) + 0.2
    return x.to(device), y.to(device)


def value_and_grad(call, x, y):
    x = x.clone().requires_grad_()
    v = call(x, y)
    v.sum().backward()
    return v.detach(), x.grad


@pytest.mark.parametrize("name", list(CALLS))
def test_float32_inputs_give_the_same_numbers_under_autocast(name):
    x, y = data()
    ref = value_and_grad(CALLS[name], x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = value_and_grad(CALLS[name], x, y)  # backward inside the region too
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=0, atol=0)  # the same operations


def test_without_the_boundary_autocast_would_change_the_value():
    # The check above can fail: autocast really does lower the solver's matmuls here.
    from flashsinkhorn.backends.torch_ref import scores
    from flashsinkhorn.problem import prepare

    x, y = data()
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="ieee")
    plain = scores(p.X.x, p.Y, torch.zeros_like(p.Y.sq), 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = scores(p.X.x, p.Y, torch.zeros_like(p.Y.sq), 0.1)
    assert low.dtype == torch.bfloat16 and (low.float() - plain).abs().max() > 1e-2


@pytest.mark.parametrize("name", list(CALLS))
def test_half_model_output_is_cast_to_float32(name):
    x, y = data(seed=1)
    lin = torch.nn.Linear(8, 8)

    def run(cast_outside):
        lin.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = lin(x)  # bfloat16 under autocast, y stays float32
            assert z.dtype == torch.bfloat16
            v = None if cast_outside else CALLS[name](z, y)
        if cast_outside:
            v = CALLS[name](z.float(), y)
        v.sum().backward()
        return v.detach(), lin.weight.grad.clone()

    (v, gw), (v_ref, gw_ref) = run(False), run(True)
    assert v.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)
    torch.testing.assert_close(gw, gw_ref, rtol=0, atol=0)
    # Not garbage: within bfloat16's rounding of the model output of the float32 model.
    with torch.no_grad():
        v32 = CALLS[name](lin(x), y)
    torch.testing.assert_close(v, v32, rtol=3e-2, atol=3e-2)


def test_result_methods_under_autocast():
    x, y = data(seed=2)
    res = fs.sinkhorn(x, y, eps=0.1)
    V = torch.randn(2, 29, 3)
    ref = (res.apply(V), res.plan(), res.barycentric_map(), res.marginals()[0])
    Vh = V.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res_ac = fs.sinkhorn(x.bfloat16(), y, eps=0.1)  # cast up: the same float32 solve
        got = (res.apply(V), res.plan(), res.barycentric_map(), res.marginals()[0])
        got_h = res.apply(Vh)
    torch.testing.assert_close(res_ac.value, fs.sinkhorn(x.bfloat16().float(), y, eps=0.1).value)
    torch.testing.assert_close(got_h, res.apply(Vh.float()), rtol=0, atol=0)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_half_inputs_outside_autocast_keep_their_dtype_rules():
    x, y = data()
    with pytest.raises(TypeError, match="x and y must have the same dtype"):
        fs.ot_cost(x.bfloat16(), y, eps=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        v = fs.ot_cost(x.bfloat16(), y, eps=0.1)  # promoted: autocast chose the dtype
    assert v.dtype == torch.float32
    assert torch.is_autocast_enabled("cpu") is False  # the region's state was restored


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(CALLS))
def test_cuda_autocast(name, dtype):
    x, y = data("cuda", seed=3)
    lin = torch.nn.Linear(8, 8).cuda()
    with torch.autocast("cuda", dtype=dtype):
        z = lin(x)
        assert z.dtype == dtype
        v = CALLS[name](z, y)
    v.sum().backward()
    with torch.no_grad():
        ref = CALLS[name](z.float(), y)  # the float32 solve of the same rounded outputs
        v32 = CALLS[name](lin(x), y)
    assert v.dtype == torch.float32 and torch.isfinite(lin.weight.grad).all()
    torch.testing.assert_close(v, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, v32, rtol=3e-2, atol=3e-2)
