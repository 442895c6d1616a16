"""The multiscale solves: agreement with dense solves (values, reported errors, gradients,
batched and unbalanced problems, the divergence), refusals and the auto rule.

Small float64 clouds on the torch backend (the oracle), the Triton kernel path under the
interpreter."""

import itertools

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.multiscale import backend as ms_backend
from flashsinkhorn.multiscale import solver as ms_solver
from flashsinkhorn.multiscale.solver import FINE_CHECK_EVERY

from .multiscale_cases import DT, small_clouds, small_weights, torch_and_kernel_paths

#: Rounding allowance of "reported >= dense-measured" (absolute, masses of order 1): the
#: loop's test counts the marginal its last half-step made exact as exact, while its float64
#: evaluation has rounding of about m·u = 1e-13; where nothing is skipped the two errors
#: agree to that level only.
ROUNDING = 1e-12


def _dense_error(res):
    """‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ of the returned potentials, from the dense float64 plan."""
    from flashsinkhorn.backends.torch_ref import TorchBackend
    from flashsinkhorn.solvers.objective import marginals

    s = res.solution
    p = s.problem
    ra, rb = marginals(p, TorchBackend(), s.f, s.g, s.eps)
    tx = p.X.w if p.X.rho is None else p.X.w * torch.exp(-s.f / p.X.rho)
    ty = p.Y.w if p.Y.rho is None else p.Y.w * torch.exp(-s.g / p.Y.rho)
    return (ra - tx).abs().sum(-1) + (rb - ty).abs().sum(-1)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_solve_matches_dense(d, monkeypatch):
    # (the fine loop's frequent tests, for large problems only, are exercised here too)
    monkeypatch.setattr(ms_solver, "FINE_CHECK_MIN_NM", 0)
    n, m = 900, 800
    x, y = small_clouds(n, m, d=d, seed=7)
    a, b = small_weights(n, 5), small_weights(m, 6)
    eps = 1.5e-3
    kw = dict(eps=eps, tol=1e-6, n_iters=4000, backend="torch")
    ms = fs.sinkhorn(x, y, a, b, path="multiscale", **kw)
    ref = fs.sinkhorn(x, y, a, b, **kw)
    assert ms.path == "multiscale" and ms.converged
    torch.testing.assert_close(ms.value, ref.value, rtol=1e-6, atol=0)
    # potentials agree up to the gauge f + c, g − c
    c = (ms.f - ref.f).mean()
    torch.testing.assert_close(ms.f - c, ref.f, rtol=0, atol=2e-4 * eps * 100)
    torch.testing.assert_close(ms.g + c, ref.g, rtol=0, atol=2e-4 * eps * 100)
    # the reported error bounds the untruncated plan's
    assert float(ms.marginal_error) >= float(_dense_error(ms)[0]) - ROUNDING
    assert float(ms.marginal_error) <= 1e-6
    # the fine loop tests at most every FINE_CHECK_EVERY iterations (the default is 10)
    its = [k for k, _ in ms.errors]
    assert len(its) > 2 and max(b - a for a, b in itertools.pairwise(its)) <= FINE_CHECK_EVERY


