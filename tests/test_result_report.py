"""A result reports itself: its repr, the annealing share of n_iters, the error history and
the progress report of long solves (options checked alike at every entry point)."""

from __future__ import annotations

import re
import sys
import types
import warnings

import pytest
import torch

import flashsinkhorn as fs

g = torch.Generator().manual_seed(3)
X = torch.rand(37, 3, generator=g, dtype=torch.float64)
Y = torch.rand(29, 3, generator=g, dtype=torch.float64) + 0.2
C = torch.cdist(X, Y) ** 2


def test_repr_shows_value_iterations_error_and_converged():
    res = fs.sinkhorn(X, Y, eps=0.05)
    text = repr(res)
    assert res.converged
    value = float(re.search(r"value=([-0-9.e]+)", text).group(1))
    assert value == pytest.approx(float(res.value), rel=1e-5)
    error = float(re.search(r"marginal_error=([-0-9.e]+)", text).group(1))
    assert error == pytest.approx(float(res.marginal_error), rel=1e-2)
    assert f"n_iters={res.n_iters}," in text and "converged=True" in text
    assert str(res) == text


def test_repr_of_an_unconverged_solve_is_cheap_and_names_the_last_test():
    with pytest.warns(fs.ConvergenceWarning):
        res = fs.sinkhorn(X, Y, eps=1e-3, n_iters=25, scaling=None)
    text = repr(res)
    it, err = res.errors[-1]
    assert f"last_tested_error={err:.3g} (iteration {it})" in text
    assert "converged=False" in text
    assert res._error is None  # printing ran no pass over the plan


def test_repr_of_a_batch_summarises_the_values():
    xb = torch.stack([X, 2 * X])
    res = fs.sinkhorn(xb, Y.expand(2, -1, -1), eps=0.05)
    text = repr(res)
    lo, hi = sorted(res.value.tolist())
    assert f"value=[2 values in {lo:.6g} .. {hi:.6g}]" in text
    assert f"marginal_error=max {float(res.marginal_error.max()):.3g}" in text


def test_repr_with_fixed_iterations_and_a_cost_matrix():
    res = fs.solve(C, eps=0.05, n_iters=7, tol=None)
    text = repr(res)
    assert "n_iters=7," in text and "not tested" in text and "path='matrix'" in text
    assert f"value={float(res.value):.6g}" in text


def test_n_iters_counts_annealing_and_n_annealing_says_how_much():
    res = fs.sinkhorn(X, Y, eps=1e-3, n_iters=5, tol=None, scaling=0.5)
    assert res.n_annealing > 0
    assert res.n_iters == res.n_annealing + 5
    assert f"({res.n_annealing} annealing + 5 at eps)" in repr(res)
    assert fs.sinkhorn(X, Y, eps=0.05, n_iters=5, tol=None, scaling=None).n_annealing == 0
    # with a tolerance: the test iterations count from the start of the ladder too
    res = fs.sinkhorn(X, Y, eps=1e-3, scaling=0.5, check_every=1)
    assert res.errors[0][0] == res.n_annealing + 1
    assert res.n_iters == res.errors[-1][0]


def test_error_history_is_the_convergence_curve():
    res = fs.sinkhorn(X, Y, eps=0.01, check_every=1, acceleration="none")
    its, errs = zip(*res.errors, strict=True)
    assert list(its) == list(range(1, res.n_iters + 1))
    assert errs[-1] <= 1e-3 < errs[0]
    assert errs[-1] == pytest.approx(float(res.marginal_error), rel=1e-9)
    assert isinstance(res.errors, list) and type(res.errors) is list


ENTRY_POINTS = {
    "sinkhorn": lambda **kw: fs.sinkhorn(X, Y, **kw),
    "solve": lambda **kw: fs.solve(C, **kw),
    "ot_cost": lambda **kw: fs.ot_cost(X, Y, **kw),
    "sinkhorn_divergence": lambda **kw: fs.sinkhorn_divergence(X, Y, **kw),
    "SinkhornDivergence": lambda **kw: fs.SinkhornDivergence(**kw)(X, Y),
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_progress_callback_sees_every_test(name):
    seen = []
    res = ENTRY_POINTS[name](eps=0.02, progress=lambda it, err: seen.append((it, err)))
    assert seen and all(isinstance(i, int) and isinstance(e, float) for i, e in seen)
    assert seen[-1][1] <= 1e-3
    if name in ("sinkhorn", "solve"):
        assert seen == res.errors
    if name == "sinkhorn_divergence":  # three solves reported in turn: three runs to tol
        assert sum(e <= 1e-3 for _, e in seen) == 3


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_progress_is_checked_alike(name):
    with pytest.raises(TypeError, match="progress must be None, a bool, or a callable"):
        ENTRY_POINTS[name](eps=0.02, progress="yes")
    with pytest.raises(ValueError, match="progress reports .* tol=None"):
        ENTRY_POINTS[name](eps=0.02, progress=True, tol=None)
    # off, explicitly
    ENTRY_POINTS[name](eps=0.02, progress=False)


def test_progress_not_offered_where_it_would_do_nothing():
    # GeomLoss's fixed ladder has no tests; the drop-in keeps GeomLoss's signature
    with pytest.raises(TypeError):
        fs.SamplesLoss(progress=True)


def test_progress_bar_uses_tqdm_when_installed(monkeypatch):
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.post, self.closed = total, 0, [], False
            bars.append(self)

        def set_postfix_str(self, s, refresh=True):
            self.post.append(s)

        def refresh(self):
            pass

        def close(self):
            self.closed = True

    auto = types.ModuleType("tqdm.auto")
    auto.tqdm = Bar
    monkeypatch.setitem(sys.modules, "tqdm.auto", auto)
    res = fs.sinkhorn(X, Y, eps=1e-3, scaling=0.5, n_iters=300, progress=True)
    (bar,) = bars
    assert bar.total == 300 and bar.closed
    assert bar.n == res.n_iters - res.n_annealing
    assert len(bar.post) == len(res.errors) and "error" in bar.post[-1]


def test_progress_without_tqdm_prints_lines(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails
    res = fs.sinkhorn(X, Y, eps=0.02, progress=True)
    err = capsys.readouterr().err
    assert "sinkhorn: iteration" in err
    assert f"marginal error {res.errors[-1][1]:.3g}" in err  # the last test is always shown


def test_progress_bar_on_an_unconverged_solve_still_closes(monkeypatch):
    closed = []

    class Bar:
        def __init__(self, total, **kw):
            self.n = 0

        def set_postfix_str(self, s, refresh=True):
            pass

        def refresh(self):
            pass

        def close(self):
            closed.append(True)

    auto = types.ModuleType("tqdm.auto")
    auto.tqdm = Bar
    monkeypatch.setitem(sys.modules, "tqdm.auto", auto)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fs.ConvergenceWarning)
        for accel in ("anderson", "overrelax"):
            fs.sinkhorn(X, Y, eps=1e-3, n_iters=30, scaling=None, acceleration=accel,
                        progress=True)  # fmt: skip
    assert closed == [True, True]
