"""The CPU stored-kernel backend (backends/kernel_cpu.py) against the log-domain torch backend
and dense float64 math: single soft-mins across absorptions, and whole solves (batched,
unbalanced, float32 and float64, small eps where the kernel is rebuilt, large eps)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends import kernel_cpu, resolve_backend, select_path
from flashsinkhorn.backends.kernel_cpu import KernelBackend
from flashsinkhorn.backends.torch_ref import TorchBackend
from flashsinkhorn.problem import prepare

from . import reference as ref
from .clouds import weighted_clouds


def _problem(dtype, B=None, n=37, m=29, d=3, seed=0):
    x, y, a, b = weighted_clouds(n, m, d, B=B, seed=seed, dtype=dtype)
    return prepare(x, y, a, b, rho_x=None, rho_y=None, precision="ieee")


def _tol(dtype):
    return 2e-5 if dtype == torch.float32 else 1e-11


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B", [None, 3])
def test_softmins_match_log_domain_across_absorptions(dtype, B):
    """A sequence of half-steps whose column potentials drift apart by up to 110 eps (float32;
    1100 eps in float64): several rebuilds, none needed for some steps; the log-domain
    soft-min every time."""
    p = _problem(dtype, B)
    X, Y = p.X, p.Y
    # float64's floor (e^-288 per column) needs scores of that range
    eps = 0.01 if dtype == torch.float32 else 0.002
    kern, ref_ = KernelBackend(), TorchBackend()
    gen = torch.Generator().manual_seed(1)
    f = torch.zeros_like(X.sq)
    g = torch.zeros_like(Y.sq)
    for k in range(12):
        drift = k * eps * (10.0 if dtype == torch.float32 else 100.0)
        g_k = g + drift * torch.rand(g.shape, generator=gen, dtype=dtype)
        new, raw = kern.softmin(X, Y, g_k, eps, f, 0.25, 0.5, True, "ieee")
        new_r, raw_r = ref_.softmin(X, Y, g_k, eps, f, 0.25, 0.5, True, "ieee")
        scale = float(raw_r.abs().max()) + eps
        assert (raw - raw_r).abs().max() <= _tol(dtype) * scale
        assert (new - new_r).abs().max() <= _tol(dtype) * scale
        f = raw
        f_k = f + drift * torch.rand(f.shape, generator=gen, dtype=dtype)
        _, tg = kern.softmin(Y, X, f_k, eps, g, 0.0, 1.0, True, "ieee")
        _, tg_r = ref_.softmin(Y, X, f_k, eps, g, 0.0, 1.0, True, "ieee")
        assert (tg - tg_r).abs().max() <= _tol(dtype) * (float(tg_r.abs().max()) + eps)
        g = tg
    assert kern.builds >= 2  # the drift forced rebuilds
    kern.release()
    assert kern._K is None


def test_softmin_rebuilds_when_a_row_loses_its_mass():
    """Columns potentials that leave some rows' sums below the floor (one far point gains all
    the mass) trigger a rebuild, not a wrong or infinite soft-min."""
    p = _problem(torch.float32)
    X, Y = p.X, p.Y
    eps = 0.002
    kern, ref_ = KernelBackend(), TorchBackend()
    f = torch.zeros_like(X.sq)
    g = torch.zeros_like(Y.sq)
    kern.softmin(X, Y, g, eps, f, 0.0, 1.0, False, "ieee")
    assert kern.builds == 1
    g2 = g.clone()
    g2[0, 0] += 60 * eps  # point 0 takes the mass: rows far from it fall below the floor
    _, t = kern.softmin(X, Y, g2, eps, f, 0.0, 1.0, True, "ieee")
    _, t_r = ref_.softmin(X, Y, g2, eps, f, 0.0, 1.0, True, "ieee")
    assert torch.isfinite(t).all()
    assert (t - t_r).abs().max() <= 2e-5 * float(t_r.abs().max())


def test_other_sides_and_large_eps_run_in_the_log_domain():
    """Sides the kernel was not built for, and large eps, use the log-domain soft-min."""
    p = _problem(torch.float64)
    q = _problem(torch.float64, seed=5)
    kern, ref_ = KernelBackend(), TorchBackend()
    g = torch.zeros_like(p.Y.sq)
    kern.softmin(p.X, p.Y, g, 0.1, p.X.sq * 0, 0.0, 1.0, False, "ieee")
    _, t = kern.softmin(q.X, q.Y, g, 0.1, q.X.sq * 0, 0.0, 1.0, True, "ieee")
    _, t_r = ref_.softmin(q.X, q.Y, g, 0.1, q.X.sq * 0, 0.0, 1.0, True, "ieee")
    assert kern.builds == 1 and torch.allclose(t, t_r, rtol=0, atol=1e-12)


def test_selection():
    """backend="auto" on the CPU takes the kernel when it fits; "torch" stays log-domain."""
    p = _problem(torch.float32)
    auto = resolve_backend("auto", torch.device("cpu"), torch.float32)
    assert isinstance(select_path(auto, p, "auto"), KernelBackend)
    assert type(select_path(auto, p, "dense")) is TorchBackend
    plain = resolve_backend("torch", torch.device("cpu"), torch.float32)
    assert type(select_path(plain, p, "auto")) is TorchBackend
    old = kernel_cpu.KERNEL_MAX_BYTES
    try:
        kernel_cpu.KERNEL_MAX_BYTES = kernel_cpu.kernel_bytes(p) - 1
        assert type(select_path(auto, p, "auto")) is TorchBackend
    finally:
        kernel_cpu.KERNEL_MAX_BYTES = old
    x, y, _, _ = weighted_clouds(30, 20, 2, dtype=torch.float32)
    assert fs.sinkhorn(x, y, eps=0.1, tol=1e-4).path == "kernel"
    assert fs.sinkhorn(x, y, eps=0.1, tol=1e-4, backend="torch").path == "dense"


def _centred(f, g, a):
    c = (a * f).sum(-1, keepdim=True) / a.sum(-1, keepdim=True)
    return f - c, g + c


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "eps,rho",
    [(0.05, None), (0.003, None), (0.05, 0.5), (0.003, 0.1), (50.0, None), (50.0, 1.0)],
)
def test_solve_matches_log_domain_solve(dtype, eps, rho):
    """Default solve (kernel path) against backend="torch": same iterations, potentials and
    value to the dtype's rounding, batched and unbalanced; small eps anneals and rebuilds."""
    x, y, a, b = weighted_clouds(41, 33, 2, B=2, seed=3, dtype=dtype)
    kw = dict(eps=eps, tol=1e-4, rho_x=rho, rho_y=rho, n_iters=5000)
    res = fs.sinkhorn(x, y, a, b, **kw)
    oracle = fs.sinkhorn(x, y, a, b, backend="torch", **kw)
    assert res.path == "kernel" and oracle.path == "dense"
    assert res.converged and oracle.converged
    assert res.n_iters == oracle.n_iters
    scale = max(1.0, float(oracle.f.abs().max()))
    tol = (3e-5 if dtype == torch.float32 else 1e-10) * scale
    f, g = _centred(res.f, res.g, a)
    fo, go = _centred(oracle.f, oracle.g, a)
    assert (f - fo).abs().max() <= tol and (g - go).abs().max() <= tol
    assert (res.value - oracle.value).abs().max() <= tol
    assert (res.marginal_error - oracle.marginal_error).abs().max() <= 1e-4


