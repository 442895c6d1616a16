"""Two independent half-steps in one launch: the fused step of a sharded problem.

The symmetric step of a single problem (softmin.py) updates f from (X rows, Y columns) and g
from (Y rows, X columns) in one grid. A sharded problem's rank updates its x rows against the
y columns of some rank and its y rows against the x columns of some rank (gather mode: the
whole other cloud; ring mode: the shard in hand), four different sides: this kernel takes
each half-step's rows and columns separately, and runs the same row sweep
(``softmin._softmin_rows``) for both in one grid, split over column chunks and merged by the
same combine kernel when the row blocks cannot fill the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, launch
from .configs import lse_config
from .operands import aligned_cols, cost_args, even_d, is_half, operands
from .softmin import (
    SOFTMIN_DYNAMIC,
    _softmin_rows,
    combine_sides,
    expansion_args,
    pair_chunks,
    partials,
)

PAIR_DYNAMIC = SOFTMIN_DYNAMIC + [
    "n_r1", "n_c1", "n_r2", "n_c2", "n_blocks_1", "cps_1", "cps_2", "s_r1b", "s_r1n",
    "s_c1b", "s_c1n", "s_r2b", "s_r2n", "s_c2b", "s_c2n", "s_v1b", "s_p1b", "s_v2b", "s_p2b",
    "s_ps1", "s_ps2",
]  # fmt: skip


# fmt: off
@triton.jit(do_not_specialize=PAIR_DYNAMIC)
def _softmin_pair_kernel(
    R1, C1, R1sq, C1sq, C1logw, P1, Old1, Out1, Raw1, PM1, PS1, Rc1, Cwn1, Clogm1,
    R2, C2, R2sq, C2sq, C2logw, P2, Old2, Out2, Raw2, PM2, PS2, Rc2, Cwn2, Clogm2,
    n_r1, n_c1, n_r2, n_c2, d, n_blocks_1, cps_1, cps_2, n_split,
    s_r1b, s_r1n, s_c1b, s_c1n, s_r2b, s_r2n, s_c2b, s_c2n,
    s_v1b, s_p1b, s_v2b, s_p2b, s_ps1, s_ps2,
    eps, alpha, beta_1, beta_2, dot_scale, sq_floor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, WRITE_RAW: tl.constexpr,
    COST: tl.constexpr, EVEN_D: tl.constexpr, LARGE: tl.constexpr, ALIGNED_V: tl.constexpr,
):
    # The first n_blocks_1 programs sweep the first pair's rows, the rest the second's. No
    # label term (LABELS = 0: the label pointers are never read).
    i_m = tl.program_id(0)
    i_b = tl.program_id(1)
    i_s = tl.program_id(2)
    if i_m < n_blocks_1:
        _softmin_rows(
            R1, C1, R1sq, C1sq, C1logw, P1, Old1, Out1, Raw1, PM1, PS1, R1sq, R1sq, R1sq,
            Rc1, Cwn1, Clogm1,
            i_b, i_m, i_s,
            n_r1, n_c1, d, cps_1, n_split, 1,
            s_r1b, s_r1n, s_c1b, s_c1n, s_v1b, s_p1b, s_ps1,
            eps, alpha, beta_1, dot_scale, sq_floor, 1.0,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, WRITE_RAW, COST, 0, EVEN_D, LARGE,
            ALIGNED_V,
        )
    else:
        _softmin_rows(
            R2, C2, R2sq, C2sq, C2logw, P2, Old2, Out2, Raw2, PM2, PS2, R2sq, R2sq, R2sq,
            Rc2, Cwn2, Clogm2,
            i_b, i_m - n_blocks_1, i_s,
            n_r2, n_c2, d, cps_2, n_split, 1,
            s_r2b, s_r2n, s_c2b, s_c2n, s_v2b, s_p2b, s_ps2,
            eps, alpha, beta_2, dot_scale, sq_floor, 1.0,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, WRITE_RAW, COST, 0, EVEN_D, LARGE,
            ALIGNED_V,
        )
# fmt: on


def eligible(first: tuple, second: tuple, precision: str) -> bool:
    """Whether two half-steps ``(rows, cols, col_pot, old, beta)`` can share one launch: the
    same operand format, scale, dimension and cost, no label term, one large-eps regime."""
    (r1, c1, *_), (r2, c2, *_) = first, second
    if r1.labels is not None or r2.labels is not None or r1.large_eps != r2.large_eps:
        return False
    o1, o2 = operands(r1, c1, precision), operands(r2, c2, precision)
    return (
        o1[0].dtype == o2[0].dtype
        and o1[1].dtype == o2[1].dtype
        and o1[0].shape[-1] == o2[0].shape[-1]
        and o1[2] == o2[2]
        and o1[3] == o2[3]
        and cost_args(r1, c1)[0] == cost_args(r2, c2)[0]
        and r1.sq_floor == r2.sq_floor
        and r1.x.shape[0] == r2.x.shape[0]
    )


def pair_step(first: tuple, second: tuple, eps: float, alpha: float, want_raw: bool,
              precision: str):  # fmt: skip
    """Both half-steps in one grid (plus one merge launch when the columns are split).

    Args:
        first: ``(rows, cols, col_pot, old, beta)`` of the first half-step.
        second: the same for the second one (:func:`eligible` with ``first``).
        eps, alpha, want_raw, precision: as in ``softmin.softmin``; ``alpha`` is shared.

    Returns:
        ``((out_1, raw_1 or None), (out_2, raw_2 or None))``.
    """
    R1, C1, p1, old1, beta_1 = first
    R2, C2, p2, old2, beta_2 = second
    B, n1, d = R1.x.shape
    n2, m1, m2 = R2.x.shape[1], C1.x.shape[1], C2.x.shape[1]
    xr1, xc1, dot_scale, prec = operands(R1, C1, precision)
    xr2, xc2, _, _ = operands(R2, C2, precision)
    cfg = lse_config(d, is_half(xr1, prec))
    out1, out2 = old1.new_empty(old1.shape), old2.new_empty(old2.shape)
    raw1 = old1.new_empty(old1.shape) if want_raw else out1
    raw2 = old2.new_empty(old2.shape) if want_raw else out2
    nb1 = cdiv(n1, cfg.block_m)
    n_blocks = nb1 + cdiv(n2, cfg.block_m)
    large = eps >= R1.large_eps
    split, cps1, cps2 = pair_chunks(large, n_blocks * B, m1, m2, cfg.block_n, R1.x.device)
    pm1, ps1 = partials(split, R1.sq)
    pm2, ps2 = partials(split, R2.sq)
    cost = cost_args(R1, C1)[0]
    if large:
        e1, e2 = expansion_args(R1, C1, p1), expansion_args(R2, C2, p2)
    else:
        e1 = e2 = (out1, out1, out1)
    launch(_softmin_pair_kernel, (n_blocks, B, split),
        xr1, xc1, R1.sq, C1.sq, C1.logw, p1, old1, out1, raw1, pm1, ps1, *e1,
        xr2, xc2, R2.sq, C2.sq, C2.logw, p2, old2, out2, raw2, pm2, ps2, *e2,
        n1, m1, n2, m2, d, nb1, cps1, cps2, split,
        xr1.stride(0), xr1.stride(1), xc1.stride(0), xc1.stride(1),
        xr2.stride(0), xr2.stride(1), xc2.stride(0), xc2.stride(1),
        R1.sq.stride(0), C1.sq.stride(0), R2.sq.stride(0), C2.sq.stride(0), B * n1, B * n2,
        float(eps), float(alpha), float(beta_1), float(beta_2), float(dot_scale),
        float(R1.sq_floor),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        PRECISION=prec, WRITE_RAW=want_raw, COST=cost,
        EVEN_D=even_d(cfg, d, xr1, xc1, xr2, xc2), LARGE=large,
        ALIGNED_V=aligned_cols((m1, C1.sq), (m1, C1.logw), (m1, p1), (m2, C2.sq), (m2, C2.logw),
                               (m2, p2)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_FUSION,
    )  # fmt: skip
    if split > 1:
        combine_sides(
            (pm1, ps1, R1.sq, old1, out1, raw1), (pm2, ps2, R2.sq, old2, out2, raw2),
            split, eps, alpha, beta_1, beta_2, want_raw, cost,
        )  # fmt: skip
    return (out1, raw1 if want_raw else None), (out2, raw2 if want_raw else None)
