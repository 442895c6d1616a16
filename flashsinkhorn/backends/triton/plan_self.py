"""Self step with one exp per pair of points: the upper triangle of the plan's tiles.

For a self problem (one cloud x, weights a, one potential f) the plan
π_ij = a_i a_j exp((f_i + f_j − C_ij)/eps) is symmetric, so its row sums r_i = Σ_j π_ij follow
from the tiles (I, J) with J ≥ I: such a tile adds its row sums to the rows of block I and, for
J > I, its column sums to the rows of block J. The update is the plan step's
T(f)_i = f_i − eps ln(r_i / a_i) (plan.py), with the same trusted range of the sums, the same
device flag and the same guarded online-LSE fallback. Half the tile products and exps of the
online-LSE sweep, which forms every tile. Derivation and range argument: docs/kernels.md.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, launch, precompile_once
from ...problem import Side
from ...tuning import TUNING
from ..kernel_costs import cost_id
from . import configs, softmin, sums
from .configs import FINISH_BLOCK, FINISH_PARTS, self_plan_config
from .operands import even_d, is_half, operands
from .plan import _plan_finish_rows, _plan_program
from .split import sm_count, split_count
from .tiles import SQEUCLIDEAN, batch_base, col_bias, cost_scores, plan_row_block, score_tile

_DYNAMIC = [
    "n",
    "n_blocks",
    "n_pairs",
    "n_groups",
    "n_split",
    "tiles_per_chunk",
    "n_parts",
    "s_xb",
    "s_fb",
    "s_pr",
    "has_shift",
]


@triton.jit
def _tile_plan(
    p_r, p_c0, U, Xsq, o_n, m_m, m_dd, b_r, b_rl, b_u, b_rsq, o_d, i_b64,
    n, d, s_xn, s_fb, scale2, inv_eps2, dot_scale, sq_floor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, COST: tl.constexpr,
):  # fmt: skip
    # [BLOCK_M, BLOCK_N] plan tile 2^(z_ij + u_i) with z_ij = dot · scale2 + u_j: rows and
    # columns are the same cloud, so both biases come from U.
    m_n = o_n < n
    p_c = p_c0 + o_n.to(tl.int64)[:, None] * s_xn + o_d[None, :]
    # Issued before the dot, whose wait would otherwise expose the load's latency.
    b_v = tl.load(U + i_b64 * n + o_n, mask=m_n, other=float("-inf"))
    b_s, _ = score_tile(
        p_r, p_c, m_m, m_n, m_dd, b_r, b_rl, o_d, d,
        BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION,
    )  # fmt: skip
    b_csq = b_v
    if COST != SQEUCLIDEAN:
        b_csq = tl.load(Xsq + i_b64 * s_fb + o_n, mask=m_n, other=0.0)
    b_z, _ = cost_scores(b_s, b_v, b_rsq, b_csq, b_s, scale2, inv_eps2, dot_scale, sq_floor,
                         COST, 0)  # fmt: skip
    # Masked rows and columns carry a -inf bias: their plan entries are exactly 0.
    return tl.exp2(b_z + b_u[:, None])


@triton.jit
def _self_block(
    X, Xsq, Xlogw, U, p_part, i_b64, i_r, c0, c1,
    n, d, s_xb, s_xn, s_fb, scale2, inv_eps2, dot_scale, sq_floor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, COST: tl.constexpr, EVEN_D: tl.constexpr,
    NULLS: tl.constexpr,
):  # fmt: skip
    # Row block i_r against the columns [c0, c1) (c0 >= i_r · BLOCK_M, a multiple of BLOCK_N):
    # the row sums go to the rows of the block, the column sums of the tiles right of the
    # diagonal block to their columns, both added into this program's partial row p_part.
    # The previous block's stores to p_part must be visible to every thread that reads them
    # back (a reduced vector's owner may differ between loads and stores).
    tl.debug_barrier()
    o_m, m_m, o_d, p_r, m_dd, b_r, b_rl, b_u, b_rsq = plan_row_block(
        X, Xsq, U, i_b64, i_r, n, d, s_xb, s_xn, s_fb,
        BLOCK_M, BLOCK_D, D_TILES, PRECISION, COST, EVEN_D,
    )  # fmt: skip
    p_c0 = batch_base(X, i_b64, s_xb, EVEN_D)
    # NULLS: zero-weight points carry a finite bias (their weight left out) so that their own
    # rows get their sums; their entries are kept out of every other point's sum here.
    b_live_r = m_m
    if NULLS:
        b_live_r = tl.load(Xlogw + i_b64 * s_fb + o_m, mask=m_m, other=float("-inf")) > float(
            "-inf"
        )
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    # Columns of the diagonal block: each pair of its rows is in it twice, once per order, so
    # only its row sums count. Right of it π_ji = π_ij, and the column sums are row sums of the
    # rows below, which never form this tile. One loop for both, the column stores masked:
    # two loops spilled more under the d <= 128 register cap (ptxas, sm_90: 1656 bytes of
    # stack against 1000).
    diag_stop = (i_r + 1) * BLOCK_M
    for start_n in range(c0, c1, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n
        m_col = m_n & (o_n >= diag_stop)
        # Read before the dot so that the load's latency hides behind it.
        b_old = tl.load(p_part + o_n, mask=m_col, other=0.0)
        b_p = _tile_plan(
            p_r, p_c0, U, Xsq, o_n, m_m, m_dd, b_r, b_rl, b_u, b_rsq, o_d, i_b64,
            n, d, s_xn, s_fb, scale2, inv_eps2, dot_scale, sq_floor,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, COST,
        )  # fmt: skip
        if NULLS:
            b_live_c = tl.load(Xlogw + i_b64 * s_fb + o_n, mask=m_n, other=float("-inf"))
            b_sum += tl.sum(tl.where(b_live_c[None, :] > float("-inf"), b_p, 0.0), 1)
            b_col = tl.sum(tl.where(b_live_r[:, None], b_p, 0.0), 0)
        else:
            b_sum += tl.sum(b_p, 1)
            b_col = tl.sum(b_p, 0)
        tl.store(p_part + o_n, b_old + b_col, mask=m_col)
    # The block's own rows: written by earlier blocks of this program as their columns (this
    # block's stores went to columns right of its diagonal block only).
    b_prev = tl.load(p_part + o_m, mask=m_m, other=0.0)
    tl.store(p_part + o_m, b_prev + b_sum, mask=m_m)


@triton.jit(do_not_specialize=_DYNAMIC)
def _plan_self_fwd_kernel(
    X, Xsq, Xlogw, U, Part, Flag,
    n, d, n_blocks, n_pairs, n_groups, n_split, tiles_per_chunk,
    s_xb, s_xn, s_fb, s_pr,
    eps, dot_scale, sq_floor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, COST: tl.constexpr, EVEN_D: tl.constexpr,
    NULLS: tl.constexpr,
):  # fmt: skip
    # grid (groups, B, n_split). Row block I sweeps the column tiles from its own diagonal on,
    # n_tiles − I · R of them (R = BLOCK_M / BLOCK_N); the pair (I, n_blocks − 1 − I) sweeps
    # 2 n_tiles − (n_blocks − 1) R, the same for every pair. Program (g, b, s) takes chunk s
    # (tiles_per_chunk of the pair's tiles, the lower block's first) of the pairs g,
    # g + n_groups, ...: equal work per program for any n. Its sums go to its own zeroed row
    # of the partials Part [groups · n_split, B, n], which the finishing kernel adds up.
    i_g, i_b, i_s, i_b64, scale2, inv_eps2 = _plan_program(Flag, eps, dot_scale)
    p_part = Part + (i_g * n_split + i_s).to(tl.int64) * s_pr + i_b64 * n
    n_tiles = (n + BLOCK_N - 1) // BLOCK_N
    v0 = i_s * tiles_per_chunk
    for p in range(i_g, n_pairs, n_groups):
        i_hi = n_blocks - 1 - p
        t_lo = n_tiles - p * (BLOCK_M // BLOCK_N)
        t_pair = t_lo
        if i_hi != p:
            t_pair += n_tiles - i_hi * (BLOCK_M // BLOCK_N)
        v1 = tl.minimum(v0 + tiles_per_chunk, t_pair)
        # [v0, v1) of the pair's tiles: those below t_lo belong to the lower block p (h = 0),
        # the rest to the upper block i_hi (h = 1; none for the middle block of an odd count).
        # A loop rather than two calls: one copy of the sweep in the compiled kernel.
        for h in range(2):
            i_r = p + h * (i_hi - p)
            a = tl.maximum(v0 - h * t_lo, 0)
            b = tl.minimum(v1 - h * t_lo, t_lo + h * (t_pair - 2 * t_lo))
            if a < b:
                _self_block(
                    X, Xsq, Xlogw, U, p_part, i_b64, i_r, i_r * BLOCK_M + a * BLOCK_N,
                    tl.minimum(i_r * BLOCK_M + b * BLOCK_N, n),
                    n, d, s_xb, s_xn, s_fb, scale2, inv_eps2, dot_scale, sq_floor,
                    BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, COST, EVEN_D, NULLS,
                )  # fmt: skip


@triton.jit(do_not_specialize=_DYNAMIC)
def _plan_self_bias_kernel(
    Xsq, Xlogw, F, U, Shift, n, s_fb, has_shift, eps,
    BLOCK: tl.constexpr, COST: tl.constexpr, NULLS: tl.constexpr,
):  # fmt: skip
    # u_i of the plan's exponent (B, n), half the plan's shift in each of u_i and u_j.
    # NULLS: zero-weight points get the bias without their weight (finite), the kernel keeps
    # their entries out of the other points' sums.
    i_m = tl.program_id(0)
    i_b = tl.program_id(1)
    o_m = i_m * BLOCK + tl.arange(0, BLOCK)
    m_m = o_m < n
    i_b64 = i_b.to(tl.int64)
    o_v = i_b64 * s_fb + o_m
    inv_eps2 = 1.4426950408889634 / eps
    half2 = 0.0
    if has_shift != 0:
        half2 = tl.load(Shift + i_b) * (0.5 * inv_eps2)
    if NULLS:
        b_h = tl.load(F + o_v, mask=m_m, other=0.0)
        if COST == SQEUCLIDEAN:
            b_h -= tl.load(Xsq + o_v, mask=m_m, other=0.0)
        b_lw = tl.load(Xlogw + o_v, mask=m_m, other=0.0)
        b_h = b_h * inv_eps2 + tl.where(b_lw > float("-inf"), b_lw, 0.0) * 1.4426950408889634
    else:
        b_h, _ = col_bias(F, Xsq, Xlogw, o_v, m_m, inv_eps2, COST)
    tl.store(U + i_b64 * n + o_m, b_h - half2, mask=m_m)


@triton.jit(do_not_specialize=_DYNAMIC)
def _plan_self_finish_kernel(
    Part, Xsq, U, F, Fout, Fraw, Flag, Shift, n, n_parts, s_pr, s_fb, has_shift,
    eps, alpha, beta,
    BLOCK: tl.constexpr, PARTS: tl.constexpr, WRITE_RAW: tl.constexpr, COST: tl.constexpr,
):  # fmt: skip
    # r_i = Σ of the partial rows; the epilogue's log2 Σ_j 2^z_ij = log2 r_i − u_i + shift/2
    # (u_i holds minus half the shift, u_j the other half).
    i_b = tl.program_id(1)
    half2 = 0.0
    if has_shift != 0:
        half2 = tl.load(Shift + i_b) * (0.5 * 1.4426950408889634 / eps)
    _plan_finish_rows(
        Part, Xsq, U, F, Fout, Fraw, Flag, i_b, tl.program_id(0), n, n_parts, s_pr, n, s_fb, n,
        eps, alpha, beta, half2, BLOCK, PARTS, WRITE_RAW, COST,
    )  # fmt: skip


def eligible(X: Side) -> bool:
    """True when the triangular self step can serve the self problem of ``X``: no label term
    (the plan step has none). Zero-weight points are supported."""
    return X.labels is None


#: Phases of the loop in which the triangular step is taken (the plain update from zero
#: potentials keeps the online-LSE sweep).
PHASES = ("second", "iterate")


def self_step(X: Side, f, eps, alpha, beta, want_raw, precision, phase="iterate"):
    """One averaged self step ``alpha · f + beta · T(f)`` from one sweep over the upper
    triangle of the plan's tiles, redone by the guarded online-LSE step when the plan's sums
    leave the trusted range.

    Args:
        X: the side of the self problem (points, weights, squared norms).
        f: (B, n) float32 potential.
        eps: entropic regularisation.
        alpha: weight of ``f`` in the output.
        beta: weight of T(f) in the output.
        want_raw: also return T(f).
        precision: "ieee", "tf32" or "tf32x3" for the dot products.
        phase: "second" (the first averaged step after the plain update from zero: the plan is
            shifted as plan.phase_shift does for a two-potential problem) or "iterate".

    Returns:
        ``(alpha · f + beta · T(f), T(f) or None)``, both (B, n); f is not written.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    args = (X, f, eps, alpha, beta, want_raw, precision, phase)
    key = ("plan_self", X.x.device, X.x.shape[-1], X.x.dtype, precision, X.cost, want_raw,
           X.has_null, phase)  # fmt: skip
    precompile_once(key, _self_step, *args)
    return _self_step(*args)


