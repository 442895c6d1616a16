"""Launch configurations chosen by rule, not by autotuning.

A configuration depends only on the feature size d, the dtype and whether the interpreter
runs the kernel, so a new n or m triggers no search and at most one more compilation (the
kernels specialise on whether the column count is a multiple of 16, for vector loads of the
column vectors: operands.aligned_cols). The rules were set from H100 measurements (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

from ..._triton_launch import cdiv, next_pow2


@dataclass(frozen=True)
class LSEConfig:
    block_m: int
    block_n: int
    block_d: int
    d_tiles: int
    num_warps: int
    num_stages: int
    #: register cap per thread passed to ptxas (None: its own choice)
    maxnreg: int | None = None
    #: blocks of this config resident per SM, where measured (Nsight Compute): the plan step
    #: then splits the columns so that its grid fills one wave (plan.split_for)
    blocks_per_sm: int | None = None

    def launch_options(self) -> dict:
        """num_warps, num_stages and, when set, maxnreg, as launch keywords."""
        kw = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.maxnreg is not None:
            kw["maxnreg"] = self.maxnreg
        return kw


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def lse_config(d: int, half_operands: bool = False) -> LSEConfig:
    """Tile shape for the streaming soft-min kernels at feature size ``d``.

    ``half_operands``: the score dot reads one 16-bit operand per point (the float16 grid copies
    of precision "tf32", or half-precision points). The choice depends on d and the operand
    kind only, so a new n or m never compiles a new kernel.
    """
    return _lse_config(d, bool(half_operands), interpreting())


@functools.lru_cache(maxsize=256)
def _lse_config(d: int, half_operands: bool, interp: bool) -> LSEConfig:
    # cached: every launch asks, with a handful of distinct (d, operand kind) per process
    if interp:
        # Small tiles so that small odd-sized tests still cross several tiles and d-chunks.
        block_d = min(max(16, next_pow2(d)), 64)
        return LSEConfig(32, 32, block_d, cdiv(d, block_d), 4, 1)
    if d <= 32 and half_operands:
        # 64 x 128 tiles, 4 warps: at the batched training shape (64 problems of 1024², d = 3
        # and d = 16) 0.80 ms for 10 symmetric steps against 1.40 ms for 128 x 64 / 8 warps,
        # best of twelve shapes (bench/results/dev/sym_sweep_small_d_h200.json).
        return LSEConfig(64, 128, max(16, next_pow2(d)), 1, 4, 3)
    if 32 < d <= 128 and half_operands:
        # 256 x 64 tiles, 8 warps (32 rows per warp), the 16-bit row tile (<= 64 KB) on chip:
        # fastest of ten shapes on the H200 at 50k/64 (40.1 ms against 56.4 ms for 128 x 64),
        # 40k/128 (43.4 against 52.1) and within 5% of the best at 10k/64
        # (bench/results/dev/sym_sweep_h200.json, docs/performance.md). Not used at small d,
        # where it was not measured and the batched d = 3 case got slower.
        return LSEConfig(256, 64, next_pow2(d), 1, 8, 3)
    if d <= 128:
        # The whole row tile stays on chip for the full column sweep. With float16 operands
        # 128 x 64 tiles, 8 warps, 3 stages were the fastest of five shapes on the H100 at
        # 40k, d = 128 and within noise of the best at 10k, d = 64
        # (bench/results/dev/2026-11-22_config_experiment_h100.json).
        block_d = max(16, next_pow2(d))
        return LSEConfig(128, 64, block_d, 1, 8, 3)
    # Large d: chunks of 64 features; wider column tiles amortise the row-tile reloads
    # (H100, 10k x 10k, d = 512: 39 ms against 52 ms with 64-wide tiles).
    block_d = 64
    return LSEConfig(128, 128, block_d, cdiv(d, block_d), 8, 3)


def half_config(d: int, half_operands: bool = False) -> LSEConfig:
    """Tile shape of the plan half-step (plan.py ``half_step``): the soft-min's, whose sweep
    it repeats without the running max."""
    return _lse_config(d, bool(half_operands), interpreting())


#: Tile shape of the Hopper plan half-step (half_hopper.py) at d <= 128: (rows, columns, warps,
#: stages). Rows per warpgroup are a multiple of 64 (the warpgroup product's M).
HOPPER_HALF_TILES = (128, 64, 4, 3)


def hopper_half_config(d: int) -> LSEConfig:
    """Tile shape of the Gluon half-step sweep (half_hopper.py) at feature size d (16-bit
    operands, d <= 128): the whole row tile and ``stages`` column tiles in shared memory."""
    bm, bn, warps, stages = HOPPER_HALF_TILES
    return LSEConfig(bm, bn, max(16, next_pow2(d)), 1, warps, stages)


def sample_config(d: int, half_operands: bool = False) -> LSEConfig:
    """Tile shape of the plan argmax / sampling sweep (sample.py) at feature size d.

    The soft-min's shapes (:func:`lse_config`) with row blocks of at most 128 draws: the sweep
    is the soft-min's (one score dot per tile) plus a counter hash and two log2 per score
    instead of one exp2, and its running state is a (max, index) pair per row.
    """
    cfg = lse_config(d, half_operands)
    if cfg.block_m > 128:
        return dataclasses.replace(cfg, block_m=128)
    return cfg


def plan_config(d: int, half_operands: bool = False) -> LSEConfig:
    """Tile shape of the plan step (plan.py), one sweep for both half-steps at feature size d.

    Depends on d and the operand kind only, like :func:`lse_config`.
    """
    return _plan_config(d, bool(half_operands), interpreting())


@functools.lru_cache(maxsize=256)
def _plan_config(d: int, half_operands: bool, interp: bool) -> LSEConfig:
    base = _lse_config(d, half_operands, interp)
    if interp or not half_operands or not 32 < d <= 128:
        return base
    # Fastest or within 3 % of it in a sweep of four shapes on the H200 (docs/performance.md):
    # d <= 64: 128 x 128 / 4 warps (50k: 20.7 ms per 10 steps, against 22.2 for 128 x 64);
    # d <= 128: 256 x 128 / 8 warps (10k: 2.35 ms against 4.0 for 128 x 64; 40k: 22.7 / 22.2).
    # Nsight Compute on the H200: the d <= 64 kernel takes 168 registers, so 3 blocks fit per
    # SM, and its 10k grid was 1.4 waves (one wave: 1.11 -> 0.97 ms per 10 steps); the
    # d <= 128 kernel takes 221 registers, one block per SM, and capped at 128 it runs
    # 1.57 -> 1.41 ms at 10k and 22.5 -> 19.2 ms at 40k (a cap of 128 at d <= 64 lost 30 %).
    if d <= 64:
        return LSEConfig(128, 128, base.block_d, 1, 4, 3, blocks_per_sm=3)
    return LSEConfig(256, 128, base.block_d, 1, 8, 3, maxnreg=128)


def self_plan_config(d: int, half_operands: bool = False) -> LSEConfig:
    """Tile shape of the triangular self step (plan_self.py): the plan step's tiles, with row
    blocks a whole number of column tiles tall.

    Blocks per SM, from ptxas for sm_90: at d <= 64 the sweep holds 210 registers per thread
    (the plan step's: 168), 2 blocks of 128 threads; at 64 < d <= 128 the 128 x 128 tiles of
    4 warps leave 1. The split then fills whole waves (plan_self.layout).
    """
    cfg = plan_config(d, half_operands)
    if cfg.block_m % cfg.block_n:
        # The diagonal block of a row block is whole column tiles (d <= 32 with 16-bit
        # operands: 64 x 128; not measured, the backend keeps the online-LSE sweep there).
        cfg = dataclasses.replace(cfg, block_n=cfg.block_m)
    if half_operands and 64 < d <= 128 and not interpreting():
        # 128 x 128 tiles, 4 warps, no register cap (one block per SM): divergence fwd+bwd,
        # 10 iterations, H100: 10k 5.48 ms and 40k 57.3 ms against 6.27 and 67.8 with the
        # plan step's 256 x 128 / 8 warps / cap 128, best of six shapes at 10k and second of
        # six at 40k (256 x 64 / 8 warps / cap 128: 54.8 there, but 6.62 at 10k).
        return dataclasses.replace(cfg, block_m=128, block_n=128, num_warps=4, maxnreg=None,
                                   blocks_per_sm=1)  # fmt: skip
    if half_operands and 32 < d <= 64 and not interpreting():  # the plan step's own tiles
        # (best of six shapes at 10k, d = 64; register caps of 168 and 128 were slower)
        return dataclasses.replace(cfg, blocks_per_sm=2)
    return cfg


@dataclass(frozen=True)
class TransportConfig:
    block_m: int
    block_n: int
    block_d: int
    d_tiles: int
    block_p: int
    p_tiles: int
    block_r: int
    r_tiles: int
    num_warps: int
    num_stages: int


def _tiles(k: int, cap: int) -> tuple[int, int]:
    block = min(max(16, next_pow2(max(k, 1))), cap)
    return block, cdiv(max(k, 1), block)


def transport_config(d: int, p: int, r: int, precision: str = "tf32") -> TransportConfig:
    """Tile shape of the transport kernels for feature size d, value width p, Hadamard
    rank r (0: none) and the dots' ``precision`` ("ieee", "tf32" or "tf32x3").

    Rule-based like :func:`lse_config`: no autotuning, no recompilation for a new n or m. The
    interpreter gets small tiles so that odd-sized tests cross every edge.
    """
    if interpreting():
        bd, dt = _tiles(d, 64)
        bp, pt = _tiles(p, 32)
        br, rt = _tiles(r, 32)
        return TransportConfig(32, 32, bd, dt, bp, pt, br, rt, 4, 1)
    bd, dt = _tiles(d, 128 if d <= 128 else 64)
    # Register accumulator up to 128 value columns; wider V streams through the output.
    bp, pt = _tiles(p, 128 if p <= 128 else 64)
    br, rt = _tiles(r, 64)
    if p == 1 and r == 0 and d <= 128:
        # One value column (the HVP's P v, Pᵀ u) is a soft-min sweep plus one FMA and a row sum
        # per score (no second dot): 128 x 64 tiles, 8 warps, as measured for the HVP
        # (docs/performance.md; the soft-min's 256-row tiles were not tried here).
        return TransportConfig(128, 64, bd, dt, bp, pt, br, rt, 8, 3)
    wide = bd > 32 or bp > 32 or dt > 1 or pt > 1
    if precision == "tf32" and r == 0 and bd <= 64 and bp <= 64 and dt == pt == 1:
        # One tensor-core dot per product: 64 rows are one warpgroup's tile, and a second
        # warpgroup would only repeat the score tile and its exponentials. sm_90 code of
        # Triton 3.6 at d = p = 64: 7,050 warp instructions per column tile with 8 warps,
        # 3,670 with 4, both at ~220 registers (two 4-warp blocks per SM); 50k² on the H200:
        # 13.1 ms. One warpgroup spills at d = p = 128 and with the three dots of "tf32x3"
        # (284 bytes).
        wide = False
    return TransportConfig(64, 64, bd, dt, bp, pt, br, rt, 8 if wide else 4, 2)


def grad_tiles(d: int) -> tuple[int, int, int, int] | None:
    """(rows, columns, warps, stages) of the gradient's transport pass for one 16-bit score
    operand per point, or None for the rule of :func:`transport_config`.

    Measured on the H200 with the float16 P·y dot and the whole-wave split (docs/performance.md):
    at 32 < d <= 64, 128 x 128 tiles with 4 warps (10k: 0.41 ms, 50k: 3.63 ms, against
    0.50 / 4.69 for 256 x 64 / 8 warps); at 64 < d <= 128, 128 x 128 with 8 warps (10k: 0.52 ms;
    64 x 128 / 4 warps is 5 % slower at 10k and 24 % faster at 40k, where the row has its 2x
    with room). fp32 operand tiles of these sizes would not fit in shared memory.
    """
    if 32 < d <= 64:
        return (128, 128, 4, 3)
    if 64 < d <= 128:
        return (128, 128, 8, 2)
    return None


# ----- fixed launch constants of the other kernels -----

#: Rows per program of the soft-min's split merge (softmin._lse_combine_kernel).
COMBINE_BLOCK = 256

#: Rows per program of the transport's split merge (transport._apply_combine_kernel).
COMBINE_ROWS = 32

#: Hadamard weight tiles A_I B_Jᵀ of rank blocks narrower than this are formed by the exact fp32
#: FMA dot: on the H200 (Triton 3.6) tensor-core dots of 16-wide fp32 rank blocks gave wrong
#: weights or an illegal address in 8-warp launches (bench/results/transport_matrix_h200.json);
#: 64-wide blocks were right at every precision. At small rank the FMA dot costs little.
TC_MIN_RANK_BLOCK = 64

#: Row-block groups per SM of the plan step (each holds one row of column partials,
#: B · groups · m floats). With no more row blocks than that, every block is its own group.
GROUPS_PER_SM = 4

#: Rows per program of the plan step's bias and finishing kernels, and the partial sums the
#: finishing kernel adds per load.
FINISH_BLOCK = 128
FINISH_PARTS = 16

#: Label tables up to this many classes are staged on chip (tiles.label_tile).
ONCHIP_MAX_V = 32

#: Dense path: smallest d at which "auto" chooses it, and the largest Gram matrix it allocates.
DENSE_MIN_D = 256
DENSE_MAX_BYTES = 4 << 30
#: Largest fraction of the free device memory a Gram matrix may take (the rest: the solve's
#: other buffers and the caller's).
DENSE_FREE_FRACTION = 0.4

#: Dense soft-min tiles (BLOCK_M, BLOCK_N, warps) per orientation (False: rows of K, the x side;
#: True: its columns). Long contiguous runs along the stored rows of K: 16 x 256 tiles (row
#: sweeps) and 64 x 256 (column sweeps) read ~2.0 and ~2.4 TB/s on the H100, 128 x 64 only 0.7;
#: with 16-byte loads (padded rows) the pair averages 2.9 TB/s at 10k and 3.45 TB/s at 20k on
#: the H200 (docs/performance.md).
DENSE_SOFTMIN_TILES = {False: (16, 256, 4), True: (64, 256, 8)}
DENSE_SOFTMIN_STAGES = 3

#: Dense envelope gradient: (BLOCK_M, BLOCK_N, warps) of the row-softmax kernel per orientation,
#: the fastest of a sweep on the H200 at 10k, d = 512 with blocks of 2^26 scores (0.91 / 0.90 ms
#: per side against 1.64 / 3.48 ms at the first tiles with 2^24: a 2^24 block had ~100 and ~26
#: programs for 132 SMs).
DENSE_SOFTMAX_TILES = {False: (8, 256, 4), True: (16, 256, 4)}
#: Scores per row block of the dense gradient (the softmax buffer: 256 MiB of fp32).
DENSE_CHUNK_ELEMENTS = 1 << 26

#: Prepare kernels: rows per program of the statistics and side kernels, and the per-block
#: partials the reduction reads per load.
PREPARE_BLOCK = 64
PREPARE_BLOCK_P = 32


def prepare_block_d(d: int) -> int:
    """Features per chunk of the prepare kernels."""
    return min(max(16, next_pow2(d)), 64)


#: Once-per-solve scalar kernel (sums.py): points per load and features per chunk.
SUMS_BLOCK = 1024
SUMS_BLOCK_D = 64