@pytest.mark.parametrize(
    "tol,schedule,acceleration,eps",
    [(1e-2, "auto", "auto", 1e-3), (1e-3, "auto", "auto", 1e-3), (1e-4, "auto", "auto", 1e-3),
     (1e-3, "alternating", "anderson", 1e-3),
     # plain averaged steps contract at a rate that scales with eps: 110 fine iterations at
     # 1e-2 against 1102 at 1e-3, where the pattern still skips 136 of the 256 tile pairs
     (1e-3, "symmetric", "none", 1e-2)],
)  # fmt: skip
def test_reported_error_bounds_dense_error(tol, schedule, acceleration, eps, monkeypatch):
    """Converged or not, the reported error is an upper bound of the dense-measured one, for
    every schedule and acceleration of the loop; patterns are built to part of the budget
    (room for the potentials to move before a rebuild)."""
    n, m = 700, 650
    x, y = small_clouds(n, m, d=2, seed=8)
    kw = dict(eps=eps, tol=tol, backend="torch", path="multiscale", schedule=schedule,
              acceleration=acceleration, n_iters=3000)  # fmt: skip
    budgets = []
    build = ms_backend.build_pattern

    def recorded(lx, ly, f, g, eps, budget, *args):
        budgets.append(budget)
        return build(lx, ly, f, g, eps, budget, *args)

    monkeypatch.setattr(ms_backend, "build_pattern", recorded)
    res = fs.sinkhorn(x, y, **kw)
    be = res.solution.backend
    assert budgets and set(budgets) == {ms_backend.BUILD_FRACTION * be.budget}
    assert ms_backend.BUILD_FRACTION < 1
    assert res.converged
    pat = res.solution.backend.state.pattern
    lay = res.solution.backend.layout(res.solution.problem.X)
    assert pat.pairs < lay.tiles**2  # tile pairs were skipped
    assert float(res.marginal_error) >= float(_dense_error(res)[0]) - ROUNDING
    short = fs.sinkhorn(x, y, eps=1e-3, tol=None, n_iters=3, backend="torch", path="multiscale",
                        scaling=None)  # fmt: skip
    assert not short.converged
    assert float(short.marginal_error) >= float(_dense_error(short)[0]) - ROUNDING


def test_rebuild_when_the_error_drops(monkeypatch):
    """A pattern is rebuilt at a test whose measured error fell REBUILD_DROP times below the
    first test's on it (tighter bounds near convergence), and the solve still converges to the
    same potentials with an honest reported error."""
    x, y = small_clouds(700, 650, d=2, seed=8)
    kw = dict(eps=1e-3, tol=1e-6, backend="torch", path="multiscale", n_iters=3000)
    runs = {}
    for drop in (None, 4.0):
        monkeypatch.setattr(ms_backend, "REBUILD_DROP", drop)
        res = fs.sinkhorn(x, y, **kw)
        assert res.converged
        assert float(res.marginal_error) >= float(_dense_error(res)[0]) - ROUNDING
        runs[drop] = res
    # from ~1e-2 to 1e-6 the error drops 4x several times
    assert (
        runs[4.0].solution.backend.state.rebuilds >= runs[None].solution.backend.state.rebuilds + 3
    )
    torch.testing.assert_close(runs[4.0].value, runs[None].value, rtol=1e-6, atol=0)


def test_batched_and_unbalanced_match_dense():
    B, n, m = 2, 500, 450
    x, y = small_clouds(n, m, d=3, B=B, seed=9)
    a = torch.stack([small_weights(n, 10), small_weights(n, 11)])
    b = torch.stack([small_weights(m, 12), small_weights(m, 13)]) * 1.3
    kw = dict(eps=2e-3, tol=1e-6, n_iters=4000, backend="torch", rho_x=0.5, rho_y=0.2)
    ms = fs.sinkhorn(x, y, a, b, path="multiscale", **kw)
    ref = fs.sinkhorn(x, y, a, b, **kw)
    assert ms.value.shape == (B,)
    torch.testing.assert_close(ms.value, ref.value, rtol=2e-6, atol=0)
    torch.testing.assert_close(ms.f, ref.f, rtol=0, atol=1e-4)
    assert torch.all(ms.marginal_error >= _dense_error(ms) - ROUNDING)


def _grads(path, x, y, a, b, **kw):
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    as_, bs = a.clone().requires_grad_(), b.clone().requires_grad_()
    v = fs.ot_cost(xs, ys, as_, bs, path=path, **kw)
    v.sum().backward()
    return v.detach(), xs.grad, ys.grad, as_.grad, bs.grad


