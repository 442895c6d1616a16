"""Hopper sweep of the plan half-step: the x·yᵀ product of the next tile runs on the tensor
cores while the exponentials of the previous tile run on the special-function units.

The plain sweep (plan.py, ``COLS`` False) waits for each tile's warpgroup product before its
exp2, so per tile the two units take turns. This kernel, written in Gluon (Triton's explicit
dialect, needed for the asynchronous product), issues the product of tile t, forms the plan
entries of tile t − 1 from registers while it runs, then waits: the score pipeline of
FlashAttention-3's intra-warpgroup overlap. Column tiles arrive by cp.async, ``STAGES`` deep.

Same contract as the plain sweep for squared-Euclidean costs with 16-bit score operands
(precision "tf32") and rows of a whole number of 16-byte vectors: row sums of
exp2(s·scale2 + v_j + u_i) per column chunk into Prow, and the flag reset. The arithmetic per
score is the plain kernel's, in the same order. GPU only (Gluon has no interpreter); the
interpreter covers the plain kernel, and tests/test_half_hopper.py compares the two on the
GPU. docs/kernels.md has the schedule.
"""

from __future__ import annotations

import functools

import torch
import triton

from .configs import interpreting

# Gluon's Hopper API moved between releases; the kernel was compiled and run with Triton 3.6
# and compiled with 3.9 (sm_90). Older Tritons keep the plain sweep.
_VERSION_OK = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit()) >= (3, 6)

try:  # the plain kernel serves every setup without Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # cp.async of a pointer tile into shared memory: ``async_load`` from Triton 3.7 on,
    # ``async_copy_global_to_shared`` before (removed in 3.9).
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    # CTA-wide barrier: ``barrier`` in Triton >= 3.7, ``thread_barrier`` before.
    _barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _IMPORTED = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _IMPORTED = False


@functools.lru_cache(maxsize=8)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def available(device: torch.device) -> bool:
    """True when the Gluon sweep can run on ``device``: a Hopper GPU (sm_90), Triton >= 3.6,
    and not the interpreter."""
    if not (_IMPORTED and _VERSION_OK) or interpreting() or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def supports(d: int, dtype: torch.dtype, sqeuclidean: bool, even: bool) -> bool:
    """True for the operands the kernel handles: float16 score operands (precision "tf32") of
    16 to 128 features, one feature tile whose rows and batches start at 16-element
    multiples (``even``: operands.even_d), and the squared-Euclidean cost."""
    return dtype == torch.float16 and sqeuclidean and even and d in (16, 32, 64, 128)


