"""Blocks of iterations that end with a convergence test, replayed from a CUDA graph.

With a tolerance the loop synchronises with the host only at its tests, every ``check_every``
iterations. In between, each iteration is a few kernel launches whose Python and launcher work
(about 0.15 ms per iteration on an H100) can exceed the kernels' own time on mid-sized
problems (a 10k², d = 64 soft-min takes about 0.1 ms). Every block runs the same launches on
the same shapes: ``check_every − 1`` plain or over-relaxed steps, then the test's step (which
also yields the error of its input plan). The potentials and the per-problem over-relaxation
factors travel through static buffers, so a changed ω needs no new capture. A block that ends
at the test wastes no iteration: when the test passes, its input is the returned plan.

Blocks are cached across calls, keyed like the fixed-iteration graphs (``graphs.py``): the
addresses, shapes and strides of every tensor of the problem and every option the launches
depend on. A training loop that solves the same shapes to a tolerance again and again then
replays every block, the first one (iteration 0, from zero potentials, and the next
``check_every`` iterations) included, instead of paying a capture in every solve.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .._cuda_graph import capture, runtime, runtimes
from ..tuning import TUNING

_STATS = {"captured": 0, "failed": 0, "replayed": 0}


def stats() -> dict[str, int]:
    """Blocks captured, captures that failed, and block replays since the process started."""
    return dict(_STATS)


class GraphedBlock:
    """Iterations of one solve, the last of which is a convergence test's step.

    Args:
        step: ``step(f, g, phase, test, before_test, omega) -> (f, g, err)``, one iteration of
            the loop (``test``: measure the error of the input plan; ``before_test``: the step
            before the test's; ``omega``: None, or the (B, 1) per-problem factor buffer); it
            must not synchronise with the host.
        f: (B, n) potential, to size the buffers.
        g: (B, m) potential.
        phases: the phase of each step (``Backend.symmetric_step``'s ``phase``), at least 2
            steps: the first block of a solve starts from zero potentials, the others are all
            "iterate".
        omega: (B, 1) initial over-relaxation factors, or None for plain iterations.
    """

    def __init__(self, step, f, g, phases: tuple[str, ...], omega: torch.Tensor | None):
        self.f_in, self.g_in = f.clone(), g.clone()
        self.omega = None if omega is None else omega.clone()
        self.every = len(phases)
        self.phases = phases
        self._lock = threading.Lock()
        self._step = step
        got = capture(self._body, f.device)
        # The step closes over the problem's tensors: holding it would keep their memory
        # from the allocator, so that the next call's problem lands elsewhere and misses.
        self._step = None
        self.graph = None
        if got is not None:
            self.graph, self.outs = got
        _STATS["captured" if got is not None else "failed"] += 1

    @staticmethod
    def possible(problem, backend, opts) -> bool:
        """A tolerance test, CUDA tensors, a backend whose launches may be captured."""
        return (
            TUNING.tolerance_graphs
            and opts.tol is not None
            and opts.check_every > 1
            and problem.device.type == "cuda"
            and backend.capabilities.graph_safe
            and not torch.cuda.is_current_stream_capturing()
        )

    def _body(self):
        f, g = self.f_in, self.g_in
        last = self.every - 1
        for j, phase in enumerate(self.phases):
            if j == last:
                f_tested, g_tested = f, g
            f, g, err = self._step(f, g, phase, j == last, j == last - 1, self.omega)
        return f_tested, g_tested, f, g, err

    def run(self, f, g, omega: torch.Tensor | None):
        """``(f_t, g_t, f_next, g_next, err)``: the plan the block's test measured, the
        potentials after the block, and the error of (f_t, g_t)."""
        with self._lock:  # another thread replaying the same block shares its buffers
            self.f_in.copy_(f)
            self.g_in.copy_(g)
            if omega is not None:
                self.omega.copy_(omega)
            self.graph.replay()
            _STATS["replayed"] += 1
            return tuple(t.clone() for t in self.outs)


class BlockCache:
    """Captured blocks by key; a key met a second time is captured at once (its solves
    recur), a new one only after a few eager blocks (a solve that ends early would not repay
    the capture)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._blocks: OrderedDict = OrderedDict()  # key -> GraphedBlock, or None: failed
        self._seen: OrderedDict = OrderedDict()

    def get(self, key) -> GraphedBlock | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def known(self, key) -> bool:
        """Whether ``key`` was met before (captured, failed, or seen once)."""
        with self._lock:
            return key in self._blocks or key in self._seen

    def failed(self, key) -> bool:
        with self._lock:
            return key in self._blocks and self._blocks[key] is None

    def see(self, key) -> None:
        with self._lock:
            self._seen[key] = True
            self._seen.move_to_end(key)
            while len(self._seen) > 4 * TUNING.max_solve_graphs:
                self._seen.popitem(last=False)

    def put(self, key, block: GraphedBlock) -> None:
        with self._lock:
            self._seen.pop(key, None)
            self._blocks[key] = block if block.graph is not None else None
            while len(self._blocks) > TUNING.max_solve_graphs:
                self._blocks.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._seen.clear()


def cache(device) -> BlockCache:
    """The block cache of ``device`` (in its runtime, ``_cuda_graph.py``)."""
    return runtime(device).cache("blocks", BlockCache)


def clear() -> None:
    """Drops every cached block of every device."""
    for rt in runtimes():
        c = rt.caches().get("blocks")
        if c is not None:
            c.clear()
