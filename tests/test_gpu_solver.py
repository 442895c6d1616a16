"""CUDA: the Triton backend against the torch backend up to n = 20,000 (marker ``gpu``)."""

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import tuning
from flashsinkhorn.solvers import blocks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,d", [(1000, 3), (4097, 64), (20000, 3), (20000, 64), (10000, 512)])
@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
def test_triton_matches_torch_cuda(n, d, schedule):
    g = torch.Generator(device="cuda").manual_seed(n + d)
    x = torch.rand(n, d, device="cuda", generator=g)
    y = torch.rand(n + 3, d, device="cuda", generator=g)
    kw = dict(eps=0.1, n_iters=10, tol=None, schedule=schedule)
    ref = fs.sinkhorn(x.double(), y.double(), backend="torch", **kw)
    for precision, rtol in (("ieee", 1e-5), ("tf32x3", 1e-5), ("tf32", 2e-3)):
        out = fs.sinkhorn(x, y, backend="triton", precision=precision, **kw)
        assert out.backend == "triton"
        err = (out.value.double() - ref.value).abs() / ref.value.abs()
        assert err.item() <= rtol, (precision, err.item())
        if precision != "tf32":
            ferr = (out.f.double() - ref.f).abs().max() / ref.f.abs().max()
            assert ferr.item() <= 10 * rtol, (precision, ferr.item())


def test_batched_cuda_matches_loop():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(16, 1024, 3, device="cuda", generator=g)
    y = torch.rand(16, 1000, 3, device="cuda", generator=g)
    res = fs.sinkhorn(x, y, eps=0.05, n_iters=20, tol=None, precision="ieee")
    for k in (0, 7, 15):
        one = fs.sinkhorn(x[k], y[k], eps=0.05, n_iters=20, tol=None, precision="ieee")
        assert torch.allclose(res.f[k], one.f, atol=1e-5)


def test_converges_with_tolerance_cuda():
    x = torch.rand(5000, 16, device="cuda")
    y = torch.rand(6000, 16, device="cuda")
    res = fs.sinkhorn(x, y, eps=0.05, tol=1e-4, scaling=0.7)
    assert res.converged and res.marginal_error.item() <= 1e-4


def test_far_from_origin_cuda():
    x = torch.rand(3000, 8, device="cuda")
    y = torch.rand(3000, 8, device="cuda")
    near = fs.sinkhorn(x.double(), y.double(), eps=0.05, n_iters=50, tol=None)
    far = fs.sinkhorn(x + 1e3, y + 1e3, eps=0.05, n_iters=50, tol=None, precision="ieee")
    assert abs(far.value.item() - near.value.item()) <= 2e-3 * near.value.item()


def test_tf32_flag_restored():
    saved = torch.backends.cuda.matmul.allow_tf32
    x = torch.rand(300, 8, device="cuda")
    fs.sinkhorn(x, x + 0.1, eps=0.1, backend="torch", precision="tf32")
    assert torch.backends.cuda.matmul.allow_tf32 == saved


@pytest.mark.parametrize(
    "schedule,acceleration",
    [("alternating", "overrelax"), ("alternating", "none"), ("symmetric", "none")],
)
def test_tolerance_blocks_replayed_from_graphs_match_eager(schedule, acceleration):
    # With a tolerance on CUDA the blocks between two tests are replayed from a CUDA graph;
    # the solve must be the eager solve (same iterations, same plan up to rounding).
    g = torch.Generator().manual_seed(3)
    x = torch.rand(1537, 17, generator=g).cuda()
    y = torch.rand(1211, 17, generator=g).cuda()
    kw = dict(eps=0.01, tol=1e-4, n_iters=5000, schedule=schedule, acceleration=acceleration,
              scaling=None, precision="ieee")  # fmt: skip
    with tuning.override(tolerance_graphs=False):
        ref = fs.sinkhorn(x, y, **kw)
    before = blocks.stats()["replayed"]
    got = fs.sinkhorn(x, y, **kw)
    assert blocks.stats()["replayed"] > before
    assert got.converged and ref.converged
    assert float(got.marginal_error) <= 1e-4
    assert abs(got.n_iters - ref.n_iters) <= 10  # at most one test window apart
    assert abs(float(got.value) - float(ref.value)) <= 1e-5 * abs(float(ref.value))