@pytest.mark.parametrize("rho", [None, 0.2])
def test_solve_matches_dense_float64_reference(rho):
    """Converged float64 kernel-path solve against the NumPy log-domain reference."""
    x, y, a, b = weighted_clouds(23, 31, 2, seed=7)
    eps = 0.01
    res = fs.sinkhorn(x, y, a, b, eps=eps, tol=1e-12, n_iters=20000, rho_x=rho, rho_y=rho)
    assert res.path == "kernel" and res.converged
    f_ref, g_ref, P_ref = ref.solve(x.numpy(), y.numpy(), a.numpy(), b.numpy(), eps, rho, rho)
    value = ref.primal(x.numpy(), y.numpy(), a.numpy(), b.numpy(), P_ref, eps, rho, rho)
    assert abs(float(res.value) - value) <= 1e-9 * abs(value)
    C = torch.from_numpy(ref.cost(x.numpy(), y.numpy()))
    P = a[:, None] * b[None, :] * torch.exp((res.f[:, None] + res.g[None, :] - C) / eps)
    assert np.abs(P.numpy() - P_ref).max() <= 1e-11


def test_float32_small_eps_value_matches_float64():
    """float32 at eps = 1e-3 of the unit square (several rebuilds) against float64."""
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(300, 2, generator=gen)
    y = torch.rand(280, 2, generator=gen)
    res = fs.sinkhorn(x, y, eps=1e-3, tol=1e-3)
    ref64 = fs.sinkhorn(x.double(), y.double(), eps=1e-3, tol=1e-9, n_iters=20000, backend="torch")
    assert res.path == "kernel" and res.converged
    assert res.solution.backend._K is None  # released after the solve
    assert abs(float(res.value) - float(ref64.value)) <= 1e-3 * float(ref64.value) + 1e-6
    assert float(res.marginal_error) <= 1e-3


