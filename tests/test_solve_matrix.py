"""flashsinkhorn.solve(C, a, b): entropic OT for a given cost matrix.

Oracles: a dense float64 log-domain Sinkhorn on C written below (NumPy), the primal objective
of its plan, POT (``ot.solve``, ``ot.sinkhorn``, ``ot.unbalanced``) where installed, and
``sinkhorn(x, y)`` when C holds the squared distances of two clouds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

import flashsinkhorn as fs

from .reference import kl, solve_cost

F64 = torch.float64
TIGHT = dict(tol=1e-12, n_iters=100_000)


def dense_solve(C, a, b, eps, rho_x=None, rho_y=None, iters=200_000, tol=1e-14):
    """(f, g, P) of min <C, P> + eps KL(P | a⊗b) [+ rho KL terms] in float64 (reference.py's
    alternating log-domain Sinkhorn, run until the potentials stop moving)."""
    return solve_cost(C, a, b, eps, rho_x, rho_y, iters, tol)


def primal(C, a, b, P, eps, rho_x=None, rho_y=None):
    """<C, P> + eps KL(P | a⊗b) + rho_x KL(P1 | a) + rho_y KL(Pᵀ1 | b), float64."""
    C, a, b, P = (np.asarray(t, np.float64) for t in (C, a, b, P))
    val = float((C * P).sum()) + eps * kl(P, np.outer(a, b))
    if rho_x is not None:
        val += rho_x * kl(P.sum(1), a)
    if rho_y is not None:
        val += rho_y * kl(P.sum(0), b)
    return val


def problem(n=9, m=12, B=None, seed=0, dtype=F64, zero=False):
    """A non-metric cost (uniform entries plus a rank-one term) and random simplex weights."""
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    C = torch.rand(*lead, n, m, generator=g, dtype=F64)
    C = C + torch.rand(*lead, n, 1, generator=g, dtype=F64) * torch.rand(*lead, 1, m, generator=g,
                                                                           dtype=F64)  # fmt: skip
    a = torch.rand(*lead, n, generator=g, dtype=F64) + 0.1
    b = torch.rand(*lead, m, generator=g, dtype=F64) + 0.1
    if zero:
        a[..., 2] = 0.0
    return (
        C.to(dtype),
        (a / a.sum(-1, keepdim=True)).to(dtype),
        (b / b.sum(-1, keepdim=True)).to(dtype),
    )


# ----------------------------------------------------------------------------- dense oracle


@pytest.mark.parametrize("rho", [(None, None), (0.4, 0.4), (0.4, None), (None, 1.5)])
@pytest.mark.parametrize("zero", [False, True])
def test_matches_dense_float64_reference(rho, zero):
    rho_x, rho_y = rho
    C, a, b = problem(zero=zero)
    eps = 0.15
    res = fs.solve(C, a, b, eps=eps, rho_x=rho_x, rho_y=rho_y, **TIGHT)
    f, g, P = dense_solve(C, a, b, eps, rho_x, rho_y)
    assert res.converged and res.path == "matrix" and res.f.dtype == F64
    np.testing.assert_allclose(res.plan().numpy(), P, rtol=1e-9, atol=1e-13)
    np.testing.assert_allclose(float(res.value), primal(C, a, b, P, eps, rho_x, rho_y),
                               rtol=1e-10)  # fmt: skip
    # Potentials: unique for a relaxed side; a balanced pair only up to (f + c, g − c).
    shift = 0.0 if (rho_x or rho_y) else float((res.f - torch.from_numpy(f))[0])
    keep = (a > 0).numpy()
    np.testing.assert_allclose(res.f.numpy()[keep], f[keep] + shift, atol=1e-9)
    np.testing.assert_allclose(res.g.numpy(), g - shift, atol=1e-9)
    # A zero-weight row gets the potential of the final soft-min (as for point clouds).
    if zero:
        T = -eps * logsumexp(np.log(b.numpy())[None, :] + (res.g.numpy()[None] - C.numpy()) / eps,
                             axis=1)  # fmt: skip
        lam = 1.0 if rho_x is None else rho_x / (rho_x + eps)
        assert abs(res.f[2].item() - lam * T[2]) < 1e-9


@pytest.mark.parametrize(
    "schedule, acceleration",
    [
        ("symmetric", "none"),
        ("alternating", "none"),
        ("alternating", "overrelax"),
        ("alternating", "anderson"),
        ("symmetric", "anderson"),
    ],  # fmt: skip
)
def test_every_schedule_and_acceleration_reaches_the_same_plan(schedule, acceleration):
    C, a, b = problem(seed=1)
    _, _, P = dense_solve(C, a, b, 0.1)
    res = fs.solve(C, a, b, eps=0.1, schedule=schedule, acceleration=acceleration, **TIGHT)
    assert res.converged and res.schedule == schedule and res.acceleration == acceleration
    np.testing.assert_allclose(res.plan().numpy(), P, rtol=1e-8, atol=1e-13)
    assert float(res.marginal_error) <= 1e-12


def test_annealing_starts_at_the_spread_of_the_cost():
    # eps / spread = 3e-4 < 1e-3: "auto" anneals; an explicit ladder too, from max C − min C.
    C, a, b = problem(n=15, m=11, seed=2)
    C = 3.0 + 2.0 * C  # a constant offset changes neither the plan nor the ladder
    eps = 3e-4 * float(C.max() - C.min())
    auto = fs.solve(C, a, b, eps=eps, tol=1e-9, n_iters=100_000)
    ladder = fs.solve(C, a, b, eps=eps, tol=1e-9, n_iters=100_000, scaling=0.5)
    fixed = fs.solve(C, a, b, eps=eps, tol=1e-9, n_iters=100_000, scaling=None)
    assert auto.converged and ladder.converged and fixed.converged
    n_ladder = len(fs.solvers.eps_schedule(eps, 0.5, float(C.max() - C.min()) ** 0.5)) - 1
    assert n_ladder > 5 and ladder.n_iters > n_ladder
    for r in (auto, ladder):
        torch.testing.assert_close(r.plan(), fixed.plan(), rtol=1e-5, atol=1e-8)


def test_fixed_iterations_run_exactly_n_iters():
    C, a, b = problem()
    res = fs.solve(C, a, b, eps=0.2, tol=None, n_iters=7)
    assert res.n_iters == 7 and not res.converged and res.schedule == "symmetric"
    P = res.plan()
    err = (P.sum(1) - a).abs().sum() + (P.sum(0) - b).abs().sum()
    torch.testing.assert_close(res.marginal_error, err, rtol=1e-9, atol=1e-15)


def test_batched_equals_one_solve_per_problem():
    C, a, b = problem(B=3, n=6, m=8, seed=3)
    shared = a[0]
    for wa in (a, shared):
        res = fs.solve(C, wa, b, eps=0.2, **TIGHT)
        assert res.value.shape == (3,) and res.f.shape == (3, 6) and res.plan().shape == (3, 6, 8)
        for k in range(3):
            one = fs.solve(C[k], wa if wa.dim() == 1 else wa[k], b[k], eps=0.2, **TIGHT)
            torch.testing.assert_close(res.plan()[k], one.plan(), rtol=1e-9, atol=1e-14)
            torch.testing.assert_close(res.value[k], one.value, rtol=1e-11, atol=0)


def test_agrees_with_sinkhorn_on_squared_distances():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 40, 3, generator=g, dtype=F64)
    y = torch.randn(2, 35, 3, generator=g, dtype=F64) + 0.5
    C = ((x[:, :, None] - y[:, None]) ** 2).sum(-1)
    for rho in (None, 1.0):
        pts = fs.sinkhorn(x, y, eps=0.2, rho_x=rho, rho_y=rho, scaling=None, **TIGHT)
        mat = fs.solve(C, eps=0.2, rho_x=rho, rho_y=rho, scaling=None, **TIGHT)
        torch.testing.assert_close(mat.value, pts.value, rtol=1e-10, atol=0)
        torch.testing.assert_close(mat.plan(), pts.plan(), rtol=1e-8, atol=1e-14)
        # Same loop from the same zero potentials: the same potentials, not only up to a shift.
        torch.testing.assert_close(mat.f, pts.f, rtol=0, atol=1e-9)
        torch.testing.assert_close(mat.g, pts.g, rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_cost_is_solved_in_float32(dtype):
    C, a, b = problem(n=20, m=16, seed=5)
    Cl = C.to(dtype)
    res = fs.solve(Cl, eps=0.1, tol=1e-5)
    ref = fs.solve(Cl.double(), eps=0.1, **TIGHT)  # the same rounded entries, in float64
    assert res.value.dtype == torch.float32 and res.f.dtype == torch.float32
    torch.testing.assert_close(res.value.double(), ref.value, rtol=1e-5, atol=0)
    torch.testing.assert_close(res.plan().double(), ref.plan(), rtol=0, atol=1e-5 / 20)


# ----------------------------------------------------------------------------- POT


@pytest.mark.parametrize("batched", [False, True])
def test_balanced_matches_pot(batched):
    ot = pytest.importorskip("ot")
    C, a, b = problem(B=2 if batched else None, seed=6)
    eps = 0.08
    res = fs.solve(C, a, b, eps=eps, **TIGHT)
    for k in range(2 if batched else 1):
        Ck, ak, bk = (t[k] if batched else t for t in (C, a, b))
        P = ot.sinkhorn(ak, bk, Ck, eps, stopThr=1e-14, numItermax=100_000)
        pot = ot.solve(Ck, ak, bk, reg=eps, tol=1e-14, max_iter=100_000)
        mine = res.plan()[k] if batched else res.plan()
        value = res.value[k] if batched else res.value
        torch.testing.assert_close(mine, P, rtol=1e-8, atol=1e-14)
        torch.testing.assert_close(value, pot.value, rtol=1e-10, atol=0)
        torch.testing.assert_close((mine * Ck).sum(), pot.value_linear, rtol=1e-9, atol=0)


@pytest.mark.parametrize("rho", [(0.5, 0.5), (0.5, 2.0), (0.5, None)])
def test_unbalanced_plan_matches_pot(rho):
    ot = pytest.importorskip("ot")
    C, a, b = problem(seed=7)
    a = 1.5 * a  # unequal masses
    eps = 0.2
    rho_x, rho_y = rho
    res = fs.solve(C, a, b, eps=eps, rho_x=rho_x, rho_y=rho_y, **TIGHT)
    reg_m = (rho_x, float("inf") if rho_y is None else rho_y)
    P = ot.unbalanced.sinkhorn_unbalanced(a, b, C, eps, reg_m, reg_type="kl", stopThr=1e-15,
                                          numItermax=100_000)  # fmt: skip
    torch.testing.assert_close(res.plan(), P, rtol=1e-8, atol=1e-14)
    np.testing.assert_allclose(float(res.value), primal(C, a, b, P, eps, rho_x, rho_y),
                               rtol=1e-9)  # fmt: skip


# ----------------------------------------------------------------------------- gradients


def test_gradient_wrt_cost_is_the_plan_and_passes_gradcheck():
    C, a, b = problem(n=4, m=5, seed=8)
    Cg = C.clone().requires_grad_()
    res = fs.solve(Cg, a, b, eps=0.3, **TIGHT)
    (grad,) = torch.autograd.grad(res.value, Cg)
    torch.testing.assert_close(grad, res.plan(), rtol=0, atol=0)
    for rho in (None, 0.7):
        fn = lambda C, r=rho: fs.solve(C, a, b, eps=0.3, rho_x=r, rho_y=r, **TIGHT).value
        assert torch.autograd.gradcheck(fn, (C.clone().requires_grad_(),), eps=1e-6, atol=1e-7)


def test_weight_gradients_pass_gradcheck():
    C, a, b = problem(n=4, m=5, seed=9)

    def relaxed(C, a, b):
        return fs.solve(C, a, b, eps=0.3, rho_x=0.6, rho_y=1.2, **TIGHT).value

    args = (C.clone().requires_grad_(), a.clone().requires_grad_(), b.clone().requires_grad_())
    assert torch.autograd.gradcheck(relaxed, args, eps=1e-6, atol=1e-7)

    # Balanced: weights on the simplex (softmax), where f and g are the derivative up to a
    # constant that the softmax's Jacobian removes.
    def balanced(C, la, lb):
        return fs.solve(C, la.softmax(-1), lb.softmax(-1), eps=0.3, **TIGHT).value

    args = (C.clone().requires_grad_(), a.log().requires_grad_(), b.log().requires_grad_())
    assert torch.autograd.gradcheck(balanced, args, eps=1e-6, atol=1e-7)


def test_balanced_weight_gradients_are_the_potentials():
    C, a, b = problem(B=2, seed=10)
    a0 = a[0].clone().requires_grad_()  # shared by both problems: gradients add up
    b1 = b.clone().requires_grad_()
    res = fs.solve(C, a0, b1, eps=0.2, **TIGHT)
    go = torch.tensor([1.0, -2.0], dtype=F64)
    ga, gb = torch.autograd.grad(res.value, (a0, b1), go)
    torch.testing.assert_close(ga, res.f[0] - 2.0 * res.f[1], rtol=0, atol=1e-15)
    torch.testing.assert_close(gb, go[:, None] * res.g, rtol=0, atol=0)


def test_second_derivative_is_refused():
    C, a, b = problem(n=4, m=5)
    C = C.requires_grad_()
    (g,) = torch.autograd.grad(fs.solve(C, a, b, eps=0.3).value, C, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives"):
        g.sum().backward()


def test_value_is_detached_without_grad_inputs_and_under_no_grad():
    C, a, b = problem()
    assert fs.solve(C, a, b, eps=0.2).value.grad_fn is None
    with torch.no_grad():
        assert fs.solve(C.requires_grad_(), a, b, eps=0.2).value.grad_fn is None


# ----------------------------------------------------------------------------- the result


def test_result_operators_use_the_plan():
    C, a, b = problem(B=2, n=7, m=5, seed=11)
    res = fs.solve(C, a, b, eps=0.2, tol=1e-6, rho_x=2.0)
    P = res.plan()
    g = torch.Generator().manual_seed(0)
    V = torch.randn(2, 5, 3, generator=g, dtype=F64)
    U = torch.randn(2, 7, generator=g, dtype=F64)
    torch.testing.assert_close(res.apply(V), P @ V, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(res.apply_T(U), (P.transpose(1, 2) @ U[..., None])[..., 0],
                               rtol=1e-12, atol=1e-15)  # fmt: skip
    ra, rb = res.marginals()
    torch.testing.assert_close(ra, P.sum(2), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(rb, P.sum(1), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="barycentric_map"):
        res.barycentric_map()


def test_small_row_blocks_give_the_same_solve():
    from flashsinkhorn.backends.matrix import MatrixBackend, prepare_matrix
    from flashsinkhorn.options import SinkhornOptions
    from flashsinkhorn.solvers import solve as loop_solve

    C, a, b = problem(B=2, n=13, m=11, seed=12)
    prob, _ = prepare_matrix(C, a, b, rho_x=None, rho_y=None)
    opts = SinkhornOptions.build(eps=0.2, tol=None, n_iters=30).resolve(None)
    whole = loop_solve(prob, MatrixBackend(), [0.2], opts)
    blocks = loop_solve(prob, MatrixBackend(chunk_elements=2 * 3 * 11), [0.2], opts)
    torch.testing.assert_close(blocks.f, whole.f, rtol=0, atol=1e-14)
    V = torch.randn(2, 11, 4, dtype=F64)
    out, marg = MatrixBackend(chunk_elements=30).transport(prob.X, prob.Y, whole.f, whole.g, 0.2,
                                                           V, None, None, "ieee")  # fmt: skip
    ref, ref_marg = MatrixBackend().transport(prob.X, prob.Y, whole.f, whole.g, 0.2, V, None,
                                              None, "ieee")  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(marg, ref_marg, rtol=1e-13, atol=1e-15)


def test_inputs_are_not_modified():
    C, a, b = problem(zero=True)
    copies = [t.clone() for t in (C, a, b)]
    C.requires_grad_()
    fs.solve(C, a, b, eps=0.2, rho_x=1.0).value.backward()
    for t, c in zip((C.detach(), a, b), copies, strict=True):
        assert torch.equal(t, c)


# ----------------------------------------------------------------------------- validation


def _bad_calls():
    C = torch.rand(4, 5)
    a, b = torch.full((4,), 0.25), torch.full((5,), 0.2)
    return [
        (TypeError, "C must be a torch.Tensor", lambda: fs.solve(C.tolist(), eps=1.0)),
        # a NumPy C is solved (NumPy out); NumPy weights beside a tensor C are not
        (TypeError, "a is a NumPy array while", lambda: fs.solve(C, a.numpy(), eps=1.0)),
        (TypeError, "C must have a real floating dtype", lambda: fs.solve(C.int(), eps=1.0)),
        (ValueError, "C must be 2-D", lambda: fs.solve(C[0], eps=1.0)),
        (ValueError, "C must be 2-D", lambda: fs.solve(C[None, None], eps=1.0)),
        (ValueError, "C must not be empty", lambda: fs.solve(C[:0], eps=1.0)),
        (
            ValueError,
            "C must not contain NaN",
            lambda: fs.solve(C.index_fill(0, torch.tensor(1), float("nan")), eps=1.0),
        ),
        (
            ValueError,
            "C must not contain NaN",
            lambda: fs.solve(C.index_fill(1, torch.tensor(1), float("inf")), eps=1.0),
        ),
        (TypeError, "a must be a torch.Tensor", lambda: fs.solve(C, [0.25] * 4, eps=1.0)),
        (TypeError, "a must have a real floating", lambda: fs.solve(C, a.long(), eps=1.0)),
        (
            ValueError,
            r"a must have shape \(4,\), one weight per row",
            lambda: fs.solve(C, b, eps=1.0),
        ),
        (
            ValueError,
            r"b must have shape \(5,\), one weight per column",
            lambda: fs.solve(C, a, a, eps=1.0),
        ),
        (
            ValueError,
            r"b must have shape \(2, 5\) or \(5,\)",
            lambda: fs.solve(torch.rand(2, 4, 5), None, torch.rand(3, 5), eps=1.0),
        ),
        (ValueError, "a must be non-negative", lambda: fs.solve(C, -a, eps=1.0)),
        (ValueError, "b must be finite", lambda: fs.solve(C, a, b / 0.0, eps=1.0)),
        (
            ValueError,
            "a must have a positive total mass",
            lambda: fs.solve(C, 0 * a, eps=1.0, rho_x=1.0),
        ),
        (ValueError, "a and b must have equal total mass", lambda: fs.solve(C, 2 * a, b, eps=1.0)),
        (TypeError, "required keyword-only argument: .eps.", lambda: fs.solve(C)),
        (ValueError, "eps must be finite and > 0", lambda: fs.solve(C, eps=0.0)),
        (ValueError, "rho_x must be finite and > 0", lambda: fs.solve(C, eps=1.0, rho_x=-1.0)),
        (ValueError, "schedule must be one of", lambda: fs.solve(C, eps=1.0, schedule="x")),
        (ValueError, "scaling must be in", lambda: fs.solve(C, eps=1.0, scaling=1.5)),
        (TypeError, "n_iters must be an int", lambda: fs.solve(C, eps=1.0, n_iters=2.5)),
        (TypeError, "unexpected keyword", lambda: fs.solve(C, eps=1.0, backend="triton")),
        (TypeError, "unexpected keyword", lambda: fs.solve(C, eps=1.0, check_finite=False)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_invalid_arguments_name_the_argument(case):
    exc, match, call = _bad_calls()[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.gpu
def test_cuda_matches_cpu_float64():
    C, a, b = problem(B=2, n=300, m=200, seed=13)
    ref = fs.solve(C, a, b, eps=0.05, tol=1e-6)
    Cg = C.float().cuda().requires_grad_()
    res = fs.solve(Cg, a.float().cuda(), b.float().cuda(), eps=0.05, tol=1e-4)
    assert res.converged and res.path == "matrix" and res.f.device.type == "cuda"
    torch.testing.assert_close(res.value.double().cpu(), ref.value, rtol=1e-5, atol=0)
    res.value.sum().backward()
    torch.testing.assert_close(Cg.grad.double().cpu(), ref.plan(), rtol=0, atol=1e-4 / 300)


def test_float32_plan_outputs_of_a_rectangular_matrix():
    # The float32 plan floor reads the spread of C (a matrix problem has no points whose
    # bounding box it could take; rows and columns of C have different lengths).
    g = torch.Generator().manual_seed(2)
    C = torch.rand(2, 30, 20, generator=g).requires_grad_()
    res = fs.solve(C, eps=0.05, tol=1e-4)
    res.value.sum().backward()
    torch.testing.assert_close(C.grad, res.plan(), rtol=0, atol=1e-7)
    tiny = fs.solve(C.detach(), eps=1e-7, tol=None, n_iters=5)
    with pytest.raises(ValueError, match="too small for plan"):
        tiny.plan()
