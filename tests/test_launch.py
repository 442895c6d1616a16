"""flashsinkhorn/_triton_launch.py: recorded launches and their parallel compilation."""

import threading

import pytest

from flashsinkhorn import _triton_launch as L


class FakeKernel:
    """Stands in for a JITFunction: counts launches and warm-ups (and their threads)."""

    def __init__(self, fail=False):
        self.launched, self.warmed, self.fail = [], [], fail

    def __getitem__(self, grid):
        return lambda *a, **kw: self.launched.append((grid, a, kw))

    def warmup(self, *a, grid, **kw):
        if self.fail:
            raise RuntimeError("compile error")
        self.warmed.append((grid, a, kw, threading.current_thread().name))


def _step(k1, k2, allocs):
    allocs.append(1)
    L.launch(k1, (3, 1), 1, 2, BLOCK=16)
    L.launch(k2, (5,), "x", FLAG=True)


def test_precompile_records_compiles_then_launches_for_real(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(L, "_PRECOMPILED", set())
    k1, k2, allocs = FakeKernel(), FakeKernel(), []
    L.precompile_once("key", _step, k1, k2, allocs)
    # recorded and compiled with the launch's own grid and arguments, off the main thread; not
    # launched
    assert k1.warmed[0][:3] == ((3, 1), (1, 2), {"BLOCK": 16})
    assert k2.warmed[0][:3] == ((5,), ("x",), {"FLAG": True})
    assert all(w[3] != threading.current_thread().name for w in k1.warmed + k2.warmed)
    assert k1.launched == [] and k2.launched == [] and allocs == [1]
    # the same key again: nothing; outside the recording, launches are real
    L.precompile_once("key", _step, k1, k2, allocs)
    assert len(k1.warmed) == 1 and allocs == [1]
    _step(k1, k2, allocs)
    assert k1.launched == [((3, 1), (1, 2), {"BLOCK": 16})] and len(k2.launched) == 1


def test_precompile_error_propagates_and_is_retried(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(L, "_PRECOMPILED", set())
    bad = FakeKernel(fail=True)
    with pytest.raises(RuntimeError, match="compile error"):
        L.precompile_once("k", _step, bad, FakeKernel(), [])
    assert "k" not in L._PRECOMPILED
    # the recording mode does not leak out of the failed call
    k = FakeKernel()
    L.launch(k, (1,), 0)
    assert k.launched == [((1,), (0,), {})]


def test_interpreter_skips_precompilation(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(L, "_PRECOMPILED", set())
    k1, k2, allocs = FakeKernel(), FakeKernel(), []
    L.precompile_once("key", _step, k1, k2, allocs)
    assert allocs == [] and k1.warmed == [] and k1.launched == []