@pytest.mark.parametrize("rho", [None, 0.3])
def test_gradients_match_dense(rho):
    n, m = 600, 500
    x, y = small_clouds(n, m, d=2, seed=11)
    a, b = small_weights(n, 7), small_weights(m, 8)
    kw = dict(eps=2e-3, tol=1e-7, n_iters=5000, backend="torch", rho_x=rho, rho_y=rho)
    ms = _grads("multiscale", x, y, a, b, **kw)
    ref = _grads("auto", x, y, a, b, **kw)
    torch.testing.assert_close(ms[0], ref[0], rtol=1e-6, atol=0)
    for gm, gr in zip(ms[1:3], ref[1:3], strict=True):
        torch.testing.assert_close(gm, gr, rtol=0, atol=1e-6 * float(gr.abs().max()) * 100)
    for gm, gr in zip(ms[3:], ref[3:], strict=True):
        # weight gradients: potentials, defined up to a constant when balanced
        c = 0.0 if rho is not None else (gm - gr).mean()
        torch.testing.assert_close(gm - c, gr, rtol=0, atol=2e-4)


def test_gradient_finite_differences():
    """d value / dx along a direction, against central differences of the multiscale value."""
    n, m = 250, 220
    x, y = small_clouds(n, m, d=2, seed=12)
    kw = dict(eps=3e-3, tol=1e-10, n_iters=20000, backend="torch", path="multiscale")
    xs = x.clone().requires_grad_()
    fs.ot_cost(xs, y, **kw).backward()
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(x.shape, generator=gen, dtype=DT)
    h = 1e-5
    fd = (fs.ot_cost(x + h * v, y, **kw) - fs.ot_cost(x - h * v, y, **kw)) / (2 * h)
    torch.testing.assert_close((xs.grad * v).sum(), fd, rtol=1e-5, atol=0)


def test_batched_gradients_float32_match_float64():
    B, n, m = 2, 400, 380
    x, y = small_clouds(n, m, d=3, B=B, seed=13)
    kw = dict(eps=3e-3, tol=1e-5, n_iters=5000, backend="torch", path="multiscale")
    x32, y32 = x.float().requires_grad_(), y.float().requires_grad_()
    v32 = fs.ot_cost(x32, y32, **kw)
    v32.sum().backward()
    x64, y64 = x.clone().requires_grad_(), y.clone().requires_grad_()
    v64 = fs.ot_cost(x64, y64, **kw)
    v64.sum().backward()
    assert v32.dtype == torch.float32 and x32.grad.shape == (B, n, 3)
    torch.testing.assert_close(v32.double(), v64.detach(), rtol=1e-4, atol=0)
    scale = float(x64.grad.abs().max())
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=0, atol=2e-3 * scale)


def test_divergence_matches_dense():
    n, m = 500, 450
    x, y = small_clouds(n, m, d=2, seed=14)
    kw = dict(eps=2e-3, tol=1e-7, n_iters=5000, backend="torch")
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    s_ms = fs.sinkhorn_divergence(xs, y, path="multiscale", **kw)
    s_ref = fs.sinkhorn_divergence(xr, y, **kw)
    s_ms.backward()
    s_ref.backward()
    torch.testing.assert_close(s_ms.detach(), s_ref.detach(), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=0, atol=1e-4 * float(xr.grad.abs().max()))


def test_inputs_not_modified():
    x, y = small_clouds(300, 280, d=2, seed=15)
    a, b = small_weights(300, 1), small_weights(280, 2)
    copies = [t.clone() for t in (x, y, a, b)]
    fs.sinkhorn(x, y, a, b, eps=3e-3, backend="torch", path="multiscale")
    for t, c in zip((x, y, a, b), copies, strict=True):
        assert torch.equal(t, c)


# ----- refusals and the auto rule -----


