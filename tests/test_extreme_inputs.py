"""Every entry point against the same extreme inputs, in float32 and float64: each refuses
with a ValueError naming the argument, or returns the float64 answer.

The inputs: eps at 1e-40, 1e-8·diameter², 1e6 and 1e300; coordinates at 1e20 (eps scaled
with them); weights of total mass 2e19. A float64 result is checked against a dense float64
reference (the large-eps limit ⟨C, a bᵀ⟩ where the log-domain reference itself loses the
cost), and a float32 result against the float64 one of the same entry point.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import ot
import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import distributed, otdd
from tests import reference as ref

_G = torch.Generator().manual_seed(3)
X = torch.rand(7, 2, generator=_G, dtype=torch.float64)
Y = torch.rand(5, 2, generator=_G, dtype=torch.float64) + 0.2
_ALL = torch.cat([X, Y])
DIAM2 = float(((_ALL.amax(0) - _ALL.amin(0)) ** 2).sum())
L1 = torch.tensor([0, 1, 0, 1, 0, 1, 1])
L2 = torch.tensor([0, 1, 1, 0, 0])

#: name: (eps, coordinate scale, total mass or None, the argument a refusal must name)
CASES = {
    "eps=1e-40": (1e-40, 1.0, None, "eps"),
    "eps=1e-8·diam²": (1e-8 * DIAM2, 1.0, None, "eps"),
    "eps=1e6": (1e6, 1.0, None, "eps"),
    "eps=1e300": (1e300, 1.0, None, "eps"),
    "coordinates 1e20": (0.5 * 1e40, 1e20, None, "x"),
    "mass 2e19": (0.5, 1.0, 2e19, "a"),
}


def _inputs(case: str, dtype):
    eps, scale, mass, _ = CASES[case]
    x, y = (X * scale).to(dtype), (Y * scale).to(dtype)
    a = b = None
    if mass is not None:
        a = torch.full((7,), mass / 7, dtype=dtype)
        b = torch.full((5,), mass / 5, dtype=dtype)
    return x, y, a, b, eps


def _cost_matrix(x, y):
    C = torch.cdist(x.double(), y.double()) ** 2
    return C.to(x.dtype)


#: Few iterations keep the test fast; a solve they do not converge is reported (below).
N = {"n_iters": 100}

ENTRIES = {
    "sinkhorn": lambda x, y, a, b, e: fs.sinkhorn(x, y, a, b, eps=e, **N),
    # the block-sparse soft-mins are slow on the CPU: a short ladder and few iterations
    "sinkhorn multiscale": lambda x, y, a, b, e: fs.sinkhorn(
        x, y, a, b, eps=e, path="multiscale", n_iters=20, scaling=0.3
    ),
    "solve": lambda x, y, a, b, e: fs.solve(_cost_matrix(x, y), a, b, eps=e, **N),
    "ot_cost": lambda x, y, a, b, e: fs.ot_cost(x, y, a, b, eps=e, **N),
    "ot_cost gradient": lambda x, y, a, b, e: torch.autograd.grad(
        fs.ot_cost(x.requires_grad_(), y, a, b, eps=e, **N), x
    )[0],
    "sinkhorn_divergence": lambda x, y, a, b, e: fs.sinkhorn_divergence(x, y, a, b, eps=e, **N),
    "SinkhornDivergence": lambda x, y, a, b, e: fs.SinkhornDivergence(eps=e, **N)(x, y, a, b),
    "hvp": lambda x, y, a, b, e: fs.hvp(x, y, torch.ones_like(x), a, b, eps=e, **N),
    "HessianOperator": lambda x, y, a, b, e: fs.HessianOperator(x, y, a, b, eps=e, **N).matvec(
        torch.ones_like(x)
    ),
    # the sharded solve on a process group of one gloo rank (fixture ``one_rank``)
    "distributed.sinkhorn": lambda x, y, a, b, e: (
        distributed.sinkhorn(x, y, a, b, eps=e, **N).value
    ),
    "distributed.sinkhorn_divergence": lambda x, y, a, b, e: distributed.sinkhorn_divergence(
        x, y, a, b, eps=e, **N
    ),
    # GeomLoss's conventions: eps = blur² in units of ½‖x − y‖²
    "SamplesLoss": lambda x, y, a, b, e: (
        fs.SamplesLoss(blur=math.sqrt(e))(x, y)
        if a is None
        else fs.SamplesLoss(blur=math.sqrt(e))(a, x, b, y)
    ),
    "otdd_distance": lambda x, y, a, b, e: otdd.otdd_distance(x, L1, y, L2, eps=e, a1=a, a2=b, **N),
}

#: Argument names a refusal may use for each argument of the cases.
NAMES = {"eps": ("eps", "blur"), "x": ("x", "C"), "a": ("a", "a1")}


def _run(entry: str, case: str, dtype):
    """(output tensor, whether the solves reported convergence)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fs.ConvergenceWarning)
        out = ENTRIES[entry](*_inputs(case, dtype))
    converged = not any(issubclass(w.category, fs.ConvergenceWarning) for w in caught)
    if isinstance(out, fs.SinkhornResult):
        converged = converged and bool(out.converged)
        out = out.value
    return getattr(out, "hvp", out), converged


