"""CUDA: OTDD on the Triton kernels against the float64 torch backend (marker ``gpu``)."""

import math

import pytest
import torch

from flashsinkhorn.otdd import class_distance_matrix, otdd_distance

pytestmark = pytest.mark.gpu


def _dataset(n, d, classes, seed, shift=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    centres = 2.0 * torch.randn(classes, d, device="cuda", generator=g) / math.sqrt(d)
    l = torch.randint(0, classes, (n,), device="cuda", generator=g)
    l[:classes] = torch.arange(classes, device="cuda")  # every class present
    x = centres[l] + torch.randn(n, d, device="cuda", generator=g) / math.sqrt(d) + shift
    return x, l


@pytest.mark.parametrize("d", [3, 64, 300])
def test_class_distance_matrix_triton_matches_torch(d):
    # Ragged classes (random labels), 6 + 5 classes, chunked batches on the Triton side.
    x1, l1 = _dataset(1500, d, 6, 1)
    x2, l2 = _dataset(1100, d, 5, 2, shift=0.1)
    kw = dict(eps=0.1, n_iters=20, tol=None)
    ref = class_distance_matrix(x1.double(), l1, x2.double(), l2, backend="torch", **kw)
    W = class_distance_matrix(
        x1, l1, x2, l2, backend="triton", precision="ieee", max_batch_elements=1 << 16, **kw
    )
    assert W.shape == (11, 11) and W.dtype == torch.float32
    assert torch.equal(W, W.T) and torch.equal(W.diagonal(), torch.zeros(11, device="cuda"))
    err = ((W.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
    assert err <= 1e-4, err


@pytest.mark.parametrize("n", [1000, 5003])
def test_otdd_distance_triton_matches_torch(n):
    x1, l1 = _dataset(n, 64, 10, 3)
    x2, l2 = _dataset(n + 17, 64, 10, 4, shift=0.05)
    W = class_distance_matrix(x1, l1, x2, l2, eps=0.1, tol=1e-4)
    kw = dict(eps=0.1, n_iters=30, tol=None, label_cost=W, feature_weight=0.5, label_weight=0.5)
    x64 = x1.double().requires_grad_(True)
    ref = otdd_distance(x64, l1, x2.double(), l2, backend="torch", **kw)
    (gref,) = torch.autograd.grad(ref, x64)
    for precision, rtol in (("ieee", 1e-5), ("tf32", 2e-3)):
        x32 = x1.clone().requires_grad_(True)
        val = otdd_distance(x32, l1, x2, l2, backend="triton", precision=precision, **kw)
        (g,) = torch.autograd.grad(val, x32)
        assert abs(val.item() - ref.item()) <= rtol * abs(ref.item()), (precision, val, ref)
        gerr = ((g.double() - gref).norm() / gref.norm()).item()
        assert gerr <= 10 * rtol, (precision, gerr)


def test_otdd_distance_memory_60k_d512():
    # Paper H.3: n = 60,000, d = 512, 10 classes each, W given. Memory beyond the inputs
    # stays O((n + m) d): well under 1 GB (a dense n × n fp32 matrix alone is 13.4 GiB).
    n, d = 60_000, 512
    x1, l1 = _dataset(n, d, 10, 5)
    x2, l2 = _dataset(n, d, 10, 6, shift=0.05)
    W = torch.rand(20, 20, device="cuda")
    W = (W + W.T).fill_diagonal_(0)
    kw = dict(eps=0.1, n_iters=10, tol=None, label_cost=W, feature_weight=0.5, label_weight=0.5)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        val = otdd_distance(x1, l1, x2, l2, **kw)
    torch.cuda.synchronize()
    work = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(val)
    assert work < 2**30, work / 2**20


def test_class_distance_matrix_chunking_cuda():
    x1, l1 = _dataset(3000, 32, 8, 7)
    x2, l2 = _dataset(2000, 32, 4, 8)
    kw = dict(eps=0.1, n_iters=15, tol=None, precision="ieee")
    whole = class_distance_matrix(x1, l1, x2, l2, max_batch_elements=1 << 30, **kw)
    parts = class_distance_matrix(x1, l1, x2, l2, max_batch_elements=1, **kw)
    assert torch.allclose(whole, parts, rtol=1e-5, atol=1e-6)
