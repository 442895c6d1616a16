"""The Sinkhorn divergence's one-pass path against three separate solves.

``sinkhorn_divergence`` prepares the clouds once, solves the self terms OT(x, x), OT(y, y)
as one-potential self problems (stacked into one batch when the clouds have the same size)
and differentiates all three terms in one autograd node whose point gradients are batched
transports. The reference is the plain composition of three ``ot_cost`` calls (two-potential
solves, three autograd nodes), in float64 on the torch backend, and the torch backend for the
Triton kernels under the interpreter.

With ``tol=None`` both paths run the same iterations: the symmetric two-potential iteration
of OT(x, x) from zero potentials keeps f = g, which is the one-potential iteration, so the
values agree to round-off, not just at convergence.
"""

from __future__ import annotations

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import engine

from .test_acceleration import _clouds

F64 = torch.float64


def _inputs(B, n, m, d=3, seed=0, dtype=F64, grad=True):
    return [t.requires_grad_(grad) for t in _clouds(n, m, d, B, seed, dtype)]


def _on(device, tensors):
    """The tensors on ``device`` (CUDA where present, else the CPU under the interpreter)."""
    return [t.detach().to(device).requires_grad_() for t in tensors]


def _three_solves(x, y, a, b, **kw):
    s = fs.ot_cost(x, y, a, b, **kw) - 0.5 * (
        fs.ot_cost(x, x, a, a, **kw) + fs.ot_cost(y, y, b, b, **kw)
    )
    rx, ry = kw.get("rho_x"), kw.get("rho_y")
    if rx is not None or ry is not None:
        s = s + 0.5 * kw["eps"] * (a.sum(-1) - b.sum(-1)) ** 2
    return s


def _grads(s, inputs):
    return torch.autograd.grad(s.sum(), inputs)


FIXED = dict(eps=0.05, tol=None, n_iters=7, schedule="symmetric", scaling=None)
CONVERGED = dict(eps=0.05, tol=1e-11, n_iters=20_000, scaling=None)


@pytest.mark.parametrize("B", [None, 3])
@pytest.mark.parametrize(("n", "m"), [(23, 23), (23, 17)])
@pytest.mark.parametrize("rho", [None, 0.7])
@pytest.mark.parametrize("kw", [FIXED, CONVERGED], ids=["fixed-iterations", "converged"])
def test_matches_three_solves_in_float64(B, n, m, rho, kw):
    inputs = _inputs(B, n, m)
    kw = dict(kw, backend="torch", rho_x=rho, rho_y=rho)
    got = fs.sinkhorn_divergence(*inputs, **kw)
    ref = _three_solves(*inputs, **kw)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-13)
    for gg, gr in zip(_grads(got, inputs), _grads(ref, inputs), strict=True):
        torch.testing.assert_close(gg, gr, rtol=1e-10, atol=1e-12)


def test_self_terms_are_one_stacked_self_solve(monkeypatch):
    # Same-size clouds: OT(x, x) and OT(y, y) run as one batch of self problems (2 solves in
    # all, not 3), and the four point transports of the gradient as one launch.
    solves, grads = [], []
    real_run = engine.run

    def counting_run(problem, *args, **kw):
        solves.append((problem.X is problem.Y, problem.B))
        return real_run(problem, *args, **kw)

    monkeypatch.setattr(engine, "run", counting_run)
    x, y, a, b = _inputs(2, 19, 19)
    res = engine.solve_divergence(x.detach(), y.detach(), None, None, _opts(x, y))
    backend = type(res[0].solution.backend)
    real_grad = backend.transport_grad

    def counting_grad(self, R, C, *args):
        grads.append(R.x.shape[0])
        return real_grad(self, R, C, *args)

    monkeypatch.setattr(backend, "transport_grad", counting_grad)
    s = fs.sinkhorn_divergence(x, y, eps=0.05, backend="torch")
    _grads(s, (x, y))
    assert solves[:2] == [(False, 2), (True, 4)]
    assert grads == [4 * 2]  # x–y, x–x, y–x, y–y: one batch of 4 × B problems


def test_different_sizes_keep_separate_self_solves(monkeypatch):
    solves = []
    real_run = engine.run

    def counting_run(problem, *args, **kw):
        solves.append((problem.X is problem.Y, problem.B))
        return real_run(problem, *args, **kw)

    monkeypatch.setattr(engine, "run", counting_run)
    x, y, a, b = _inputs(None, 19, 12)
    fs.sinkhorn_divergence(x, y, eps=0.05, backend="torch")
    assert solves == [(False, 1), (True, 1), (True, 1)]


def _opts(x, y, **kw):
    from flashsinkhorn.options import SinkhornOptions

    return SinkhornOptions.build(x, y, eps=0.05, backend="torch", **kw)


def test_self_results_describe_their_own_problem():
    x, y, a, b = _inputs(None, 15, 15, grad=False)
    xy, xx, yy = engine.solve_divergence(x, y, a, b, _opts(x, y, tol=1e-10, n_iters=5000))
    for res, w in ((xx, a), (yy, b)):
        assert res.solution.problem.X is res.solution.problem.Y
        assert res.f.shape == w.shape and torch.equal(res.f, res.g)
        ra, rb = res.marginals()
        torch.testing.assert_close(ra, w, rtol=0, atol=1e-9)
        torch.testing.assert_close(rb, w, rtol=0, atol=1e-9)
        assert float(res.marginal_error) <= 1e-9
    s_xx = fs.sinkhorn_divergence(x, x, a, a, eps=0.05, tol=1e-11, n_iters=5000, backend="torch")
    assert float(s_xx) == pytest.approx(0.0, abs=1e-12)


