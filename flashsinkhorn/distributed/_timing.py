"""CUDA-event timing of a sharded solve's sections: collectives against the kernels.

Off unless a caller records (``with recording() as rec``, as bench/bench_distributed.py
does): then every collective and every wait for a ring transfer (``Comm``) is a "comm"
section and every plan sweep and finishing launch (``_block``) a "kernels" section, each
between two CUDA events on the current stream. A "comm" section is the time the compute
stream waited for the communication (the collective itself, or another rank still
computing); transfers that overlap the kernels cost nothing there. CPU tensors are not
timed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch


class Recorder:
    """The sections recorded while it is active."""

    def __init__(self):
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def totals(self) -> dict[str, float]:
        """Milliseconds per kind of section, summed (synchronises the device)."""
        out: dict[str, float] = defaultdict(float)
        if self.events:
            torch.cuda.synchronize()
        for kind, start, end in self.events:
            out[kind] += start.elapsed_time(end)
        return dict(out)


_ACTIVE: ContextVar[Recorder | None] = ContextVar("flashsinkhorn_sharded_timing", default=None)


@contextmanager
def recording() -> Iterator[Recorder]:
    """Records the sections of the sharded solves run inside the block."""
    rec = Recorder()
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


@contextmanager
def section(kind: str, device: torch.device) -> Iterator[None]:
    """Times the enclosed launches as ``kind`` when a recorder is active and ``device`` is a
    CUDA device (sections must not nest)."""
    rec = _ACTIVE.get()
    if rec is None or device.type != "cuda":
        yield
        return
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    try:
        yield
    finally:
        end.record()
        rec.events.append((kind, start, end))
