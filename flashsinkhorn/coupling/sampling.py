"""Index pairs drawn from a solved plan, and its row argmax, without storing the plan.

For a result with potentials (f, g) the plan is P_ij = a_i b_j exp((f_i + g_j − C_ij) / eps).
A pair (i, j) ~ P is drawn in two steps (docs/couplings.md):

1. i from the row marginal â = P 1 of the plan actually computed (one transport sweep,
   ``Backend.transport`` without values), by ``torch.multinomial`` with or without
   replacement;
2. j given i from P_ij / â_i ∝ b_j exp((g_j − C_ij) / eps), by the Gumbel-max trick over one
   sweep of the columns (``Backend.plan_argmax`` with seed words): counter-based noise, so
   nothing of size k × m is stored or drawn in advance.

Both steps read their randomness from one ``torch.Generator`` (or an int seed, or torch's
default generator) on the problem's device, with no host synchronisation.
"""

from __future__ import annotations

import torch

from .. import limits
from .._boundary import entry_point
from .._validation import check_bool, check_int
from ..backends.base import Backend
from ..backends.gumbel import seed_words
from ..result import SinkhornResult


def resolve_generator(
    generator: object, seed: object, device: torch.device
) -> torch.Generator | None:
    """The generator that ``generator`` / ``seed`` ask for on ``device`` (None: torch's default).

    Raises:
        TypeError: ``generator`` not a ``torch.Generator``; ``seed`` not an int.
        ValueError: both given; a generator on another device; a negative seed.
    """
    if generator is not None and seed is not None:
        raise ValueError("pass generator or seed, not both")
    if seed is not None:
        seed = check_int("seed", seed, 0)
        return torch.Generator(device=device).manual_seed(seed)
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator)}")
    if torch.device(generator.device).type != device.type:
        raise ValueError(
            f"generator must be on the device of the points ({device}), got a generator on "
            f"{generator.device}"
        )
    return generator


def _solution(result: object, what: str):
    if not isinstance(result, SinkhornResult):
        raise TypeError(f"result must be a SinkhornResult, got {type(result).__name__}")
    sol = result.solution
    if type(sol.backend).plan_argmax is Backend.plan_argmax:
        raise ValueError(
            f"{what} is not available for a result of the {type(sol.backend).__name__} "
            "(a sharded solve); solve on one device to sample from its plan"
        )
    limits.check_plan(sol.problem, sol.eps, what)
    return sol


def draw_rows(
    result: SinkhornResult, k: int, replace: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """(B, k) int64 rows drawn from the induced row marginal â = P 1 of a result."""
    sol = result.solution
    p = sol.problem
    _, marg = sol.backend.transport(p.X, p.Y, sol.f, sol.g, sol.eps, None, None, None,
                                    p.precision)  # fmt: skip
    return torch.multinomial(marg, k, replacement=replace, generator=generator)


def draw_columns(
    result: SinkhornResult, rows: torch.Tensor, generator: torch.Generator | None
) -> torch.Tensor:
    """(B, k) int64 columns j ~ P_i· / â_i for given rows ``rows`` (B, k) int64."""
    sol = result.solution
    p = sol.problem
    seed = seed_words(generator, p.device)
    return sol.backend.plan_argmax(p.X, p.Y, sol.g, sol.eps, p.precision, rows, seed)


@entry_point
def sample_pairs(
    result: SinkhornResult,
    k: int | None = None,
    *,
    replace: bool = True,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws k index pairs (i, j) ~ P from the plan of a solve, streaming it (never stored).

    Rows come from the plan's row marginal â = P 1 (the induced marginal, exact for the plan
    the potentials define even before convergence), then j given i from
    P_ij / â_i ∝ b_j exp((g_j − C_ij) / eps) by a Gumbel-max over one sweep of the columns.
    The noise is a hash of (seed, draw, column), the same on the torch and Triton backends.

    Args:
        result: a :class:`~flashsinkhorn.SinkhornResult` of :func:`~flashsinkhorn.sinkhorn`
            or :func:`~flashsinkhorn.solve` (batched or not).
        k: number of pairs per problem, >= 1; default n (the number of x points).
        replace: draw rows with replacement (default; the pairs are then i.i.d. from P).
            False draws k distinct rows (k <= n), each row's partner j ~ P_i· / â_i: with
            k = n every x point appears once.
        generator: a ``torch.Generator`` on the points' device; default torch's default
            generator of that device (so ``torch.manual_seed`` makes draws reproducible).
        seed: an int seed instead of ``generator``.

    Returns:
        ``(i, j)``: int64 tensors of shape (k,), or (B, k) for a batched result.

    Raises:
        ValueError: k out of range; eps below the plan resolution of the potentials' dtype
            (docs/precision.md); both ``generator`` and ``seed``; a generator on another
            device.
    """
    sol = _solution(result, "sampling from the plan")
    p = sol.problem
    n = p.X.n
    k = n if k is None else check_int("k", k, 1)
    replace = check_bool("replace", replace)
    if not replace and k > n:
        raise ValueError(f"k must be <= n = {n} without replacement, got {k}")
    gen = resolve_generator(generator, seed, p.device)
    with torch.no_grad():
        rows = draw_rows(result, k, replace, gen)
        cols = draw_columns(result, rows, gen)
    return p.unbatch(rows), p.unbatch(cols)


@entry_point
def plan_argmax(result: SinkhornResult) -> torch.Tensor:
    """The most likely partner of each x point: argmax_j P_ij, streamed over the columns.

    Ties go to the smallest j. For a near-exact solve (small eps) this is the plan's
    assignment; for a blurred plan it is the mode of each row.

    Args:
        result: a :class:`~flashsinkhorn.SinkhornResult`.

    Returns:
        (n,) int64, or (B, n) for a batched result.

    Raises:
        ValueError: eps below the plan resolution of the potentials' dtype.
    """
    sol = _solution(result, "the plan's argmax")
    p = sol.problem
    with torch.no_grad():
        out = sol.backend.plan_argmax(p.X, p.Y, sol.g, sol.eps, p.precision)
    return p.unbatch(out)
