"""Visible non-convergence: :class:`ConvergenceWarning` and the losses' reports.

A :class:`~flashsinkhorn.SinkhornResult` says ``converged=False`` itself; the losses return
plain tensors, so they warn instead when a solve with a tolerance stopped at ``n_iters``
without reaching it. The message depends only on the function, the failing terms and the
options, never on the data: Python's default filter then shows it once per call site, and
``warnings.simplefilter("error", ConvergenceWarning)`` turns it into an exception.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch


class ConvergenceWarning(UserWarning):
    """A Sinkhorn solve with a tolerance stopped at ``n_iters`` without reaching ``tol``.

    The loss and its gradients were computed, but from the plan of the last iterate, whose
    marginals miss the targets by more than ``tol``. Raise ``n_iters``, loosen ``tol``, or
    anneal eps (``scaling``); ``tol=None`` runs a fixed number of iterations and never warns.
    Filter it like any warning, e.g. ``warnings.simplefilter("error", ConvergenceWarning)``
    to stop on it, or ``"ignore"`` to silence it.
    """


@dataclass(frozen=True)
class SolveReport:
    """How one solve of a loss ended."""

    #: the term, e.g. "OT(x, y)"
    label: str
    converged: bool
    #: the last tested marginal error was NaN or inf (the iteration diverged)
    diverged: bool


def report(label: str, result) -> SolveReport:
    """The :class:`SolveReport` of a :class:`~flashsinkhorn.SinkhornResult`."""
    last = result.errors[-1][1] if result.errors else 0.0
    return SolveReport(label, bool(result.converged), not math.isfinite(last))


#: The public function a nested call reports for (OTDD builds W with class_distance_matrix).
_WHERE: contextvars.ContextVar[str | None] = contextvars.ContextVar("where", default=None)


@contextlib.contextmanager
def reported_as(name: str) -> Iterator[None]:
    """Inside the block, warnings name ``name`` (the function the user called) as theirs."""
    token = _WHERE.set(name)
    try:
        yield
    finally:
        _WHERE.reset(token)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _caller_level() -> int:
    """``stacklevel`` of the first frame outside flashsinkhorn and torch (nn.Module's call
    wrappers, autograd), counted from the function that calls ``warnings.warn``."""
    frame, level = sys._getframe(2), 2
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not (name.startswith(_PACKAGE) or name.startswith(_TORCH)):
            break
        frame, level = frame.f_back, level + 1
    return level


def warn_unconverged(
    where: str,
    reports: list[SolveReport],
    n_iters: int,
    tol: float | None,
    what: str = "Sinkhorn solve",
) -> None:
    """Warns (:class:`ConvergenceWarning`) when a solve with a tolerance did not converge.

    Args:
        where: the public function, e.g. "sinkhorn_divergence".
        reports: one per solve of the call.
        n_iters: the iteration cap of the solves.
        tol: their tolerance; None (fixed iterations) never warns.
        what: what one report describes ("Sinkhorn solve", "batched Sinkhorn solve").
    """
    if tol is None:
        return
    bad = [r for r in reports if not r.converged]
    if not bad:
        return
    where = _WHERE.get() or where
    if len(reports) == 1:
        head = f"{where}: the {what}"
    else:
        labels = ", ".join(dict.fromkeys(r.label for r in bad))
        head = f"{where}: {len(bad)} of its {len(reports)} {what}s ({labels})"
    state = (
        "diverged (non-finite marginal error)"
        if any(r.diverged for r in bad)
        else f"stopped at n_iters={n_iters} without reaching tol={tol:g}"
    )
    message = (
        f"{head} {state}; the value and its gradients are those of the unconverged plan. "
        "Raise n_iters, loosen tol or anneal eps (scaling); tol=None runs a fixed number of "
        "iterations without this warning (flashsinkhorn.ConvergenceWarning)"
    )
    warnings.warn(message, ConvergenceWarning, stacklevel=_caller_level())