@pytest.mark.parametrize("cost,labels", [("euclidean", False), ("sqeuclidean", True)])
def test_other_costs_and_labels(cost, labels):
    """The kernel read off the torch backend's cost blocks: the euclidean cost, label costs."""
    x, y, a, b = weighted_clouds(25, 19, 3, seed=4)
    kw = dict(eps=0.05, tol=1e-9, n_iters=5000, cost=cost)
    if labels:
        gen = torch.Generator().manual_seed(0)
        kw.update(
            label_x=torch.randint(0, 3, (25,), generator=gen),
            label_y=torch.randint(0, 3, (19,), generator=gen),
            label_cost=torch.rand(3, 3, generator=gen, dtype=torch.float64),
        )
    res = fs.sinkhorn(x, y, a, b, **kw)
    oracle = fs.sinkhorn(x, y, a, b, backend="torch", **kw)
    assert res.path == "kernel" and res.converged
    assert math.isclose(float(res.value), float(oracle.value), rel_tol=1e-10)


def test_divergence_and_gradient_on_kernel_path():
    """The divergence's self terms (one potential) and ot_cost's gradient on the default path
    match the log-domain backend."""
    x, y, a, b = weighted_clouds(30, 26, 2, seed=9)
    d = fs.sinkhorn_divergence(x, y, a, b, eps=0.02, tol=1e-10)
    d_ref = fs.sinkhorn_divergence(x, y, a, b, eps=0.02, tol=1e-10, backend="torch")
    assert math.isclose(float(d), float(d_ref), rel_tol=1e-8, abs_tol=1e-12)
    xg = x.clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    fs.ot_cost(xg, y, a, b, eps=0.02, tol=1e-10).backward()
    fs.ot_cost(xr, y, a, b, eps=0.02, tol=1e-10, backend="torch").backward()
    assert torch.allclose(xg.grad, xr.grad, rtol=0, atol=1e-8)


def test_auto_takes_multiscale_on_cpu_where_the_kernel_does_not_fit():
    """On CPU tensors "auto" keeps the stored kernel below its budget (faster there, 5000²,
    d = 2, eps = 1e-3) and takes the multiscale path above it for small eps and d <= 3."""
    from flashsinkhorn.multiscale import multiscale_applies
    from flashsinkhorn.options import SinkhornOptions

    x, y = torch.rand(5000, 2), torch.rand(5000, 2)
    opts = SinkhornOptions.build(x, y, eps=1e-3)
    assert not multiscale_applies(x, y, opts)
    old = kernel_cpu.KERNEL_MAX_BYTES
    try:
        kernel_cpu.KERNEL_MAX_BYTES = 5000 * 5000 * 4 - 1
        assert multiscale_applies(x, y, opts)
        assert not multiscale_applies(x, y, opts.replace(eps=0.1))
        assert not multiscale_applies(x.double(), y.double(), opts.replace(tol=None))
    finally:
        kernel_cpu.KERNEL_MAX_BYTES = old


def test_small_problem_runs_on_one_thread_and_restores_the_setting():
    """A small kernel solves on one intra-op thread; the caller's thread count comes back."""
    saved = torch.get_num_threads()
    seen = []
    x, y, _, _ = weighted_clouds(30, 20, 2, dtype=torch.float32)
    orig = KernelBackend._kernel_softmin

    def spy(self, *args):
        seen.append(torch.get_num_threads())
        return orig(self, *args)

    try:
        torch.set_num_threads(2)
        KernelBackend._kernel_softmin = spy
        res = fs.sinkhorn(x, y, eps=0.1, tol=1e-4)
        assert res.path == "kernel" and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        KernelBackend._kernel_softmin = orig
        torch.set_num_threads(saved)
