"""Launch configurations chosen by rule, not by autotuning.

A configuration depends only on the feature size d, the dtype and whether the interpreter
runs the kernel, so a new n or m never triggers a recompilation and the first call costs one
compilation (no search). The rules were set from H100 measurements (docs/performance.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

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


def interpreter_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or an exact float32 copy of bfloat16 points under the interpreter.

    The interpreter stores bfloat16 tiles as raw uint16 bit patterns and its ``tl.dot`` feeds
    them to ``np.matmul`` as integers (Triton 3.9: values ~1e9 off, then NaN potentials). The
    upcast is exact and only happens there; compiled kernels read bfloat16 directly.
    """
    if t.dtype == torch.bfloat16 and interpreting():
        return t.float()
    return t


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
        # best of twelve shapes (bench/results/dev/sym_sweep_small_d_h200.json, entry 13).
        return LSEConfig(64, 128, max(16, next_pow2(d)), 1, 4, 3)
    if 32 < d <= 128 and half_operands:
        # 256 x 64 tiles, 8 warps (32 rows per warp), the 16-bit row tile (<= 64 KB) on chip:
        # fastest of ten shapes on the H200 at 50k/64 (40.1 ms against 56.4 ms for 128 x 64),
        # 40k/128 (43.4 against 52.1) and within 5% of the best at 10k/64
        # (bench/results/dev/sym_sweep_h200.json, docs/performance.md entry 12). Not used at
        # small d, where it was not measured and the batched d = 3 case got slower.
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
    # Fastest or within 3 % of it in the sweep of four shapes on the H200
    # (bench/results/dev/plan_sweep_h200_s17_run2.json, docs/performance.md entry 16):
    # d <= 64: 128 x 128 / 4 warps (50k: 20.7 ms per 10 steps, against 22.2 for 128 x 64);
    # d <= 128: 256 x 128 / 8 warps (10k: 2.35 ms against 4.0 for 128 x 64; 40k: 22.7 / 22.2).
    # Session 19 (Nsight Compute, bench/results/dev/ncu_plan_transport_h200_s19.txt; sweep
    # s19_plan_sweep_regs_h200.json, entry 18): the d <= 64 kernel takes 168 registers, so 3
    # blocks fit per SM, and its 10k grid was 1.4 waves (one wave: 1.11 -> 0.97 ms per 10
    # steps); the d <= 128 kernel takes 221 registers, one block per SM, and capped at 128 it
    # runs 1.57 -> 1.41 ms at 10k and 22.5 -> 19.2 ms at 40k (a cap of 128 at d <= 64 lost 30 %).
    if d <= 64:
        return LSEConfig(128, 128, base.block_d, 1, 4, 3, blocks_per_sm=3)
    return LSEConfig(256, 128, base.block_d, 1, 8, 3, maxnreg=128)
