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
    known = _STAGED_KEYS.get(id(problem))
    if known is not None and known[0] is problem and known[1] is type(backend):
        return known[2]  # a staged problem: its buffers' key, built once per shape
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
#: id(staged problem) -> (that problem, backend class, its launch_key) while its solve runs:
#: the buffers' addresses are fixed, so the key of a staged solve is built once per shape.
_STAGED_KEYS: dict[int, tuple] = {}


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


def _spans(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, int, int]], tuple]:
    """How a staging copy moves ``tensors`` (contiguous): as few flat spans as it can.

    ``prepare`` carves its outputs from one block per dtype, so most of a problem's dozen
    tensors are views of two storages; the tensors of one dtype in one storage move as one
    span when it is at most twice their size (else one by one). Each copy is a launch of its
    own, and the per-tensor copies cost more host time than the rest of the staging.

    Returns:
        spans: (index of a tensor in the span's storage, first element, length) per span.
        place: per tensor, (its span, its offset in the span): with the lengths, the layout a
            staged copy must share.
    """
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.untyped_storage().data_ptr(), t.dtype), []).append(i)
    spans: list[tuple[int, int, int]] = []
    place: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    for idx in groups.values():
        lo = min(tensors[i].storage_offset() for i in idx)
        hi = max(tensors[i].storage_offset() + tensors[i].numel() for i in idx)
        if len(idx) > 1 and hi - lo <= 2 * sum(tensors[i].numel() for i in idx):
            for i in idx:
                place[i] = (len(spans), tensors[i].storage_offset() - lo)
            spans.append((idx[0], lo, hi - lo))
            continue
        for i in idx:
            place[i] = (len(spans), 0)
            spans.append((i, tensors[i].storage_offset(), tensors[i].numel()))
    return spans, tuple(place)


def _span_views(tensors: list[torch.Tensor], spans) -> list[torch.Tensor]:
    """The flat source view of each span (:func:`_spans`)."""
    return [tensors[i].as_strided((n,), (1,), lo) for i, lo, n in spans]


def _stage_key(problem: Problem, backend, tensors, spans, place) -> tuple | None:
    """What a staged copy of ``problem`` must share with it: every field but the tensors'
    addresses, which fields alias one tensor, and how the tensors sit in their spans."""
    if problem.device.type != "cuda" or not backend.capabilities.graph_safe:
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    if problem.X.labels is not None or problem.Y.labels is not None:
        return None  # a label table is staged by the backend, keyed by its own address
    if sum(t.numel() * t.element_size() for t in tensors) > STAGE_MAX_BYTES:
        return None
    if any(not t.is_contiguous() for t in tensors):
        return None
    launched = tuple(tensor_key(t) for t in backend.launch_tensors(problem))

    index = {id(t): i for i, t in enumerate(tensors)}

    def field(v):
        if isinstance(v, torch.Tensor):
            return ("t", index[id(v)], tuple(v.shape), v.dtype)
        return v

    def side(s):
        return tuple(field(getattr(s, f.name)) for f in dataclasses.fields(s))

    return (
        type(backend), problem.precision, problem.batched, problem.X is problem.Y,
        side(problem.X), side(problem.Y), field(problem.centre), launched,
        place, tuple(n for _, _, n in spans),
    )  # fmt: skip


class _Staged:
    """The buffers of one shape and a lock: one solve at a time launches on them."""

    def __init__(self, problem: Problem, tensors: list[torch.Tensor], spans=None):
        if spans is None:
            spans, place = _spans(tensors)
        else:
            spans, place = spans
        self.buffers = [v.clone() for v in _span_views(tensors, spans)]
        copies = {
            id(t): self.buffers[k].as_strided(t.shape, t.stride(), off)
            for t, (k, off) in zip(tensors, place, strict=True)
        }

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
        self.problem = dataclasses.replace(problem, X=X, Y=Y, centre=centre)
        self.keys: dict[type, tuple] = {}  # launch_key of the buffers, per backend class
        self.lock = threading.Lock()
        self.done: torch.cuda.Event | None = None


class _StagingCache:
    def __init__(self):
        self._lock = threading.Lock()
        self._entries: OrderedDict = OrderedDict()

    def entry(self, key, problem: Problem, tensors, spans) -> tuple[_Staged, bool]:
        """The staged buffers of ``key`` and whether they were made now (from ``problem``)."""
        with self._lock:
            got = self._entries.get(key)
            if got is not None:
                self._entries.move_to_end(key)
                return got, False
            got = self._entries[key] = _Staged(problem, tensors, spans)
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
    spans, place = _spans(tensors) if tensors else ([], ())
    key = _stage_key(problem, backend, tensors, spans, place) if tensors else None
    if key is None:
        yield problem
        return
    cache = runtime(problem.device).cache("staging", _StagingCache)
    entry, made = cache.entry(key, problem, tensors, (spans, place))
    if not entry.lock.acquire(blocking=False):
        yield problem  # another thread is solving this shape: this solve runs unstaged
        return
    launched = None
    try:
        stream = torch.cuda.current_stream(problem.device)
        if not made:
            if entry.done is not None:
                stream.wait_event(entry.done)  # a solve on another stream may still read them
            with torch.no_grad():
                torch._foreach_copy_(entry.buffers, _span_views(tensors, spans))
        # the statistics prepare read are host floats of this cloud, not of the first one
        launched = dataclasses.replace(entry.problem, stats=problem.stats)
        kind = type(backend)
        if kind not in entry.keys:
            entry.keys[kind] = launch_key(entry.problem, backend)
        _STAGED_KEYS[id(launched)] = (launched, kind, entry.keys[kind])
        yield launched
        entry.done = torch.cuda.Event()
        entry.done.record(stream)
    finally:
        if launched is not None:
            _STAGED_KEYS.pop(id(launched), None)
        entry.lock.release()