def test_refusals():
    x, y = small_clouds(50, 40, d=2)
    with pytest.raises(ValueError, match="d <= 3"):
        fs.sinkhorn(torch.rand(30, 4), torch.rand(20, 4), eps=0.01, path="multiscale")
    with pytest.raises(ValueError, match="float32 and float64"):
        fs.sinkhorn(x.half(), y.half(), eps=0.01, path="multiscale")
    with pytest.raises(ValueError, match="squared Euclidean"):
        fs.sinkhorn(x, y, eps=0.01, path="multiscale", cost="euclidean")
    with pytest.raises(ValueError, match="squared Euclidean"):
        fs.ot_cost(x, y, eps=0.01, path="multiscale", feature_map=torch.ones(2, dtype=DT) * 2)
    with pytest.raises(ValueError, match="precision"):
        fs.sinkhorn(x.float(), y.float(), eps=0.01, path="multiscale", precision="tf32")
    with pytest.raises(ValueError, match="small eps"):
        fs.sinkhorn(x, y, eps=100.0, path="multiscale")
    with pytest.raises(ValueError, match="path must be one of"):
        fs.sinkhorn(x, y, eps=0.01, path="sparse")


def test_double_backward_refused():
    x, y = small_clouds(200, 180, d=2, seed=2)
    xs = x.clone().requires_grad_()
    v = fs.ot_cost(xs, y, eps=3e-3, backend="torch", path="multiscale")
    (gx,) = torch.autograd.grad(v, xs, create_graph=True)
    with pytest.raises(ValueError, match="multiscale"):
        gx.sum().backward()
    from flashsinkhorn import HessianOperator

    with pytest.raises(ValueError, match="multiscale"):
        HessianOperator(x, y, eps=3e-3, path="multiscale")


def test_auto_rule():
    from flashsinkhorn.multiscale import multiscale_applies
    from flashsinkhorn.options import SinkhornOptions

    big_x = torch.rand(100_000, 3)
    big_y = torch.rand(100_000, 3)
    diam2 = 3.0
    small = SinkhornOptions.build(big_x, big_y, eps=1e-4 * diam2)
    assert multiscale_applies(big_x, big_y, small)
    assert not multiscale_applies(big_x, big_y, small.replace(eps=0.1))
    assert not multiscale_applies(big_x[:1000], big_y, small)
    assert not multiscale_applies(big_x, big_y, small.replace(tol=None))
    assert not multiscale_applies(torch.rand(100_000, 4), torch.rand(100_000, 4), small)
    # small problems keep their path
    x, y = small_clouds(100, 90, d=2)
    assert fs.sinkhorn(x, y, eps=1e-3, backend="torch").path == "dense"


