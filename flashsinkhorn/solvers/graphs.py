"""CUDA graphs of fixed-iteration solves, cached across calls.

A training loop calls the loss with the same shapes and options again and again. PyTorch's
caching allocator then hands the same blocks to the tensors that ``prepare`` builds, so a solve
with a fixed number of iterations (``tol=None``) on a stateless backend repeats the same
launches on the same addresses. The second time such a solve is seen, its launches are captured
into a CUDA graph (with the dual value computed from the potentials). From the third time on,
the graph replays them in one launch, without the Python and launcher work of the ~20–30
kernels (docs/performance.md, entry 15).

The key holds everything the launches depend on. For every tensor of the problem it holds the
address, shape, strides and dtype; it also holds every other field of the problem, the eps
ladder, the number of iterations, the schedule and the backend class. A hit therefore replays
exactly the launches the eager loop would make, on the data now at those addresses. The
potentials and the value are written to the graph's own buffers and cloned for the caller.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from .._cuda_graph import capture
from ..problem import Problem

#: Capture fixed-iteration solves on CUDA and replay them (False: always launch from Python).
USE_SOLVE_GRAPHS = True
#: Graphs kept (least recently used evicted); each holds its potentials and scratch buffers.
MAX_GRAPHS = 16

_LOCK = threading.Lock()
_GRAPHS: OrderedDict = OrderedDict()  # key -> _Graphed, or None when the capture failed
_SEEN: OrderedDict = OrderedDict()  # keys met once, not captured yet
_MISSING = object()
_STATS = {"captured": 0, "failed": 0, "replayed": 0}


class _Graphed:
    def __init__(self, graph: torch.cuda.CUDAGraph, outs: tuple[torch.Tensor, ...]):
        self.graph, self.outs = graph, outs


def _field_key(v):
    if isinstance(v, torch.Tensor):
        return (v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, v.device)
    return v


def _side_key(side) -> tuple:
    return tuple(_field_key(getattr(side, f.name)) for f in dataclasses.fields(side))


def solve_key(problem: Problem, backend, eps_list, n_iters: int, schedule: str) -> tuple | None:
    """The cache key of a fixed-iteration solve, or None when it is not graphed (not CUDA, a
    backend that holds state of its own, graphs off, or a capture of the caller's under way)."""
    if not (
        USE_SOLVE_GRAPHS
        and problem.device.type == "cuda"
        and getattr(type(backend), "graph_safe", False)
    ):
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    return (
        type(backend),
        problem.precision,
        problem.batched,
        _side_key(problem.X),
        _side_key(problem.Y),
        tuple(float(e) for e in eps_list),
        int(n_iters),
        schedule,
    )


def run(key: tuple, solve: Callable[[], tuple[torch.Tensor, ...]], device) -> tuple:
    """The tensors ``solve()`` returns: run eagerly the first time ``key`` is met, captured the
    second time, replayed from then on (the outputs are then clones of the graph's buffers).
    ``solve`` must launch work without host synchronisation."""
    with _LOCK:
        entry = _GRAPHS.get(key, _MISSING)
        if entry is _MISSING:
            if key not in _SEEN:
                _SEEN[key] = True
                while len(_SEEN) > 4 * MAX_GRAPHS:
                    _SEEN.popitem(last=False)
                entry = None
            else:
                del _SEEN[key]
                entry = _GRAPHS[key] = _capture(solve, device)
                _STATS["captured" if entry is not None else "failed"] += 1
                while len(_GRAPHS) > MAX_GRAPHS:
                    _GRAPHS.popitem(last=False)
        else:
            _GRAPHS.move_to_end(key)
        if entry is not None:
            # under the lock: another thread replaying the same graph would share its outputs
            entry.graph.replay()
            _STATS["replayed"] += 1
            return tuple(t.clone() for t in entry.outs)
    return solve()


def _capture(solve, device) -> _Graphed | None:
    """The captured solve, or None when it cannot be captured (then it stays eager)."""
    got = capture(lambda: tuple(solve()), device)
    return None if got is None else _Graphed(*got)


def stats() -> dict[str, int]:
    """Counts of graphs captured, captures that failed, and replays, since the last clear()."""
    with _LOCK:
        return dict(_STATS)


def clear() -> None:
    """Drops every cached graph (and the memory they hold)."""
    with _LOCK:
        _GRAPHS.clear()
        _SEEN.clear()
        for k in _STATS:
            _STATS[k] = 0
