"""CUDA graphs of fixed-iteration solves, cached across calls.

A training loop calls the loss with the same shapes and options again and again. PyTorch's
caching allocator then hands the same blocks to the tensors that ``prepare`` builds, so a solve
with a fixed number of iterations (``tol=None``) on a stateless backend repeats the same
launches on the same addresses. The second time such a solve is seen, its launches are captured
into a CUDA graph (with the dual value computed from the potentials). From the third time on,
the graph replays them in one launch, without the Python and launcher work of the ~20–30
kernels (the host work of a 10-iteration solve is then one graph launch).

The key holds everything the launches depend on (:func:`launch_key`). For every tensor of the
problem it holds the address, shape, strides and dtype; it also holds every other field of the
problem, every tensor outside the problem that the backend's launches read
(``Backend.launch_tensors``: the staged label tables of the Triton kernels), the eps ladder,
the number of iterations, the schedule and the backend class. A hit therefore replays
exactly the launches the eager loop would make, on the data now at those addresses. The
potentials and the value are written to the graph's own buffers and cloned for the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .._cuda_graph import GraphCache, runtime, runtimes, tensor_key
from ..problem import Problem
from ..tuning import TUNING


def _cache(device) -> GraphCache:
    """The fixed-iteration solve graphs of ``device`` (in its runtime, ``_cuda_graph.py``)."""
    return runtime(device).cache("solve", lambda: GraphCache(TUNING.max_solve_graphs))


def _caches() -> list[GraphCache]:
    return [c for rt in runtimes() for n, c in rt.caches().items() if n == "solve"]


def _field_key(v):
    return tensor_key(v) if isinstance(v, torch.Tensor) else v


def _side_key(side) -> tuple:
    return tuple(_field_key(getattr(side, f.name)) for f in dataclasses.fields(side))


def launch_key(problem: Problem, backend) -> tuple:
    """What every launch of a solve on ``backend`` depends on: the backend class, every field
    of the problem (each tensor by address, shape, strides, dtype and device), and every other
    tensor the backend's launches read (``Backend.launch_tensors``: a staged label table)."""
    return (
        type(backend),
        problem.precision,
        problem.batched,
        problem.X is problem.Y,
        _side_key(problem.X),
        _side_key(problem.Y),
        tuple(tensor_key(t) for t in backend.launch_tensors(problem)),
    )


def _problem_key(problem: Problem, backend) -> tuple | None:
    """:func:`launch_key`, or None when the launches are not graphed (not CUDA, a backend
    whose launches read state of its own, or a capture of the caller's under way)."""
    if problem.device.type != "cuda" or not backend.capabilities.graph_safe:
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    return launch_key(problem, backend)


def solve_key(problem: Problem, backend, eps_list, n_iters: int, schedule: str) -> tuple | None:
    """The cache key of a fixed-iteration solve, or None when it is not graphed (see
    ``_problem_key``, or graphs off)."""
    base = _problem_key(problem, backend) if TUNING.solve_graphs else None
    if base is None:
        return None
    return (*base, tuple(float(e) for e in eps_list), int(n_iters), schedule)


def block_key(problem: Problem, backend, eps: float, opts, relaxed: bool, phases: tuple):
    """The cache key of a tolerance solve's block of iterations (``blocks.py``), or None;
    ``phases``: the phase of each of the block's steps."""
    base = _problem_key(problem, backend)
    if base is None:
        return None
    return (*base, float(eps), opts.schedule, opts.check_every, relaxed, phases)


def run(key: tuple, solve: Callable[[], tuple[torch.Tensor, ...]], device) -> tuple:
    """The tensors ``solve()`` returns: run eagerly the first time ``key`` is met, captured the
    second time, replayed from then on (the outputs are then clones of the graph's buffers).
    ``solve`` must launch work without host synchronisation."""
    cache = _cache(device)
    cache.max_graphs = TUNING.max_solve_graphs
    return cache.run(key, solve, device)


def stats() -> dict[str, int]:
    """Counts of graphs captured, captures that failed, and replays, since the last clear()."""
    out = {"captured": 0, "failed": 0, "replayed": 0}
    for c in _caches():
        for k, v in c.stats().items():
            out[k] += v
    return out


def clear() -> None:
    """Drops every cached graph (and the memory they hold)."""
    for c in _caches():
        c.clear()


def seen() -> int:
    """Keys met once and not captured yet, over every device."""
    return sum(c.seen() for c in _caches())
