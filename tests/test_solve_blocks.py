"""The tolerance loop's graphed blocks, on the CPU with a stand-in for CUDA graphs.

A block covers ``check_every`` iterations that end with a convergence test's step; it is
replayed from a graph captured once and cached across solves of the same key. The stand-in
"graph" re-runs the captured function on replay, so these tests check the loop's bookkeeping
(which iterations a block covers, which plan is returned, the iteration count, the
over-relaxation before a test) against the eager loop exactly; tests/test_gpu_solver.py checks
real captures on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import tuning
from flashsinkhorn.solvers import blocks, graphs, loop


class _ReplayingGraph:
    """Stands in for a CUDA graph: replay re-runs the block's body into its outputs."""

    def __init__(self, body):
        self.block = body.__self__
        self.step = self.block._step

    def replay(self):
        self.block._step = self.step
        try:
            fresh = self.block._body()
        finally:
            self.block._step = None
        for out, new in zip(self.block.outs, fresh, strict=True):
            out.copy_(new)


def _fake_capture(fn, device):
    graph = _ReplayingGraph(fn)
    return graph, tuple(t.clone() for t in fn())


@pytest.fixture
def graphed_cpu(monkeypatch):
    monkeypatch.setattr(blocks, "capture", _fake_capture)
    monkeypatch.setattr(
        blocks.GraphedBlock, "possible", staticmethod(lambda *a: tuning.TUNING.tolerance_graphs)
    )

    def key(problem, backend):
        return ("cpu", problem.B, problem.X.n, problem.Y.n, problem.X is problem.Y)

    monkeypatch.setattr(graphs, "_problem_key", key)
    blocks.clear()
    yield
    blocks.clear()


def _counted_run(run, eager):
    # the steps a replay runs are the graph's, not eager ones
    def counted(self, *args):
        size = len(eager)
        try:
            return run(self, *args)
        finally:
            del eager[size:]

    return counted


def _clouds(n=41, m=33, d=3, B=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    x = torch.rand(*lead, n, d, generator=g, dtype=torch.float64)
    y = torch.rand(*lead, m, d, generator=g, dtype=torch.float64) * 0.7 + 0.25
    return x, y


CASES = [
    dict(schedule="alternating", acceleration="overrelax"),
    dict(schedule="alternating", acceleration="none"),
    dict(schedule="symmetric", acceleration="none"),
    dict(schedule="symmetric", acceleration="overrelax"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['schedule']}-{c['acceleration']}")
@pytest.mark.parametrize("B", [None, 3])
def test_blocks_reproduce_the_eager_loop(graphed_cpu, monkeypatch, case, B):
    x, y = _clouds(B=B)
    kw = dict(eps=0.01, tol=1e-7, n_iters=3000, check_every=7, scaling=None, backend="torch",
              **case)  # fmt: skip
    with tuning.override(tolerance_graphs=False):
        ref = fs.sinkhorn(x, y, **kw)
    assert ref.converged and ref.n_iters > (loop.GRAPH_AFTER_BLOCKS + 2) * 7
    before = blocks.stats()
    # a new key: eager blocks first, then a capture; the same key again: captured at once
    # (the first block, from zero potentials), then replayed.
    runs = [fs.sinkhorn(x, y, **kw) for _ in range(2)]
    # a recurring solve runs no iteration eagerly: each of its tests ends a replayed block,
    # the first block taking iteration 0 with it
    eager = []
    real_step = loop._step
    monkeypatch.setattr(loop, "_step", lambda *a, **k: eager.append(1) or real_step(*a, **k))
    monkeypatch.setattr(blocks.GraphedBlock, "run", _counted_run(blocks.GraphedBlock.run, eager))
    runs.append(fs.sinkhorn(x, y, **kw))
    assert eager == []
    after = blocks.stats()
    assert after["replayed"] - before["replayed"] >= 3 * (ref.n_iters // 7) - 2 * 5
    assert after["captured"] - before["captured"] == 2  # the steady block, the first block
    for got in runs:
        assert got.converged
        assert got.n_iters == ref.n_iters
        assert [k for k, _ in got.errors] == [k for k, _ in ref.errors]
        assert [e for _, e in got.errors] == pytest.approx([e for _, e in ref.errors], rel=1e-9)
        torch.testing.assert_close(got.solution.f, ref.solution.f, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.solution.g, ref.solution.g, rtol=1e-12, atol=1e-12)
        assert float(got.marginal_error.max()) <= 1e-7


def test_block_reaching_the_iteration_cap_is_not_run(graphed_cpu):
    # A block must end within n_iters: the last iterations before the cap run eagerly and
    # the solve stops at exactly n_iters, unconverged.
    x, y = _clouds()
    kw = dict(eps=0.003, tol=1e-12, n_iters=53, check_every=7, scaling=None, backend="torch",
              schedule="alternating", acceleration="none")  # fmt: skip
    with pytest.warns(fs.ConvergenceWarning):  # (the cap is the point: once per call site)
        with tuning.override(tolerance_graphs=False):
            ref = fs.sinkhorn(x, y, **kw)
        fs.sinkhorn(x, y, **kw)
        got = fs.sinkhorn(x, y, **kw)
    assert not got.converged and got.n_iters == ref.n_iters == 53
    torch.testing.assert_close(got.solution.f, ref.solution.f, rtol=1e-12, atol=1e-12)


def test_cached_block_holds_no_problem_tensor(graphed_cpu, monkeypatch):
    # On CUDA a cached block must not keep the problem's memory alive (the next call's
    # problem would then land at other addresses and miss the cache): after its capture a
    # block holds only its own buffers and the graph, not the step that closes over the
    # problem.
    made = []
    real_init = blocks.GraphedBlock.__init__

    def init(self, *args):
        real_init(self, *args)
        made.append(self)

    monkeypatch.setattr(blocks.GraphedBlock, "__init__", init)
    x, y = _clouds()
    kw = dict(eps=0.01, tol=1e-9, n_iters=3000, check_every=7, scaling=None, backend="torch")
    for _ in range(3):
        fs.sinkhorn(x, y, **kw)
    assert len(made) == 2
    assert all(b._step is None and b.graph is not None for b in made)
