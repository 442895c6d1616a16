"""The multiscale path on a GPU: the Triton kernel at scale, agreement with the streaming
solve on 100k-point 3-D clouds (value and gradients), and a 4M-point run in memory.

Run on the reference H100: ``pytest -m gpu tests/test_gpu_multiscale.py``.
"""

import math

import pytest
import torch

import flashsinkhorn as fs

from .multiscale_cases import bench_clouds, mixture_and_shell, torch_and_kernel_paths

pytestmark = pytest.mark.gpu

DEV = "cuda"
#: Absolute resolution of a float32 marginal error on the mixture-onto-shell clouds at
#: eps = (0.01·D)²: each exponent (f_i + g_j − C_ij)/eps rounds by about
#: u·D²/eps = 6e-4, and the float64 evaluation of a float32 solve's potentials reads
#: 2.4e-5 above the float32 one (CPU, n = 3000, torch backend; the same with every
#: truncation setting, and 0 for a float64 solve).
FP32_RESOLUTION = 3e-5


def _gmm_shell(n, seed=0):
    x, y, diam = mixture_and_shell(n, seed)
    return x.to(DEV), y.to(DEV), diam


def test_kernel_matches_torch_path_on_gpu():
    from flashsinkhorn.problem import prepare

    x, y, diam = _gmm_shell(20_000, seed=1)
    eps = (0.01 * diam) ** 2
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="ieee")
    ref = fs.sinkhorn(x, y, eps=eps, path="streaming", precision="ieee")
    out = torch_and_kernel_paths(p, ref.solution.f, ref.solution.g, eps)
    (T0, G0, m0), (T1, G1, m1) = out
    torch.testing.assert_close(T1, T0, rtol=0, atol=1e-3 * eps)
    torch.testing.assert_close(m1, m0, rtol=1e-3, atol=1e-9)
    torch.testing.assert_close(G1, G0, rtol=0, atol=1e-3 * float(G0.abs().max()))


@pytest.mark.parametrize("shape", ["gmm_shell", "surfaces"])
def test_100k_matches_streaming(shape):
    """Value within 1e-4 relative and gradients within 1e-3 (relative L2) of the streaming
    solve, on both benchmark problems; the reported error bounds the untruncated one. Both
    solves stop at the first iteration whose error is below 5e-5: the gradients' difference is
    set by where each solve stops, not by the truncation (H100, mixture onto shell, y: 1.0e-3
    at tol 1e-4, 6.6e-4 at 5e-5, 5.1e-4 at 3e-5; x: 2.1e-4, 1.0e-4, 7.5e-5)."""
    x, y, diam = bench_clouds(shape, 100_000)
    x, y = x.to(DEV), y.to(DEV)
    eps = (0.01 * diam) ** 2
    kw = dict(eps=eps, tol=5e-5, check_every=1, n_iters=20_000)
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    v = fs.ot_cost(xs, ys, path="multiscale", **kw)
    gx, gy = torch.autograd.grad(v, (xs, ys))
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    vr = fs.ot_cost(xr, yr, path="streaming", precision="ieee", **kw)
    gxr, gyr = torch.autograd.grad(vr, (xr, yr))
    rel_v = abs(float(v.detach()) / float(vr.detach()) - 1.0)
    rel_gx = float((gx - gxr).norm() / gxr.norm())
    rel_gy = float((gy - gyr).norm() / gyr.norm())
    print(f"100k {shape}: value {rel_v:.2e}, grad x {rel_gx:.2e}, grad y {rel_gy:.2e} (relative)")
    assert rel_v <= 1e-4
    assert rel_gx <= 1e-3
    assert rel_gy <= 1e-3
    res = fs.sinkhorn(x, y, path="multiscale", eps=eps, tol=1e-4, n_iters=20_000)
    assert res.converged and res.path == "multiscale" and res.backend == "triton"
    # The reported error bounds the untruncated plan's. That property is tested exactly in
    # float64 on the CPU (tests/test_multiscale.py). Here the solve runs in float32: its
    # reported error is the float32 operator's, and the untruncated plan's error of the same
    # potentials evaluated in float64 differs from it by float32's resolution at this eps
    # (FP32_RESOLUTION), whatever the truncation does.
    from flashsinkhorn.backends import resolve_backend
    from flashsinkhorn.backends.torch_ref import TorchBackend
    from flashsinkhorn.problem import prepare
    from flashsinkhorn.solvers.objective import marginal_error

    s = res.solution
    dense32 = marginal_error(s.problem, resolve_backend("triton", x.device, x.dtype), s.f, s.g,
                             s.eps)  # fmt: skip
    p64 = prepare(x.double(), y.double(), None, None, rho_x=None, rho_y=None, precision="ieee")
    dense64 = marginal_error(p64, TorchBackend(), s.f.double(), s.g.double(), s.eps)
    print(f"100k {shape}: reported error {float(res.marginal_error):.4e}, untruncated float64 "
          f"{float(dense64[0]):.4e}, float32 dense kernels {float(dense32[0]):.4e}")  # fmt: skip
    assert float(res.marginal_error) >= float(dense64[0]) - FP32_RESOLUTION


