"""flashsinkhorn.distributed on two GPUs (NCCL), compiled Triton kernels.

The CPU tests run the same checks on gloo ranks and the Triton interpreter; these run them
where the library is meant to run: the paired launch and the shards' float16 wire formats
compiled, the large-eps merge in float32 on the GPU, and an error on one rank raised on both
without a hang (NCCL collectives). Needs two CUDA devices.
"""

from __future__ import annotations

import os

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import distributed as fsd

from .dist_harness import entries, expect_error, run_job, shard

pytestmark = pytest.mark.gpu

SX, SY = [700, 1300], [1100, 900]


def _data(seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SX), 16, generator=gen, dtype=torch.float64)
    y = 0.8 * torch.randn(sum(SY), 16, generator=gen, dtype=torch.float64) + 0.3
    return x.to(dtype), y.to(dtype)


def _rel(u, v):
    u, v = u.detach().double().cpu(), v.detach().double().cpu()
    return float((u - v).abs().max() / v.abs().max())


def _kernels(rank, world, *, mode, precision, eps):
    dev = torch.device("cuda", rank)
    x, y = _data(1)
    kw = dict(eps=eps, tol=None, n_iters=5, precision=precision)
    # the plan step, which the shards run on their blocks (d = 16: the two-sweep step on both)
    ref = fs.sinkhorn(x.to(dev), y.to(dev), **kw)
    res = fsd.sinkhorn(shard(x, SX, rank).to(dev), shard(y, SY, rank).to(dev), mode=mode, **kw)
    x64, y64 = x.double().to(dev), y.double().to(dev)
    ref64 = fs.sinkhorn(x64, y64, backend="torch", tol=None, n_iters=5, eps=eps)
    return {
        "f": _rel(res.f, shard(ref.f, SX, rank)),
        "value": _rel(res.value, ref.value),
        "value_vs_float64": _rel(res.value, ref64.value),
    }


def _failure(rank, world):
    dev = torch.device("cuda", rank)
    x, y = _data(2)
    xl, yl = shard(x, SX, rank).to(dev), shard(y, SY, rank).to(dev)
    bad = xl.clone()
    bad[3, 0] = float("nan")
    out = {
        "nan_ring_divergence": expect_error(
            lambda: fsd.sinkhorn_divergence(bad if rank == 1 else xl, yl, eps=0.5, mode="ring")
        )
    }
    res = fsd.sinkhorn(xl, yl, eps=0.5, tol=None, n_iters=3)
    out["after"] = float(res.value)
    return out


def _checks(world):
    checks = {}
    for mode in ("gather", "ring"):
        for precision in ("ieee", "tf32", "tf32x3"):
            checks[f"kernels_{mode}_{precision}"] = dict(
                fn=_kernels, mode=mode, precision=precision, eps=0.5
            )
        # ieee: the float16 grid would perturb the points by 2^-11 against float64
        checks[f"large_{mode}"] = dict(fn=_kernels, mode=mode, precision="ieee", eps=1e7)
    checks["failure"] = dict(fn=_failure)
    return checks


@pytest.fixture(scope="module")
def job():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    return 2, run_job(2, _checks, backend="nccl")


@pytest.mark.parametrize("name", [k for k in _checks(2) if k.startswith("kernels_")])
def test_compiled_kernels_on_shards(job, name):
    for r in entries(job, name):
        # potentials and value to float32 sums (the centre's order: tf32 grid, 2^-11)
        tol = 1e-6 if name.endswith("ieee") else 1e-4
        assert r["f"] < tol and r["value"] < tol, r


@pytest.mark.parametrize("mode", ["gather", "ring"])
def test_large_eps_on_gpus(job, mode):
    for r in entries(job, f"large_{mode}"):
        assert r["value_vs_float64"] < 2e-6 and r["f"] < 1e-6, r


def test_error_on_one_gpu_raises_on_both(job):
    rows = entries(job, "failure")
    messages = {r["nan_ring_divergence"] for r in rows}
    assert len(messages) == 1, messages
    msg = messages.pop()
    assert msg.startswith("ValueError: x_local must not contain NaN or inf (on rank 1 of the 2"), (
        msg
    )
    assert rows[0]["after"] == rows[1]["after"]
