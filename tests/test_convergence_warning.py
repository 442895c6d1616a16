"""Non-convergence is visible: results say converged=False, every entry point warns with
flashsinkhorn.ConvergenceWarning (once per call site, filterable, an error on request), and
fixed-iteration solves (tol=None) never warn."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import otdd

g = torch.Generator().manual_seed(0)
X = torch.rand(50, 3, generator=g)
Y = torch.rand(40, 3, generator=g) + 0.5
L1 = torch.arange(50) % 2
L2 = torch.arange(40) % 3
# eps = 1e-3 and 20 iterations: far from the tolerance 1e-3.
SHORT = dict(eps=1e-3, n_iters=20, tol=1e-3, scaling=None)

ENTRY_POINTS = {
    "sinkhorn": lambda **kw: fs.sinkhorn(X, Y, **kw),
    "solve": lambda **kw: fs.solve(torch.cdist(X, Y) ** 2, **kw),
    "ot_cost": lambda **kw: fs.ot_cost(X, Y, **kw),
    "sinkhorn_divergence": lambda **kw: fs.sinkhorn_divergence(X, Y, **kw),
    "SinkhornDivergence": lambda **kw: fs.SinkhornDivergence(**kw)(X, Y),
    "class_distance_matrix": lambda **kw: otdd.class_distance_matrix(X, L1, Y, L2, **kw),
    "otdd_distance": lambda **kw: otdd.otdd_distance(X, L1, Y, L2, **kw),
    "hvp": lambda **kw: fs.hvp(X, Y, torch.ones_like(X), **kw),
    "HessianOperator": lambda **kw: fs.HessianOperator(X, Y, **kw),
}


def test_warning_class_is_public_and_a_user_warning():
    assert issubclass(fs.ConvergenceWarning, UserWarning)
    assert "ConvergenceWarning" in fs.__all__


def test_results_say_converged_false():
    with pytest.warns(fs.ConvergenceWarning, match="^sinkhorn: the Sinkhorn solve stopped"):
        res = fs.sinkhorn(X, Y, **SHORT)
    assert res.converged is False and res.n_iters == 20
    assert res.marginal_error > 1e-3
    assert fs.sinkhorn(X, Y, eps=0.5, tol=1e-3).converged is True
    # A diverging iteration (NaN potentials) is not converged either.
    x = X.clone()
    x[0, 0] = math.inf
    with pytest.warns(fs.ConvergenceWarning, match="^sinkhorn: the Sinkhorn solve diverged"):
        bad = fs.sinkhorn(x, Y, eps=0.5, n_iters=20, check_finite=False, scaling=None)
    assert bad.converged is False and not math.isfinite(bad.errors[-1][1])
    with pytest.warns(fs.ConvergenceWarning, match="ot_cost: the Sinkhorn solve diverged"):
        fs.ot_cost(x, Y, eps=0.5, n_iters=20, check_finite=False, scaling=None)


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_entry_points_warn_when_tol_is_not_reached(name):
    with pytest.warns(fs.ConvergenceWarning, match=rf"^{name}: .*tol=0\.001") as rec:
        ENTRY_POINTS[name](**SHORT)
    # One warning per kind: otdd_distance reports the solves of W and its own apart.
    assert len(rec) == (2 if name == "otdd_distance" else 1)
    # The warning points at the caller's line, not inside the library or torch.
    assert all(w.filename == __file__ for w in rec)


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_warning_can_be_an_error(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", fs.ConvergenceWarning)
        with pytest.raises(fs.ConvergenceWarning, match="without reaching tol"):
            ENTRY_POINTS[name](**SHORT)


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_fixed_iterations_and_converged_solves_never_warn(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ENTRY_POINTS[name](**{**SHORT, "tol": None})
        ENTRY_POINTS[name](eps=0.5, tol=1e-3, n_iters=2000)


def test_divergence_names_the_terms_that_stopped_short():
    # x against itself converges at once; the cross term does not.
    with pytest.warns(fs.ConvergenceWarning, match=r"1 of its 3 Sinkhorn solves \(OT\(x, y\)\)"):
        fs.sinkhorn_divergence(X, Y, eps=1e-3, n_iters=20, scaling=None)


def test_batched_sinkhorn_warns_as_a_batch():
    with pytest.warns(fs.ConvergenceWarning, match="^sinkhorn: the batched Sinkhorn solve"):
        res = fs.sinkhorn(X.expand(2, -1, -1), Y.expand(2, -1, -1), **SHORT)
    assert res.converged is False


def test_once_per_call_site():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")
        for _ in range(3):
            fs.ot_cost(X, Y, **SHORT)  # one call site: one warning
        fs.ot_cost(X, Y, **SHORT)  # another call site: its own
    assert len([w for w in rec if issubclass(w.category, fs.ConvergenceWarning)]) == 2


def test_samples_loss_never_warns():
    # GeomLoss's loop runs a fixed ladder: there is no tolerance to miss.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs.SamplesLoss(blur=0.01, scaling=0.5)(X, Y)


def test_warning_after_backward_still_gives_the_gradient():
    x = X.clone().requires_grad_(True)
    with pytest.warns(fs.ConvergenceWarning):
        loss = fs.ot_cost(x, Y, **SHORT)
    loss.backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())


def test_divergence_self_terms_reach_a_tight_tolerance():
    # The self terms OT(x, x), OT(y, y) ran the alternating schedule of "auto" and stopped
    # about 1e-8 short of tol=1e-12 after 20,000 iterations, silently; they run the symmetric
    # schedule now (from zero its iterates stay symmetric) and converge in a few iterations.
    g64 = torch.Generator().manual_seed(2)
    x = torch.randn(11, 3, generator=g64, dtype=torch.float64)
    y = torch.randn(9, 3, generator=g64, dtype=torch.float64) * 0.8 + 0.4
    opts = fs.options.SinkhornOptions.build(x, y, eps=0.1, tol=1e-12, n_iters=20000)
    own = opts.for_self_transport()
    assert (own.schedule, own.acceleration) == ("symmetric", "none")
    explicit = fs.options.SinkhornOptions.build(x, y, eps=0.1, schedule="alternating")
    assert explicit.for_self_transport() is explicit
    for cost in ("sqeuclidean", "euclidean"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", fs.ConvergenceWarning)
            s = fs.sinkhorn_divergence(x, y, eps=0.1, tol=1e-12, n_iters=20000, cost=cost)
        assert float(s) > 0