def test_asymmetric_label_cost_matches_three_solves():
    # The y–y term reads W[l_i, l_j] (not the transpose the x–y problem holds for y).
    g = torch.Generator().manual_seed(5)
    x, y, a, b = _inputs(None, 17, 17, seed=5)
    lx = torch.randint(0, 3, (17,), generator=g)
    ly = torch.randint(0, 3, (17,), generator=g)
    W = (torch.rand(3, 3, generator=g, dtype=F64) * 0.5).requires_grad_()
    kw = dict(FIXED, backend="torch", label_x=lx, label_y=ly, label_cost=W)
    got = fs.sinkhorn_divergence(x, y, a, b, **kw)
    ref = fs.ot_cost(x, y, a, b, **kw) - 0.5 * (
        fs.ot_cost(x, x, a, a, **{**kw, "label_y": lx})
        + fs.ot_cost(y, y, b, b, **{**kw, "label_x": ly})
    )
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-13)
    for gg, gr in zip(_grads(got, (x, y, W)), _grads(ref, (x, y, W)), strict=True):
        torch.testing.assert_close(gg, gr, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("n", "m"), [(13, 13), (13, 11)])
def test_double_backward_matches_three_solves(n, m):
    x, y, _, _ = _inputs(None, n, m, seed=2)
    kw = dict(eps=0.1, tol=1e-12, n_iters=20_000, scaling=None, backend="torch",
              hvp_options={"cg_tol": 1e-12, "tau": 0.0})  # fmt: skip
    v = torch.randn(n, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = []
    for loss in (fs.sinkhorn_divergence(x, y, **kw), _three_solves(x, y, None, None, **kw)):
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        out.append(torch.autograd.grad((gx * v).sum(), (x, y)))
    for gg, gr in zip(*out, strict=True):
        torch.testing.assert_close(gg, gr, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize(("B", "n", "m"), [(None, 37, 37), (2, 37, 29)])
def test_triton_kernels_match_the_torch_backend(B, n, m, device):
    x, y, a, b = _on(device, _inputs(B, n, m, d=5, seed=3, dtype=torch.float32))
    kw = dict(eps=0.1, tol=None, n_iters=9, scaling=None, precision="ieee")
    got = fs.sinkhorn_divergence(x, y, a, b, backend="triton", **kw)
    ref = fs.sinkhorn_divergence(x, y, a, b, backend="torch", **kw)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for gg, gr in zip(_grads(got, (x, y, a, b)), _grads(ref, (x, y, a, b)), strict=True):
        torch.testing.assert_close(gg, gr, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rho", [None, 0.3])
def test_self_terms_test_every_three_iterations(rho):
    # The averaged self iteration contracts by about 2 per iteration: a test every 3
    # iterations (not check_every = 10) stops it within a few iterations of the tolerance.
    x, y, a, b = _inputs(2, 31, 31, seed=7, grad=False)
    kw = dict(tol=1e-3, n_iters=5000, scaling=None, rho_x=rho, rho_y=rho, check_every=10)
    xy, xx, yy = engine.solve_divergence(x, y, a, b, _opts(x, y, **kw))
    assert xx.converged and xx.schedule == "symmetric" and xx.acceleration == "none"
    assert [k for k, _ in xx.errors] == list(range(3, xx.n_iters + 1, 3))
    assert all(k % 10 == 0 for k, _ in xy.errors)
    assert float(xx.marginal_error.max()) <= 1e-3
    ref = _three_solves(x, y, a, b, eps=0.05, tol=1e-12, n_iters=20_000, scaling=None,
                        rho_x=rho, rho_y=rho, backend="torch")  # fmt: skip
    got = xy.value - 0.5 * (xx.value + yy.value)
    if rho is not None:
        got = got + 0.5 * 0.05 * (a.sum(-1) - b.sum(-1)) ** 2
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize(("n", "m"), [(21, 21), (21, 14)])
def test_dense_path_self_terms_have_their_own_gram_matrix(n, m, device):
    # The dense path (taken from d = 256 on) stores K = X Yᵀ of one problem: each self term
    # needs its own.
    from flashsinkhorn.backends.triton.configs import DENSE_MIN_D

    x, y, a, b = _on(device, _inputs(None, n, m, d=DENSE_MIN_D + 1, seed=4, dtype=torch.float32))
    kw = dict(eps=20.0, tol=None, n_iters=6, scaling=None, precision="ieee")
    got = fs.sinkhorn_divergence(x, y, a, b, backend="triton", **kw)
    ref = fs.sinkhorn_divergence(x, y, a, b, backend="torch", **kw)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for gg, gr in zip(_grads(got, (x, y)), _grads(ref, (x, y)), strict=True):
        torch.testing.assert_close(gg, gr, rtol=1e-4, atol=1e-5)