def test_backend_kernel_path_matches_torch_path(device):
    """The backend's soft-min and envelope gradient through ``_lse_sparse_fwd_kernel``
    (interpreter) equal those of the torch block-sparse path, float32."""
    from flashsinkhorn.problem import prepare

    x, y = small_clouds(150, 130, d=3, seed=16, dtype=torch.float32)
    x, y = x.to(device), y.to(device)
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision="ieee")
    eps = 3e-3
    ref = fs.sinkhorn(x, y, eps=eps, backend="torch", tol=1e-4)
    out = torch_and_kernel_paths(p, ref.solution.f, ref.solution.g, eps, grad_rows="y")
    (T0, G0, m0), (T1, G1, m1) = out
    torch.testing.assert_close(T1, T0, rtol=0, atol=1e-5)
    torch.testing.assert_close(m1, m0, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(G1, G0, rtol=0, atol=1e-4 * float(G0.abs().max()))


@pytest.mark.parametrize("rho", [None, 3e-4])
def test_shift_estimates_cover_padding(device, monkeypatch, rho):
    """At converged potentials the backend's soft-min estimates every row's log-sum-exp well
    enough that the shift kernel flags no tile, padding rows (which repeat a point) included,
    and for a strongly relaxed marginal (damping 1/11: an estimate that did not divide by it
    would put −T/eps off by a factor of 11): the exact kernel then recomputes nothing."""
    from flashsinkhorn.backends.torch_ref import TorchBackend
    from flashsinkhorn.backends.triton import sparse
    from flashsinkhorn.multiscale.backend import MultiscaleBackend
    from flashsinkhorn.problem import prepare

    x, y = small_clouds(150, 130, d=3, seed=16, dtype=torch.float32)
    x, y = x.to(device), y.to(device)
    p = prepare(x, y, None, None, rho_x=rho, rho_y=rho, precision="ieee")
    eps = 3e-3
    ref = fs.sinkhorn(x, y, eps=eps, backend="torch", tol=1e-5, rho_x=rho, rho_y=rho)
    f, g = ref.solution.f, ref.solution.g
    lam = p.X.damping(eps)
    assert (lam < 1.0) == (rho is not None)
    be = MultiscaleBackend(TorchBackend(), p, 1e-3)
    be.kernel = True
    assert not be.layout(p.X).real.all()  # the case has padding rows
    flags = []

    def recording(kernel, grid, *args, **kw):
        sparse.launch.__wrapped__(kernel, grid, *args, **kw)
        if kernel is sparse._lse_sparse_shift_kernel:
            flags.append(args[7].cpu())

    recording.__wrapped__ = sparse.launch
    monkeypatch.setattr(sparse, "launch", recording)
    out, T = be.softmin(p.X, p.Y, g, eps, f, 0.0, lam, True, "ieee")
    assert len(flags) == 1 and int(flags[0].sum()) == 0
    torch.testing.assert_close(out, f, rtol=0, atol=1e-4)


def test_zero_weights_and_tiny_clouds():
    """Zero-weight points get the potential of the final plan; 1- and 2-point clouds work."""
    x, y = small_clouds(400, 300, d=2, seed=3)
    a = small_weights(400, 1)
    a[::7] = 0
    a = a / a.sum()
    kw = dict(eps=2e-3, tol=1e-7, n_iters=5000, backend="torch")
    ms = fs.sinkhorn(x, y, a, path="multiscale", **kw)
    ref = fs.sinkhorn(x, y, a, **kw)
    torch.testing.assert_close(ms.value, ref.value, rtol=1e-9, atol=0)
    c = (ms.f - ref.f)[a > 0].mean()
    torch.testing.assert_close(ms.f - c, ref.f, rtol=0, atol=1e-6)
    for n, m in [(1, 1), (5, 2)]:
        xs, ys = x[:n], y[:m]
        got = fs.sinkhorn(xs, ys, path="multiscale", **kw)
        want = fs.sinkhorn(xs, ys, **kw)
        torch.testing.assert_close(got.value, want.value, rtol=1e-9, atol=1e-12)


def test_gradient_reuses_the_solve_pattern(monkeypatch):
    """After a converged solve the envelope gradient reads the solve's pattern (its skipped
    bound at the final potentials is within the budget): no rebuild, and the same gradient
    as on a fresh pattern of every pair, to the budget's share of the plan's mass."""
    x, y = small_clouds(700, 600, d=3, seed=21)
    res = fs.sinkhorn(x, y, eps=2e-3, tol=1e-7, n_iters=5000, backend="torch", path="multiscale")
    sol = res.solution
    be, p = sol.backend, sol.problem
    built = be.state.rebuilds
    assert 0 < be.state.pattern.pairs < be.layout(p.X).tiles * be.layout(p.Y).tiles
    for rows, cols, f, g in ((p.X, p.Y, sol.f, sol.g), (p.Y, p.X, sol.g, sol.f)):
        G, marg = be.transport_grad(rows, cols, f, g, sol.eps, p.precision)
        assert be.state.rebuilds == built
        # a budget no pattern's bound can meet: a fresh pattern keeping every pair
        monkeypatch.setattr(be, "budget", -1.0)
        G_all, marg_all = be.transport_grad(rows, cols, f, g, sol.eps, p.precision)
        monkeypatch.undo()
        assert be.state.rebuilds == built + 1
        built = be.state.rebuilds
        scale = float(G_all.abs().max())
        torch.testing.assert_close(G, G_all, rtol=0, atol=1e-6 * scale)
        torch.testing.assert_close(marg, marg_all, rtol=0, atol=1e-7)
