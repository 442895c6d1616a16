"""CUDA numerics (marker ``gpu``): determinism, compiled half precision end to end, small eps.

The CPU suite covers the same properties on the torch backend and under the Triton
interpreter; these run the compiled kernels, whose reductions and dot instructions differ.
"""

import pytest
import torch

import flashsinkhorn as fs

pytestmark = pytest.mark.gpu


def _clouds(n, m, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(n, d, device="cuda", generator=g)
    y = torch.rand(m, d, device="cuda", generator=g) + 0.25
    return x, y


@pytest.mark.parametrize("n,d", [(3000, 3), (20000, 64), (6000, 512)])
def test_same_inputs_same_bits(n, d):
    # Split sweeps merge their partials in a fixed order: no atomics, so reruns are bitwise equal.
    x, y = _clouds(n, n + 17, d, seed=n + d)
    kw = dict(eps=0.1, n_iters=15, tol=None)
    r1 = fs.sinkhorn(x, y, **kw)
    r2 = fs.sinkhorn(x, y, **kw)
    assert torch.equal(r1.f, r2.f) and torch.equal(r1.g, r2.g)
    xg = x.clone().requires_grad_(True)
    (gx1,) = torch.autograd.grad(fs.sinkhorn_divergence(xg, y, eps=0.1, n_iters=15, tol=None), xg)
    (gx2,) = torch.autograd.grad(fs.sinkhorn_divergence(xg, y, eps=0.1, n_iters=15, tol=None), xg)
    assert torch.equal(gx1, gx2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_points_end_to_end(dtype):
    # Half points are read as they are (fp32 accumulation): the solve must match a float64
    # solve of the same (rounded) points to fp32 round-off, and the gradient keep the dtype.
    x, y = _clouds(5000, 4001, 16, seed=3)
    xh, yh = x.to(dtype), y.to(dtype)
    kw = dict(eps=0.05, n_iters=30, tol=None)
    res = fs.sinkhorn(xh, yh, **kw)
    ref = fs.sinkhorn(xh.double(), yh.double(), backend="torch", **kw)
    assert res.backend == "triton" and res.f.dtype == torch.float32
    # The solver centres in fp32 and rounds the centred points back to the input dtype once.
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert abs(res.value.item() - ref.value.item()) <= 4 * unit * ref.value.abs().item()
    xg = xh.clone().requires_grad_(True)
    loss = fs.sinkhorn_divergence(xg, yh, **kw)
    (gx,) = torch.autograd.grad(loss, xg)
    assert gx.dtype == dtype and torch.isfinite(gx.float()).all()
    x64 = xh.double().requires_grad_(True)
    (g64,) = torch.autograd.grad(
        fs.sinkhorn_divergence(x64, yh.double(), backend="torch", **kw), x64
    )
    rel = (gx.double() - g64).norm() / g64.norm()
    assert rel.item() <= 20 * unit, rel.item()


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_small_eps_no_nan(precision):
    # eps down to 1e-3 of the squared diameter, fp32 on the GPU.
    x, y = _clouds(4000, 4500, 8, seed=11)
    diam2 = float(torch.cdist(torch.cat([x, y]).min(0, keepdim=True).values,
                              torch.cat([x, y]).max(0, keepdim=True).values)) ** 2  # fmt: skip
    res = fs.sinkhorn(x, y, eps=1e-3 * diam2, n_iters=300, tol=None, scaling=0.8,
                      precision=precision)  # fmt: skip
    assert torch.isfinite(res.f).all() and torch.isfinite(res.g).all()
    assert torch.isfinite(res.value) and res.value.item() > 0
    xg = x.clone().requires_grad_(True)
    loss = fs.sinkhorn_divergence(xg, y, eps=1e-3 * diam2, n_iters=300, tol=None, scaling=0.8)
    (gx,) = torch.autograd.grad(loss, xg)
    assert torch.isfinite(gx).all() and loss.item() >= 0
