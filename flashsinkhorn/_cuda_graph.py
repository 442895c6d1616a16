"""Capture of a function's launches into a CUDA graph (shared by the graphed CG blocks, the
cached fixed-iteration solves and the cached launches of ``prepare``), the cache that replays
them, and the one runtime per device that holds every such cache.

Every cache of captured launches lives in the :class:`DeviceRuntime` of its device, under a
name ("solve", "blocks", "prepare"): a device's graphs (and the memory they hold) are found,
counted and freed together, and keys of one device never meet another's."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], device: torch.device) -> tuple[torch.cuda.CUDAGraph, T] | None:
    """``(graph, fn())`` with fn's launches recorded in ``graph`` (not run: replay it), or None
    when they cannot be captured: a host synchronisation or another stream inside ``fn``, or a
    capture of the caller's already under way."""
    if torch.cuda.is_current_stream_capturing():
        return None
    try:
        with torch.cuda.device(device):
            graph = torch.cuda.CUDAGraph()
            # capture_begin/end on a side stream rather than the torch.cuda.graph context,
            # which also runs gc.collect() and empties the caching allocator on every capture.
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                graph.capture_begin()
                try:
                    out = fn()
                finally:
                    graph.capture_end()
            main.wait_stream(side)
    except RuntimeError:
        return None
    return graph, out


class _Graphed:
    def __init__(self, graph: torch.cuda.CUDAGraph, outs: tuple):
        self.graph, self.outs = graph, outs


_MISSING = object()


class GraphCache:
    """Launch sequences replayed from CUDA graphs, keyed by everything they depend on.

    ``run(key, fn, device)`` runs ``fn`` eagerly the first ``eager_runs`` times ``key`` is met
    (default 1), captures it the next time (then replays the capture), and replays it from
    then on. ``fn`` must launch
    work without host synchronisation and return a tuple; its tensors are the graph's own
    buffers on a replay, cloned for the caller when ``clone`` is set. The ``max_graphs`` most
    recently used graphs are kept.
    """

    def __init__(self, max_graphs: int, eager_runs: int = 1):
        self.max_graphs = max_graphs
        self.eager_runs = eager_runs
        self._lock = threading.Lock()
        self._graphs: OrderedDict = OrderedDict()  # key -> _Graphed, or None: capture failed
        self._seen: OrderedDict = OrderedDict()  # key -> times met, not captured yet
        self._stats = {"captured": 0, "failed": 0, "replayed": 0}

    def run(self, key, fn: Callable[[], tuple], device, clone: bool = True) -> tuple:
        with self._lock:
            entry = self._graphs.get(key, _MISSING)
            if entry is _MISSING:
                met = self._seen.get(key, 0)
                if met < self.eager_runs:
                    self._seen[key] = met + 1
                    self._seen.move_to_end(key)
                    while len(self._seen) > 4 * self.max_graphs:
                        self._seen.popitem(last=False)
                    entry = None
                else:
                    del self._seen[key]
                    got = capture(lambda: tuple(fn()), device)
                    entry = self._graphs[key] = None if got is None else _Graphed(*got)
                    self._stats["captured" if entry is not None else "failed"] += 1
                    while len(self._graphs) > self.max_graphs:
                        self._graphs.popitem(last=False)
            else:
                self._graphs.move_to_end(key)
            if entry is not None:
                # under the lock: another thread replaying the same graph shares its buffers
                entry.graph.replay()
                self._stats["replayed"] += 1
                if not clone:
                    return entry.outs
                return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in entry.outs)
        return fn()

    def stats(self) -> dict[str, int]:
        """Counts of graphs captured, captures that failed, and replays, since clear()."""
        with self._lock:
            return dict(self._stats)

    def clear(self) -> None:
        """Drops every cached graph (and the memory they hold)."""
        with self._lock:
            self._graphs.clear()
            self._seen.clear()
            for k in self._stats:
                self._stats[k] = 0

    def seen(self) -> int:
        """Keys met and not captured yet."""
        with self._lock:
            return len(self._seen)


class DeviceRuntime:
    """The caches of captured launches of one device, created on first use by name."""

    def __init__(self, device: torch.device):
        self.device = device
        self._lock = threading.Lock()
        self._caches: dict[str, object] = {}

    def cache(self, name: str, make: Callable[[], T]) -> T:
        """The cache ``name`` of this device (``make()`` builds it the first time)."""
        with self._lock:
            got = self._caches.get(name)
            if got is None:
                got = self._caches[name] = make()
            return got

    def caches(self) -> dict[str, object]:
        """The caches created so far, by name."""
        with self._lock:
            return dict(self._caches)

    def clear(self) -> None:
        """Drops every captured graph of this device (each cache's ``clear()``)."""
        for c in self.caches().values():
            c.clear()


_RUNTIMES: dict[torch.device, DeviceRuntime] = {}
_RUNTIMES_LOCK = threading.Lock()


def runtime(device) -> DeviceRuntime:
    """The :class:`DeviceRuntime` of ``device`` (a CUDA device without an index is the current
    one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _RUNTIMES_LOCK:
        got = _RUNTIMES.get(device)
        if got is None:
            got = _RUNTIMES[device] = DeviceRuntime(device)
        return got


def runtimes() -> list[DeviceRuntime]:
    """The runtimes of every device that has used one."""
    with _RUNTIMES_LOCK:
        return list(_RUNTIMES.values())


def tensor_key(t) -> tuple | None:
    """What a launch depends on of a tensor argument: address, shape, strides, dtype, device."""
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
