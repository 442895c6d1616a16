"""Argument checks of a sharded solve, agreed on by every rank before any other collective.

A mistake on one rank must stop every rank: a rank that raised alone would leave the others
waiting in the next collective. So each rank first checks its own arguments completely
(types, shapes, device, and the values of its shards: NaN/inf points, negative or non-finite
weights), then one all-reduce of a flag per rank tells every rank who failed, and the first
failing rank's message is broadcast so that every rank raises the same error, naming the
argument and that rank. Only then do the shapes and options travel (:func:`exchange_meta`)
and the solve's own collectives start.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import _validation as V
from ..options import SinkhornOptions
from ._comm import Comm

MODES = ("gather", "ring")

#: The ``Args`` text of the sharded entry points where it differs from the option table's.
SHARDED_DOCS = {
    "tol": "stop when the global ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ <= tol; None runs exactly "
    "``n_iters`` iterations. Default 1e-3.",
    "check_every": "iterations between two convergence tests, the only host "
    "synchronisations of the loop (one all-reduce each); needs ``tol``. Default 10.",
    "acceleration": "as in :func:`flashsinkhorn.sinkhorn`, resolved as for one process on the "
    "whole problem; Anderson's inner products and the marginal error are reduced over the "
    "ranks in one all-reduce per iteration, the adaptive over-relaxation reads the global "
    'errors of the convergence tests. Default "auto".',
    "diameter": "largest distance between points for annealing; None (default) estimates it "
    "from the global bounding box.",
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Bytes of an error message broadcast from the failing rank (longer ones are cut).
MESSAGE_BYTES = 2048
_TYPES = (ValueError, TypeError)


def check_options(options: dict) -> tuple[SinkhornOptions, str]:
    """Validates the solver options and the mode; raises ValueError/TypeError naming them."""
    mode = V.check_choice("mode", options.pop("mode"), MODES)
    return SinkhornOptions.build(**options), mode


def option_codes(
    opts: SinkhornOptions, mode: str, compute_error: bool, backend: str, precision: str
) -> list[float]:
    """The options as numbers, for the cross-rank comparison (None is -1). ``backend`` and
    ``precision`` are the rank's resolved ones: ranks that resolve "auto" differently (one
    without Triton, mixed hardware) would exchange shards in different formats."""
    out = []
    for v in [*opts.solver_kwargs().values(), mode, compute_error, backend, precision]:
        if isinstance(v, str):
            v = float(sum(ord(c) * 31**i for i, c in enumerate(v)) % 1_000_003)
        out.append(-1.0 if v is None else float(v))
    return out


#: Names of the compared options, in the order of ``option_codes``.
OPTION_NAMES = (
    *SinkhornOptions(eps=1.0).solver_kwargs(),
    "mode",
    "compute_error",
    "the backend (as resolved on each rank)",
    "the precision (as resolved on each rank)",
)


def check_local(x, y, a, b, device: torch.device, check_finite: bool):
    """Checks this rank's shards, their values included; returns the weights as (n,) or None.

    The value checks read a few flags back in one synchronisation, in the order of the
    single-process checks: negative weights, non-finite weights, then NaN/inf points (with
    ``check_finite``).
    """
    V.check_points("x_local", x)
    V.check_points("y_local", y)
    for name, t in (("x_local", x), ("y_local", y)):
        if t.dim() != 2:
            raise ValueError(
                f"{name} must be 2-D (n_local, d): flashsinkhorn.distributed shards the rows "
                f"of one problem and does not take batched (B, n, d) clouds, got shape "
                f"{tuple(t.shape)}"
            )
    V.check_pair(x, y)
    if x.device != device:
        raise ValueError(
            f"x_local and y_local must be on {device}, the device of this process group's "
            f"communication (NCCL: the current CUDA device, set with torch.cuda.set_device; "
            f"gloo: the CPU), got {x.device}"
        )
    a = V.check_weights("a_local", a, x)
    b = V.check_weights("b_local", b, y)
    checks = []
    given = [(nm, w) for nm, w in (("a_local", a), ("b_local", b)) if w is not None]
    for nm, w in given:
        checks.append((f"{nm} must be non-negative", (w < 0).any()))
    for nm, w in given:
        checks.append((f"{nm} must be finite", ~torch.isfinite(w).all()))
    if check_finite:
        for nm, t in (("x_local", x), ("y_local", y)):
            checks.append((f"{nm} must not contain NaN or inf", ~torch.isfinite(t).all()))
    if checks:
        flags = torch.stack([c for _, c in checks]).tolist()
        for (message, _), bad in zip(checks, flags, strict=True):
            if bad:
                raise ValueError(message)
    return a, b


def guarded(comm: Comm, checks: Callable[[], object]):
    """Runs this rank's ``checks`` and agrees on the outcome with every rank.

    Returns:
        What ``checks`` returned, on every rank when no rank failed.

    Raises:
        ValueError, TypeError: on every rank when ``checks`` raised one on some rank: the
            error of the lowest failing rank, its message followed by that rank.
        RuntimeError: the same for any other exception (its type named in the message), so
            that no rank is left waiting in the agreement's all-reduce.
    """
    failure = None
    result = None
    try:
        result = checks()
    except Exception as exc:  # noqa: BLE001 - every failure must reach the other ranks
        failure = exc
    agree(comm, failure)
    return result


def agree(comm: Comm, failure: BaseException | None) -> None:
    """One all-reduce of a failure flag per rank; on failure every rank raises the same error.

    The message of the lowest failing rank then follows in one broadcast (only on that path:
    a solve with valid arguments pays one all-reduce of ``world`` numbers).
    """
    flags = torch.zeros(comm.world, dtype=torch.float32, device=comm.device)
    if failure is not None:
        flags[comm.rank] = float(_kind_code(failure))
    failed = [r for r, v in enumerate(comm.all_reduce(flags).tolist()) if v > 0]
    if not failed:
        return
    first = failed[0]
    text = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=comm.device)
    if comm.rank == first:
        said = str(failure)
        if not isinstance(failure, _TYPES):
            said = f"{type(failure).__name__}: {said}"
        raw = said.encode()[:MESSAGE_BYTES]
        text[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8, device=comm.device)
    if comm.world > 1:
        dist.broadcast(text, src=comm.global_rank(first), group=comm.group)
    message = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    kind = _KINDS[int(flags[first]) - 1]
    others = failed[1:]
    also = f"; rank(s) {others} failed too" if others else ""
    raise kind(
        f"{message} (on rank {first} of the {comm.world} ranks of the process group{also}; "
        "every rank raises this error)"
    ) from (failure if comm.rank == first else None)


_KINDS = (ValueError, TypeError, RuntimeError)


def _kind_code(failure: BaseException) -> int:
    # 1-based index into _KINDS: argument errors keep their class on every rank, anything
    # else arrives as a RuntimeError
    for code, kind in enumerate(_KINDS[:2], 1):
        if isinstance(failure, kind):
            return code
    return 3


def exchange_meta(comm: Comm, x, y, a, b, codes: list[float]):
    """One all_gather of shapes, dtypes, weight flags and options; the same error on every rank
    for a mismatch (every rank sees every row).

    Returns:
        (sizes of the x shards, sizes of the y shards), in rank order.
    """
    meta = [x.shape[1], x.shape[0], y.shape[0], DTYPES.index(x.dtype)]
    meta += [a is not None, b is not None, *codes]
    t = torch.tensor(meta, dtype=torch.float64, device=comm.device)
    rows = torch.stack(comm.all_gather(t)).cpu()

    def column(i):
        return [rows[r, i].item() for r in range(comm.world)]

    if len(set(column(0))) > 1:
        raise ValueError(
            "x_local and y_local must have the same feature dimension d on every rank, got "
            f"d = {[int(v) for v in column(0)]} across ranks"
        )
    if len(set(column(3))) > 1:
        raise TypeError(
            "x_local and y_local must have the same dtype on every rank, got "
            f"{[str(DTYPES[int(v)]) for v in column(3)]} across ranks"
        )
    for i, name in ((4, "a_local"), (5, "b_local")):
        if len(set(column(i))) > 1:
            raise ValueError(f"{name} must be given on every rank or on none (None: uniform)")
    for i, name in enumerate(OPTION_NAMES):
        if len(set(column(6 + i))) > 1:
            raise ValueError(f"{name} must be the same on every rank")
    return [int(v) for v in column(1)], [int(v) for v in column(2)]
