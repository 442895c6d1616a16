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

import contextlib
import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

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
    for rt in runtimes():
        staging = rt.caches().get("staging")
        if staging is not None:
            staging.clear()


def seen() -> int:
    """Keys met once and not captured yet, over every device."""
    return sum(c.seen() for c in _caches())


# A new cloud of a known shape. The keys above hold addresses, and a new cloud's prepared
# tensors land at other addresses unless the caller's allocations happen to repeat: every
# graph then misses, and the first two solves of such a cloud run eagerly and capture (about
# 2x the steady state at 10k², d = 64 on an H100/H200). Staging copies the prepared tensors
# into buffers kept per shape, so that every solve of that shape launches on the same
# addresses and replays from its first call; the copy is one pass over the points.

#: Problems whose tensors take more bytes than this are not staged: at that size the kernels,
#: not the host's launches, set the time, and the copy would hold that much memory per shape.
STAGE_MAX_BYTES = 1 << 26
#: Staged problems kept per device (least recently used dropped first).
STAGE_MAX_SHAPES = 4


def _problem_tensors(problem: Problem) -> list[torch.Tensor]:
    """The distinct tensors of the problem's fields (an aliased tensor once)."""
    seen: dict[int, torch.Tensor] = {}
    sides = (problem.X,) if problem.X is problem.Y else (problem.X, problem.Y)
    for side in sides:
        for f in dataclasses.fields(side):
            v = getattr(side, f.name)
            if isinstance(v, torch.Tensor):
                seen.setdefault(id(v), v)
    if problem.centre is not None:
        seen.setdefault(id(problem.centre), problem.centre)
    return list(seen.values())


def _stage_key(problem: Problem, backend, tensors) -> tuple | None:
    """What a staged copy of ``problem`` must share with it: every field but the tensors'
    addresses, and which fields alias one tensor."""
    base = _problem_key(problem, backend)
    if base is None or problem.X.labels is not None or problem.Y.labels is not None:
        return None  # a label table is staged by the backend, keyed by its own address
    if sum(t.numel() * t.element_size() for t in tensors) > STAGE_MAX_BYTES:
        return None
    if any(not t.is_contiguous() for t in tensors):
        return None

    index = {id(t): i for i, t in enumerate(tensors)}

    def field(v):
        if isinstance(v, torch.Tensor):
            return ("t", index[id(v)], tuple(v.shape), v.dtype)
        return v

    def side(s):
        return tuple(field(getattr(s, f.name)) for f in dataclasses.fields(s))

    return (
        type(backend), problem.precision, problem.batched, problem.X is problem.Y,
        side(problem.X), side(problem.Y), field(problem.centre), base[-1],
    )  # fmt: skip


class _Staged:
    """The buffers of one shape and a lock: one solve at a time launches on them."""

    def __init__(self, problem: Problem, tensors: list[torch.Tensor]):
        copies = {id(t): t.clone() for t in tensors}

        def side(s):
            return dataclasses.replace(
                s,
                **{
                    f.name: copies[id(getattr(s, f.name))]
                    for f in dataclasses.fields(s)
                    if isinstance(getattr(s, f.name), torch.Tensor)
                },
            )

        X = side(problem.X)
        Y = X if problem.Y is problem.X else side(problem.Y)
        centre = None if problem.centre is None else copies[id(problem.centre)]
        self.buffers = [copies[id(t)] for t in tensors]
        self.problem = dataclasses.replace(problem, X=X, Y=Y, centre=centre)
        self.lock = threading.Lock()
        self.done: torch.cuda.Event | None = None


class _StagingCache:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries: OrderedDict = OrderedDict()

    def entry(self, key, problem: Problem, tensors) -> tuple[_Staged, bool]:
        """The staged buffers of ``key`` and whether they were made now (from ``problem``)."""
        with self._lock:
            got = self._entries.get(key)
            if got is not None:
                self._entries.move_to_end(key)
                return got, False
            got = self._entries[key] = _Staged(problem, tensors)
            while len(self._entries) > STAGE_MAX_SHAPES:
                self._entries.popitem(last=False)
            return got, True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


@contextlib.contextmanager
def staged(problem: Problem, backend) -> Iterator[Problem]:
    """The problem to launch a solve on: ``problem`` itself, or (CUDA, a graph-safe backend,
    no label term, at most :data:`STAGE_MAX_BYTES`) a copy of its tensors in buffers kept for
    its shape, so that a new cloud of a known shape replays the graphs of earlier solves. The
    copy is valid inside the block only; results must not keep it (the caller's problem is
    what a result holds)."""
    tensors = _problem_tensors(problem) if problem.device.type == "cuda" else []
    key = _stage_key(problem, backend, tensors) if tensors else None
    if key is None:
        yield problem
        return
    cache = runtime(problem.device).cache("staging", _StagingCache)
    entry, made = cache.entry(key, problem, tensors)
    if not entry.lock.acquire(blocking=False):
        yield problem  # another thread is solving this shape: this solve runs unstaged
        return
    try:
        stream = torch.cuda.current_stream(problem.device)
        if not made:
            if entry.done is not None:
                stream.wait_event(entry.done)  # a solve on another stream may still read them
            with torch.no_grad():
                torch._foreach_copy_(entry.buffers, tensors)
        # the statistics prepare read are host floats of this cloud, not of the first one
        yield dataclasses.replace(entry.problem, stats=problem.stats)
        entry.done = torch.cuda.Event()
        entry.done.record(stream)
    finally:
        entry.lock.release()