def _reference(case: str) -> float:
    """OT_eps of the float64 inputs, dense float64 (the mean cost at large eps). Scaled
    coordinates are solved at scale 1: OT_{s²eps}(s x, s y) = s² OT_eps(x, y)."""
    x, y, a, b, eps = _inputs(case, torch.float64)
    s2 = CASES[case][1] ** 2
    eps = eps / s2
    C = ref.cost(x.numpy() / CASES[case][1], y.numpy() / CASES[case][1])
    wa = np.full(7, 1 / 7) if a is None else a.numpy()
    wb = np.full(5, 1 / 5) if b is None else b.numpy()
    if eps > 1e4 * C.max():
        return s2 * float(wa @ C @ wb) / wa.sum()
    if eps < 1e-6 * C.max():
        # the unregularised cost (the log-domain reference crawls there)
        return s2 * float(ot.emd2(wa, wb, C))
    f, g, P = ref.solve_cost(C, wa, wb, eps, tol=1e-12)
    return s2 * float(wa @ f + wb @ g - eps * (P.sum() - wa.sum() * wb.sum()))


def _outcome(entry, case, dtype):
    try:
        return *_run(entry, case, dtype), None
    except ValueError as e:
        return None, None, str(e)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_extreme_input_is_refused_or_right(entry, case, request):
    if entry.startswith("distributed."):
        request.getfixturevalue("one_rank")
    if entry == "sinkhorn multiscale" and case in ("eps=1e6", "eps=1e300"):
        # a documented refusal of the path (eps at the scale of the cost), named in the error
        with pytest.raises(ValueError, match="path='multiscale' is for small eps"):
            _run(entry, case, torch.float64)
        return
    results, converged = {}, {}
    for dtype in (torch.float64, torch.float32):
        out, converged[dtype], message = _outcome(entry, case, dtype)
        if message is not None:
            names = NAMES[CASES[case][3]]
            assert any(
                message.startswith(f"{n}=") or f"{n} " in message or f"{n}=" in message
                for n in names
            ), (entry, case, dtype, message)
            continue
        assert torch.isfinite(out).all(), (entry, case, dtype)
        results[dtype] = out.double()
    if torch.float32 in results:
        # a float32 answer must be the float64 one (which must exist)
        assert torch.float64 in results, (entry, case)
        scale = float(results[torch.float64].abs().max())
        torch.testing.assert_close(results[torch.float32], results[torch.float64],
                                   rtol=2e-3, atol=1e-6 * scale)  # fmt: skip
    if torch.float64 in results and entry in ("sinkhorn", "solve", "ot_cost"):
        # right, or reported as not converged (sinkhorn/solve: converged=False; the losses:
        # a ConvergenceWarning): at eps = 1e-8·diameter² even 20,000 iterations stay 2 % short
        want = _reference(case)
        close = math.isclose(float(results[torch.float64]), want, rel_tol=1e-3)
        assert close or not converged[torch.float64], (entry, case)


# ----------------------------------------------------------------- a given cost matrix


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [1e6, 1e12, 1e30, 1e300])
def test_solve_at_large_eps_is_the_mean_cost_or_refused(dtype, eps):
    # Before: float32 0.927 for the mean cost 0.714 at eps = 1e6, 1.2e23 at 1e30, NaN at
    # 1e300; float64 −1.1e14 at 1e30. solve() now admits its problem like sinkhorn().
    x, y = X.to(dtype), Y.to(dtype)
    C = _cost_matrix(x, y)
    mean = float(C.double().mean())
    if dtype == torch.float32 and eps > 1e37:
        with pytest.raises(ValueError, match=r"eps=1e\+300 is too large for float32"):
            fs.solve(C, eps=eps)
        return
    res = fs.solve(C, eps=eps)
    assert res.converged
    assert math.isclose(float(res.value), mean, rel_tol=1e-6)
    assert math.isclose(float(fs.sinkhorn(x, y, eps=eps).value), float(res.value), rel_tol=1e-6)


def test_solve_at_large_eps_with_weights_and_batches():
    a = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.05, 0.1, 0.1], dtype=torch.float64)
    b = torch.tensor([0.3, 0.1, 0.2, 0.25, 0.15], dtype=torch.float64)
    C = _cost_matrix(X, Y)
    want = float(a @ C @ b)
    res = fs.solve(C.float(), a.float(), b.float(), eps=1e8)
    assert math.isclose(float(res.value), want, rel_tol=1e-5)
    batch = fs.solve(torch.stack([C, 2 * C]).float(), eps=1e8)
    means = [float(C.mean()), float(2 * C.mean())]
    torch.testing.assert_close(batch.value.double(), torch.tensor(means, dtype=torch.float64),
                               rtol=1e-5, atol=0)  # fmt: skip


@pytest.mark.parametrize("eps", [1e-7, 1e-8])
def test_solve_gradient_below_the_float32_plan_floor_is_refused(eps):
    # Before: the gradient w.r.t. C was 8 % (1e-7) and 37 % (1e-8) off float64, silently.
    C = _cost_matrix(X, Y).float().requires_grad_()
    res = fs.solve(C, eps=eps, tol=None, n_iters=50)
    with pytest.raises(ValueError, match="too small for the gradient with respect to C"):
        res.value.backward()
    with pytest.raises(ValueError, match="too small for the convergence test"):
        fs.solve(C, eps=eps)
    # float64 resolves the plan there
    C64 = _cost_matrix(X, Y).requires_grad_()
    fs.solve(C64, eps=eps, tol=None, n_iters=50).value.backward()
    assert torch.isfinite(C64.grad).all()


def test_solve_refuses_a_cost_beyond_float32():
    C = torch.full((3, 4), 3e37)
    C[0, 0] = 0.0
    with pytest.raises(ValueError, match="C is too large for float32"):
        fs.solve(C, eps=1.0)
