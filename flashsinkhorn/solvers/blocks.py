"""Blocks of iterations between two convergence tests, replayed from a CUDA graph.

With a tolerance the loop synchronises with the host only at its tests, every ``check_every``
iterations. In between, each iteration is a few kernel launches whose Python and launcher work
(about 0.15 ms per iteration on an H100) can exceed the kernels' own time on mid-sized
problems (a 10k², d = 64 soft-min takes about 0.1 ms). Every block after the first runs the
same launches on the same shapes: the test's step (which also yields the error of its input
plan) and ``check_every − 1`` plain or over-relaxed steps. The block is captured once per
solve and replayed; the potentials and the per-problem over-relaxation factors travel through
static buffers, so a changed ω needs no new capture.
"""

from __future__ import annotations

import torch

from .._cuda_graph import capture
from ..tuning import TUNING

_STATS = {"captured": 0, "failed": 0, "replayed": 0}


def stats() -> dict[str, int]:
    """Blocks captured, captures that failed, and block replays since the process started."""
    return dict(_STATS)


class GraphedBlock:
    """``check_every`` iterations of one solve, starting with a convergence test's step.

    Args:
        step: ``step(f, g, want_raw, last, omega) -> (f, g, err)``, one iteration of the loop
            (``omega``: None, or the (B, 1) per-problem factor buffer); it must not
            synchronise with the host.
        f: (B, n) potential, to size the buffers.
        g: (B, m) potential.
        every: iterations per block.
        omega: (B, 1) initial over-relaxation factors, or None for plain iterations.
    """

    def __init__(self, step, f, g, every: int, omega: torch.Tensor | None):
        self.f_in, self.g_in = f.clone(), g.clone()
        self.omega = None if omega is None else omega.clone()
        self.every = every
        self.step = step
        got = capture(self._body, f.device)
        self.graph = None
        if got is not None:
            self.graph, (self.f_out, self.g_out, self.err) = got
        _STATS["captured" if got is not None else "failed"] += 1

    @staticmethod
    def possible(problem, backend, opts) -> bool:
        """A tolerance test, CUDA tensors, a backend whose launches may be captured."""
        return (
            TUNING.tolerance_graphs
            and opts.tol is not None
            and opts.check_every > 1
            and problem.device.type == "cuda"
            and getattr(type(backend), "graph_safe", False)
            and not torch.cuda.is_current_stream_capturing()
        )

    def _body(self):
        f, g, err = self.f_in, self.g_in, None
        for j in range(self.every):
            f, g, e = self.step(f, g, j == 0, j == self.every - 1, self.omega)
            if j == 0:
                err = e
        return f, g, err

    def run(self, f, g, omega: torch.Tensor | None):
        """(f, g) after the block, and the error of the input plan (f, g)."""
        self.f_in.copy_(f)
        self.g_in.copy_(g)
        if omega is not None:
            self.omega.copy_(omega)
        self.graph.replay()
        _STATS["replayed"] += 1
        return self.f_out.clone(), self.g_out.clone(), self.err.clone()