def layout(n: int, B: int, cfg, device) -> tuple[int, int, int, int]:
    """(groups, column chunks, tiles per chunk, pairs) of the triangular sweep for n points.

    Every pair of row blocks sweeps the same number of tiles; the chunks split them into
    whole waves where the config knows its blocks per SM (:func:`_wave_chunks`), else as the
    soft-min splits its columns (split.split_count). Each (group, chunk) owns one partial row
    of n floats per problem, at most ``GROUPS_PER_SM`` per SM in all.
    """
    nb = cdiv(n, cfg.block_m)
    ratio = cfg.block_m // cfg.block_n
    n_tiles = cdiv(n, cfg.block_n)
    pairs = cdiv(nb, 2)
    t_pair = n_tiles if nb == 1 else 2 * n_tiles - (nb - 1) * ratio
    cap = configs.GROUPS_PER_SM * sm_count(device)
    groups = _groups(pairs, cap)
    known = cfg.blocks_per_sm is not None and device.type == "cuda"
    if known and TUNING.softmin_split is None:
        # (no more chunks than keep one pair per program within the partial rows' cap)
        most = max(1, cap // groups)
        split = _wave_chunks(groups * B, t_pair, cfg.blocks_per_sm * sm_count(device), most)
    else:
        split = split_count(groups * B, t_pair * cfg.block_n, cfg.block_n, device)
    tpc = cdiv(t_pair, split)
    split = cdiv(t_pair, tpc)
    groups = _groups(pairs, max(1, cap // split))
    return groups, split, tpc, pairs


def _groups(pairs: int, limit: int) -> int:
    """At most ``limit`` groups with the same number of pairs each, give or take one."""
    return cdiv(pairs, cdiv(pairs, limit))


def _wave_chunks(programs: int, tiles: int, slots: int, most: int) -> int:
    """Chunks per pair (at most ``most``) for ``programs`` pairs of ``tiles`` tiles each on
    ``slots`` resident blocks: every program has the same work, so a grid of w waves takes
    ⌈w⌉ times one chunk's tiles. The fewest chunks within 2 % of the best such time (each
    chunk a partial row more to zero and add), each chunk at least 4 tiles."""
    costs = {}
    for s in range(1, max(1, min(most, 64, tiles // 4)) + 1):
        tpc = cdiv(tiles, s)
        k = cdiv(tiles, tpc)  # chunks after rounding the chunk to whole tiles
        costs[k] = cdiv(programs * k, slots) * tpc
    best = min(costs.values())
    return min(k for k, c in costs.items() if c <= 1.02 * best)


def _self_step(X, f, eps, alpha, beta, want_raw, precision, phase):
    B, n, d = X.x.shape
    shift = None
    if phase == "second":
        # The two-potential plan of (X, X, f, f) has the same sums as this one: its shift.
        lam = X.damping(eps)
        shift = sums.second_shift(X, X, f, f, 1.0 - 0.5 / lam, -(22.0 + math.log(n)) * eps)
    xx, _, dot_scale, prec = operands(X, X, precision)
    cfg = self_plan_config(d, is_half(xx, prec))
    groups, split, tpc, pairs = layout(n, B, cfg, X.x.device)
    part = torch.zeros((groups * split, B, n), dtype=torch.float32, device=f.device)
    flag = torch.empty(1, dtype=torch.float32, device=f.device)
    u = torch.empty((B, n), dtype=torch.float32, device=f.device)
    out = torch.empty_like(f)
    raw = torch.empty_like(f) if want_raw else out
    cost = cost_id(X.cost)
    has_shift = shift is not None
    shift = shift.contiguous() if has_shift else flag
    nulls = bool(X.has_null)
    grid = (cdiv(n, FINISH_BLOCK), B)
    launch(_plan_self_bias_kernel, grid,
        X.sq, X.logw, f, u, shift, n, f.stride(0), int(has_shift), float(eps),
        BLOCK=FINISH_BLOCK, COST=cost, NULLS=nulls, **FP_FUSION,
    )  # fmt: skip
    launch(_plan_self_fwd_kernel, (groups, B, split),
        xx, X.sq, X.logw, u, part, flag,
        n, d, cdiv(n, cfg.block_m), pairs, groups, split, tpc,
        xx.stride(0), xx.stride(1), f.stride(0), B * n,
        float(eps), float(dot_scale), float(X.sq_floor),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        PRECISION=prec, COST=cost, EVEN_D=even_d(cfg, d, xx), NULLS=nulls,
        **cfg.launch_options(), **FP_FUSION,
    )  # fmt: skip
    launch(_plan_self_finish_kernel, grid,
        part, X.sq, u, f, out, raw, flag, shift, n, groups * split, B * n, f.stride(0),
        int(has_shift), float(eps), float(alpha), float(beta),
        BLOCK=FINISH_BLOCK, PARTS=FINISH_PARTS, WRITE_RAW=want_raw, COST=cost, **FP_FUSION,
    )  # fmt: skip
    # Runs (and overwrites the outputs) only where the flag was raised.
    guarded_softmin(X, f, eps, alpha, beta, want_raw, precision, out, raw, flag)
    return out, (raw if want_raw else None)


def guarded_softmin(X: Side, f, eps, alpha, beta, want_raw, precision, out, raw, guard):
    """The online-LSE self step ``alpha · f + beta · T(f)`` into ``out`` (and T(f) into ``raw``
    when ``want_raw``), launched so that it does nothing unless the float32 device flag
    ``guard`` is non-zero: the symmetric step of (X, X) with the x side's programs only."""
    softmin.symmetric_step(
        X, X, f, f, eps, alpha, beta, beta, want_raw, precision, out=(out, out, raw, raw),
        guard=guard, x_only=True,
    )  # fmt: skip