if _IMPORTED:

    @gluon.jit
    def _load_cols(Yb, y_slot, o_n, o_d, col_stop, s_yn):
        # Column tile rows o_n of one problem into a shared slot (zero-filled past the chunk's
        # end, whose scores the -inf bias of V removes), as one cp.async group.
        p = Yb + o_n.to(gl.int64)[:, None] * s_yn + o_d[None, :]
        _cp_async(y_slot, p, mask=(o_n < col_stop)[:, None])
        async_copy.commit_group()

    @gluon.jit(do_not_specialize=["n_x", "n_y", "cols_per_split", "s_xb", "s_yb"])
    def _half_sweep_kernel(
        X, Y, U, V, Prow, Flag,
        n_x, n_y, cols_per_split, s_xb, s_xn, s_yb, s_yn, s_prs, s_vb,
        eps, dot_scale,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
        STAGES: gl.constexpr,
    ):  # fmt: skip
        # Program (i_m, i_b, i_s): row block i_m of problem i_b against column chunk i_s.
        NW: gl.constexpr = gl.num_warps()
        VEC: gl.constexpr = 8  # 16-byte cp.async vectors of float16
        TPW_D: gl.constexpr = BLOCK_D // VEC
        ld: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPW_D, TPW_D], [NW, 1], [1, 0])
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16]
        )
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)
        cols_l: gl.constexpr = gl.SliceLayout(0, mma)
        smem_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], gl.float16)
        smem_x: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], gl.float16)

        i_m = gl.program_id(0)
        i_b = gl.program_id(1)
        i_s = gl.program_id(2)
        if (i_m == 0) & (i_b == 0) & (i_s == 0):
            gl.store(Flag, 0.0)
        scale2 = 2.0 * 1.4426950408889634 * dot_scale / eps
        i_b64 = i_b.to(gl.int64)
        # Rows and batches start at multiples of 16 elements (the launcher checks it).
        Xb = X + gl.multiple_of(i_b64 * s_xb, 16)
        Yb = Y + gl.multiple_of(i_b64 * s_yb, 16)

        o_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, ld))
        o_ml = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
        x_smem = gl.allocate_shared_memory(gl.float16, [BLOCK_M, BLOCK_D], smem_x)
        y_smem = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_N, BLOCK_D], smem_l)
        p_x = Xb + o_ml.to(gl.int64)[:, None] * s_xn + o_d[None, :]
        _cp_async(x_smem, p_x, mask=(o_ml < n_x)[:, None])
        async_copy.commit_group()

        col_start = i_s * cols_per_split
        col_stop = gl.minimum(col_start + cols_per_split, n_y)
        n_tiles = gl.cdiv(col_stop - col_start, BLOCK_N)
        o_nl = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        for t in gl.static_range(STAGES - 1):
            _load_cols(Yb, y_smem.index(t), col_start + t * BLOCK_N + o_nl, o_d, col_stop, s_yn)

        o_m = i_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_l)
        m_m = o_m < n_x
        b_u = gl.load(U + i_b64 * n_x + o_m, mask=m_m, other=float("-inf"))
        o_n0 = gl.arange(0, BLOCK_N, layout=cols_l)
        b_sum = gl.zeros([BLOCK_M], gl.float32, rows_l)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
        # The scores of the previous tile and its column bias; none before the first tile.
        b_s = zero
        b_v = gl.full([BLOCK_N], float("-inf"), gl.float32, cols_l)
        for t in range(0, n_tiles):
            slot = t % STAGES
            # Tile t (and the row tile) landed: the later STAGES - 2 groups may still fly.
            async_copy.wait_group(STAGES - 2)
            _barrier()
            fence_async_shared()
            tok = warpgroup_mma(
                x_smem, y_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
            )
            # Refill the slot of tile t - 1, whose product every warp has waited for before
            # the barrier above.
            nxt = t + STAGES - 1
            _load_cols(Yb, y_smem.index(nxt % STAGES), col_start + nxt * BLOCK_N + o_nl,
                       o_d, col_stop, s_yn)  # fmt: skip
            o_n = col_start + t * BLOCK_N + o_n0
            b_vt = gl.load(V + i_b64 * s_vb + o_n, mask=o_n < col_stop, other=float("-inf"))
            # Tile t - 1 while tile t's product runs (the plain sweep's arithmetic).
            b_z = b_s * scale2 + b_v[None, :]
            b_sum += gl.sum(gl.exp2(b_z + b_u[:, None]), 1)
            b_s = warpgroup_mma_wait(0, deps=[tok])
            b_v = b_vt
        b_z = b_s * scale2 + b_v[None, :]
        b_sum += gl.sum(gl.exp2(b_z + b_u[:, None]), 1)
        async_copy.wait_group(0)
        gl.store(Prow + i_s * s_prs + i_b64 * n_x + o_m, b_sum, mask=m_m)


def launch_sweep(grid, xx, xy, u, v, prow, flag, n, m, cps, eps, dot_scale, cfg, launch, fp_fusion):
    """Launches the Gluon sweep over ``grid`` = (row blocks, B, column chunks) with the tile
    shape ``cfg`` (configs.hopper_half_config)."""
    launch(_half_sweep_kernel, grid,
        xx, xy, u, v, prow, flag,
        n, m, cps, xx.stride(0), xx.stride(1), xy.stride(0), xy.stride(1), n * grid[1],
        v.stride(0), float(eps), float(dot_scale),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, **fp_fusion,
    )  # fmt: skip
