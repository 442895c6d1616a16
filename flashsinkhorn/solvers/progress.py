"""The error history of a solve and its optional progress report.

The loop records ``(iteration, worst marginal error)`` at every convergence test (the only
points where it reads the error back from the device). With ``progress=True`` each record
also advances a bar on stderr (``tqdm`` when it is installed, plain lines otherwise); with a
callable, each record is passed to it as ``progress(iteration, error)``. A fixed number of
iterations (``tol=None``) has no tests, hence nothing to report: the options refuse
``progress`` there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

#: Minimum seconds between two plain-text lines when tqdm is not installed.
_LINE_EVERY = 1.0


class ErrorHistory(list):
    """``[(iteration, error), …]`` that forwards every record to the progress report."""

    def __init__(self, progress: bool | Callable | None, start: int, total: int, tol: float):
        super().__init__()
        self._report = _reporter(progress, start, total, tol)

    def append(self, item: tuple[int, float]) -> None:
        super().append(item)
        if self._report is not None:
            self._report(*item)

    def close(self) -> list[tuple[int, float]]:
        """Ends the report (closes a bar) and returns the history as a plain list."""
        close = getattr(self._report, "close", None)
        if close is not None:
            close()
        return list(self)


def _reporter(progress, start: int, total: int, tol: float):
    if progress is None or progress is False:
        return None
    if callable(progress):
        return progress
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Lines(total, tol)
    return _Bar(tqdm, start, total, tol)


class _Bar:
    """A tqdm bar over the iterations at the target eps, the error in its postfix."""

    def __init__(self, tqdm, start: int, total: int, tol: float):
        self._start = start
        self._bar = tqdm(total=total, desc="sinkhorn", unit="it", leave=False)
        self._tol = tol

    def __call__(self, iteration: int, error: float) -> None:
        self._bar.n = iteration - self._start
        self._bar.set_postfix_str(f"error {error:.3g} (tol {self._tol:g})", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


class _Lines:
    """Without tqdm: a line on stderr per test, at most one a second."""

    def __init__(self, total: int, tol: float):
        import time

        self._clock = time.monotonic
        self._last = -float("inf")
        self._total, self._tol = total, tol

    def __call__(self, iteration: int, error: float) -> None:
        now = self._clock()
        if now - self._last >= _LINE_EVERY or error <= self._tol:
            self._last = now
            print(
                f"sinkhorn: iteration {iteration}, marginal error {error:.3g} (tol {self._tol:g})",
                file=sys.stderr,
            )
