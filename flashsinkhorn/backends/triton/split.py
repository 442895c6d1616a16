"""Split/occupancy policy: how many column chunks a sweep's row blocks are split into.

When the row blocks of a sweep cannot fill the GPU, each row block's column sweep is split
into chunks swept by separate programs whose partials are merged afterwards. The rules here
choose the number of chunks for the soft-min (:func:`split_count`, :func:`plan_split`,
:func:`pair_split`), the
transport (:func:`transport_split`, :func:`wave_split`) and the plan step (:func:`split_for`).
``TUNING.softmin_split`` and ``TUNING.transport_split`` force a count (tests); they are read at
call time.
"""

from __future__ import annotations

import torch

from ..._triton_launch import cdiv, cuda_sm_count
from ...tuning import TUNING


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors that the split rules plan for (2 under the interpreter)."""
    if device.type != "cuda":
        return 2  # interpreter: split already at small sizes so that the path is exercised
    return cuda_sm_count(device)


def split_count(n_programs: int, n_cols: int, block_n: int, device: torch.device) -> int:
    """Column chunks per row block so that the grid has about four programs per SM.

    Each chunk keeps at least four column tiles, so the merge stays cheap relative to the sweep.
    """
    forced = TUNING.softmin_split
    if forced is not None:
        return max(1, min(forced, cdiv(n_cols, block_n)))
    target = 4 * sm_count(device)
    if n_programs >= target:
        return 1
    min_tiles = 1 if device.type != "cuda" else 4
    max_split = max(1, cdiv(n_cols, block_n * min_tiles))
    return max(1, min(cdiv(target, n_programs), max_split))


def wave_split(n_programs: int, n_cols: int, block_n: int, per_sm: int, device) -> int:
    """Column chunks per row block that fill whole waves of ``per_sm`` resident blocks per SM.

    A grid of w waves, the last one partly empty, takes ⌈w⌉ times one block's time, and a
    block sweeps 1/split of the columns: the cost of a split s is ⌈n_programs·s / slots⌉ / s.
    The smallest s within 2 % of the best cost wins (fewer chunks: less merging). Each chunk
    keeps at least four column tiles, as in :func:`split_count`.
    """
    forced = TUNING.softmin_split
    if forced is not None:
        return max(1, min(forced, cdiv(n_cols, block_n)))
    slots = per_sm * sm_count(device)
    max_split = max(1, min(64, cdiv(n_cols, block_n * 4)))
    costs = [cdiv(n_programs * s, slots) / s for s in range(1, max_split + 1)]
    best = min(costs)
    return next(s for s, c in enumerate(costs, 1) if c <= 1.02 * best)


def chunk(n_cols: int, split: int, block_n: int) -> int:
    """Columns per chunk, a multiple of the tile width."""
    return cdiv(cdiv(n_cols, split), block_n) * block_n


def plan_split(
    n_programs: int, n_cols: int, block_n: int, device, per_sm: int | None = None
) -> tuple[int, int]:
    """(number of column chunks, columns per chunk) for a single-side sweep: whole waves where
    the kernel's resident blocks per SM are known (``per_sm``) and ``TUNING.wave_split`` is
    set (:func:`wave_split`), else about four programs per SM (:func:`split_count`)."""
    if per_sm is not None and TUNING.wave_split:
        split = wave_split(n_programs, n_cols, block_n, per_sm, device)
    else:
        split = split_count(n_programs, n_cols, block_n, device)
    cps = chunk(n_cols, split, block_n)
    return cdiv(n_cols, cps), cps


def pair_split(
    n_programs: int, n_cols_1: int, n_cols_2: int, block_n: int, device
) -> tuple[int, int, int]:
    """(number of column chunks, columns per chunk of each side) for one grid of two sweeps
    over ``n_cols_1`` and ``n_cols_2`` columns: both halves of a symmetric step, or a pair of
    half-steps. The count is chosen for the narrower side and shared by both."""
    split = split_count(n_programs, min(n_cols_1, n_cols_2), block_n, device)
    cps_1, cps_2 = chunk(n_cols_1, split, block_n), chunk(n_cols_2, split, block_n)
    return max(cdiv(n_cols_1, cps_1), cdiv(n_cols_2, cps_2)), cps_1, cps_2


def transport_split(
    n_programs: int, m: int, block_n: int, device, splittable: bool, per_sm=None
) -> tuple[int, int]:
    """(number of column chunks, columns per chunk) of a transport sweep: whole waves where the
    kernel's resident blocks per SM are known and ``TUNING.wave_split`` is set
    (:func:`wave_split`), else :func:`plan_split`; no split for wide V (not splittable)."""
    m1 = max(m, 1)
    if not splittable:
        return 1, m1
    forced = TUNING.transport_split
    if forced is not None:
        cps = chunk(m1, max(1, min(forced, cdiv(m1, block_n))), block_n)
        return cdiv(m1, cps), cps
    return plan_split(n_programs, m1, block_n, device, per_sm)


def split_for(n_programs: int, n_cols: int, cfg, device) -> int:
    """Column chunks per row-block group of the plan step (plan.py). Where the config knows
    how many of its blocks fit on an SM, as many chunks as fill one wave of the GPU, when that
    is at least two (10k, d = 64: 5 chunks, 395 blocks for 396 slots, instead of 7 chunks in
    1.4 waves); otherwise, and for grids already past a wave, the soft-min's rule (about four
    programs per SM)."""
    if cfg.blocks_per_sm is not None and TUNING.softmin_split is None and device.type == "cuda":
        per_wave = cfg.blocks_per_sm * sm_count(device) // n_programs
        if per_wave >= 2:
            return min(per_wave, cdiv(n_cols, cfg.block_n))
    return split_count(n_programs, n_cols, cfg.block_n, device)
