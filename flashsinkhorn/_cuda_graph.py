"""Capture of a function's launches into a CUDA graph (shared by the graphed CG blocks and the
cached fixed-iteration solves)."""

from __future__ import annotations

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