def test_batched_unbalanced_float64_on_gpu():
    x, y, diam = _gmm_shell(5_000, seed=2)
    X, Y = torch.stack([x, y]), torch.stack([y, x])
    eps = (0.01 * diam) ** 2
    kw = dict(eps=eps, tol=1e-4, rho_x=1.0, rho_y=1.0)
    ms = fs.sinkhorn(X.double(), Y.double(), path="multiscale", **kw)
    ref = fs.sinkhorn(X.double(), Y.double(), backend="torch", **kw)
    torch.testing.assert_close(ms.value, ref.value, rtol=1e-5, atol=0)


def test_4m_runs_in_memory():
    """4M × 4M in 3-D on one GPU: memory O(n) plus the pair list."""
    x, y, diam = _gmm_shell(4_000_000, seed=3)
    eps = (0.01 * diam) ** 2
    torch.cuda.reset_peak_memory_stats()
    xs = x.clone().requires_grad_()
    v = fs.ot_cost(xs, y, eps=eps, tol=1e-3, path="multiscale")
    v.backward()
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"4M: value {float(v.detach()):.6g}, peak {peak:.1f} GiB")
    assert math.isfinite(float(v.detach())) and torch.isfinite(xs.grad).all()
    # 45.6 GiB measured on the H100 when the backward built a second pattern with int64
    # index lists (now: the solve's int32 pattern is reused); a regression guard
    assert peak < 48, f"peak {peak:.1f} GiB"


def test_search_kernel_matches_torch_search_on_gpu():
    """The pattern search kernel against the torch search (float64 both) on the converged
    potentials of the 100k mixture-onto-shell problem: the same tile pairs up to pairs at a
    bin edge, the same skipped sums to rounding, within the budget."""
    from flashsinkhorn.multiscale.bounds import build_pattern

    x, y, diam = _gmm_shell(100_000)
    eps = (0.01 * diam) ** 2
    res = fs.sinkhorn(x, y, path="multiscale", eps=eps, tol=1e-3)
    be = res.solution.backend
    X, Y = res.solution.problem.X, res.solution.problem.Y
    lx, ly = be.layout(X), be.layout(Y)
    f, g = lx.sort(res.solution.f), ly.sort(res.solution.g)
    ref = build_pattern(lx, ly, f, g, eps, be.budget)
    got = build_pattern(lx, ly, f, g, eps, be.budget, kernel=True)
    key = lambda p: p.rows.long() * ly.tiles + p.cols.long()  # noqa: E731
    a, b = key(ref), key(got)
    common = int(torch.isin(b, a).sum())
    print(f"100k search: torch {ref.pairs} pairs, kernel {got.pairs}, common {common}")
    assert ref.pairs > 100_000 and abs(got.pairs - ref.pairs) <= 1e-4 * ref.pairs
    assert common >= ref.pairs * (1 - 1e-4)
    # the same bounds to float64 rounding (a float32 eps would move them by ~1e-6)
    for r, k in zip(ref.skipped, got.skipped, strict=True):
        torch.testing.assert_close(k, r, rtol=1e-8, atol=0)
    assert float(sum(got.skipped)) <= be.budget
