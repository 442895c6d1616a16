"""The paired soft-min launch (backends/triton/pair.py) against two single soft-mins.

Two half-steps with their own rows and columns (as a sharded problem's x rows against some y
columns and y rows against some x columns) in one grid must give what two ``softmin`` launches
give: the same row sweep, so the same numbers up to the order of the column-chunk merge.
Runs under the Triton interpreter without a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flashsinkhorn import tuning
from flashsinkhorn.backends import triton_available
from flashsinkhorn.problem import centred_side, kernel_scale

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")


def _side(n, d, seed, precision, kscale, large_eps=float("inf"), device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, d, generator=gen).to(device)
    w = (torch.rand(1, n, generator=gen) + 0.1).to(device)
    side = centred_side(x, torch.float32, w / w.sum(), None, precision, kscale, False)
    return replace(side, large_eps=large_eps)


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
@pytest.mark.parametrize("split", [None, 3])
@pytest.mark.parametrize("large", [False, True])
def test_pair_matches_two_softmins(device, precision, split, large):
    from flashsinkhorn.backends.triton import TritonBackend, pair

    kscale = kernel_scale(precision, 4.0) if precision != "ieee" else 1.0
    eps = 1e5 if large else 0.7
    thr = 10.0 if large else float("inf")
    r1 = _side(37, 5, 1, precision, kscale, thr, device)
    c1 = _side(70, 5, 2, precision, kscale, thr, device)
    r2 = _side(19, 5, 3, precision, kscale, thr, device)
    c2 = _side(45, 5, 4, precision, kscale, thr, device)
    gen = torch.Generator().manual_seed(5)
    p1, p2 = (
        torch.randn(1, 70, generator=gen).to(device),
        torch.randn(1, 45, generator=gen).to(device),
    )
    o1, o2 = (
        torch.randn(1, 37, generator=gen).to(device),
        torch.randn(1, 19, generator=gen).to(device),
    )
    impl = TritonBackend()
    first, second = (r1, c1, p1, o1, 0.5), (r2, c2, p2, o2, 0.25)
    assert pair.eligible(first, second, precision)
    with tuning.override(softmin_split=split):
        (u1, t1), (u2, t2) = impl.softmin_pair(first, second, eps, 0.5, True, precision)
        v1, s1 = impl.softmin(r1, c1, p1, eps, o1, 0.5, 0.5, True, precision)
        v2, s2 = impl.softmin(r2, c2, p2, eps, o2, 0.5, 0.25, True, precision)
    scale = 1e-6 * max(1.0, float(s1.abs().max()), float(s2.abs().max()))
    for got, want in ((u1, v1), (t1, s1), (u2, v2), (t2, s2)):
        assert torch.isfinite(got).all()
        assert float((got - want).abs().max()) <= scale
    # without raw outputs the raw slots are None and the outputs the same
    (w1, n1), (w2, n2) = impl.softmin_pair(first, second, eps, 0.5, False, precision)
    assert n1 is None and n2 is None
    assert float((w1 - v1).abs().max()) <= scale and float((w2 - v2).abs().max()) <= scale


def test_pair_falls_back_when_formats_differ(device):
    from flashsinkhorn.backends.triton import TritonBackend, pair

    k = kernel_scale("tf32", 4.0)
    r1, c1 = _side(8, 3, 1, "tf32", k, device=device), _side(9, 3, 2, "tf32", k, device=device)
    r2, c2 = _side(8, 3, 3, "ieee", 1.0, device=device), _side(9, 3, 4, "ieee", 1.0, device=device)
    p, o = torch.zeros(1, 9, device=device), torch.zeros(1, 8, device=device)
    first, second = (r1, c1, p, o, 1.0), (r2, c2, p, o, 1.0)
    assert not pair.eligible(first, second, "tf32")
    (u1, _), (u2, _) = TritonBackend().softmin_pair(first, second, 0.5, 0.0, False, "tf32")
    impl = TritonBackend()
    want1, _ = impl.softmin(r1, c1, p, 0.5, o, 0.0, 1.0, False, "tf32")
    want2, _ = impl.softmin(r2, c2, p, 0.5, o, 0.0, 1.0, False, "tf32")
    assert torch.equal(u1, want1) and torch.equal(u2, want2)
