"""Symmetric step with one exp per pair: both soft-mins read off one tile of the plan.

From the same (f, g), the plan π_ij = a_i b_j exp((f_i + g_j − C_ij)/eps) gives both half-steps
through its row and column sums r, c: T(g)_i = f_i − eps ln(r_i / a_i) and
T(f)_j = g_j − eps ln(c_j / b_j). One sweep over x-row blocks forms each x·yᵀ tile and its exps
once (the online-LSE step does both twice); the row sums stay in registers, the column sums of
every tile go to one row per row block, or per group of row blocks past 4 per SM
([≤ 4·SMs, m]), which the finishing kernel adds up. There is no running max: the sums are
only trusted in [2^-64, 3e38], which holds once (f, g) is an iterate of the loop. Outside that
range a device flag makes the guarded online-LSE launch redo the step (no host
synchronisation either way). Derivation and range argument: docs/kernels.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, launch, precompile_once, resident_blocks
from ...problem import Side
from ...tuning import TUNING
from ..kernel_costs import SQEUCLIDEAN as SQEUCLIDEAN_ID
from ..kernel_costs import cost_id
from . import half_hopper, softmin, sums
from .configs import (
    FINISH_BLOCK,
    FINISH_PARTS,
    GROUPS_PER_SM,
    half_config,
    hopper_half_config,
    interpreting,
    plan_config,
)
from .operands import even_d, is_half, operands
from .split import chunk, plan_split, sm_count, split_for
from .tiles import (
    SQEUCLIDEAN,
    batch_base,
    col_bias,
    cost_scores,
    plan_row_block,
    score_tile,
    softmin_epilogue,
)

_DYNAMIC = [
    "n_x",
    "n_y",
    "n_rows",
    "cols_per_split",
    "n_blocks_x",
    "n_groups",
    "n_cb_x",
    "n_parts_x",
    "n_parts_y",
    "s_xb",
    "s_yb",
    "s_fb",
    "s_gb",
    "s_prs",
    "s_pcb",
    "has_shift",
]

# Sums outside [_LOW, _HIGH] (or NaN) send the step to the online-LSE fallback: below _LOW,
# terms flushed to zero could matter (each < 2^-126, at most 2^27 of them); above, a term may
# have overflowed.
_LOW = 2.0**-64
_HIGH = 3.0e38

#: V's rows (the column biases) are padded to a multiple of this, a multiple of every BLOCK_N
#: of the sweep and of FINISH_BLOCK.
V_PAD = 128


@triton.jit
def _plan_rows(
    X, Y, Xsq, Ysq, U, V, Prow, p_col, i_b64, i_m, i_s, i_first,
    n_x, n_y, d, cols_per_split, s_xb, s_xn, s_yb, s_yn, s_fb, s_gb, s_prs, s_vb,
    scale2, inv_eps2, dot_scale, sq_floor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, COST: tl.constexpr, EVEN_D: tl.constexpr,
    ACCUM: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    # One x-row block against one column chunk: its row sums to Prow, its column sums added to
    # the group's row of the column partials (written when i_m is the group's first block).
    # COLS False (a half-step): row sums only, one exp2 and one add per score.
    o_m, m_m, o_d, p_r, m_dd, b_r, b_rl, b_u, b_rsq = plan_row_block(
        X, Xsq, U, i_b64, i_m, n_x, d, s_xb, s_xn, s_fb,
        BLOCK_M, BLOCK_D, D_TILES, PRECISION, COST, EVEN_D,
    )  # fmt: skip
    p_c0 = batch_base(Y, i_b64, s_yb, EVEN_D)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    # Chunks start at multiples of BLOCK_N (split.chunk) and V's rows are padded with -inf to
    # a multiple of every BLOCK_N (s_vb, V's row stride): the column-bias loads need no mask
    # and vectorise, and one 64-bit pointer advanced per tile addresses them (the masked,
    # per-tile addressed loads took ~40 of the ~410 instructions per thread and tile).
    col_start = tl.multiple_of(i_s * cols_per_split, 16)
    col_stop = tl.minimum(col_start + cols_per_split, n_y)
    p_v = V + i_b64 * s_vb + col_start + tl.arange(0, BLOCK_N)
    # At d > 64 the bias loads go before the dot, whose wait would otherwise expose their
    # latency (H200, 50k: half-step 1.46 -> 1.32 ms at d = 128); at d <= 64 the same order
    # made the half-step 3 % and the plan step 6 % slower, so they follow it there.
    EARLY_V: tl.constexpr = BLOCK_D > 64
    for start_n in range(col_start, col_stop, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_y
        if EARLY_V:
            b_v = tl.load(p_v)
        p_c = p_c0 + o_n.to(tl.int64)[:, None] * s_yn + o_d[None, :]
        # The group's running column sums, read before the dot so that the load's latency
        # hides behind it; masked off for the group's first row block (no traffic then).
        b_old = tl.zeros([BLOCK_N], tl.float32)
        if ACCUM and COLS:
            m_old = m_n & ((tl.zeros([BLOCK_N], tl.int32) + i_m) != i_first)
            b_old = tl.load(p_col + o_n, mask=m_old, other=0.0)
        b_s, _ = score_tile(
            p_r, p_c, m_m, m_n, m_dd, b_r, b_rl, o_d, d,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION,
        )  # fmt: skip
        if not EARLY_V:
            b_v = tl.load(p_v)
        p_v += BLOCK_N
        b_csq = b_v
        if COST != SQEUCLIDEAN:
            b_csq = tl.load(Ysq + i_b64 * s_gb + o_n, mask=m_n, other=0.0)
        b_z, _ = cost_scores(
            b_s, b_v, b_rsq, b_csq, b_s, scale2, inv_eps2, dot_scale, sq_floor, COST, 0
        )
        # Masked rows and columns carry a -inf bias: their plan entries are exactly 0.
        b_p = tl.exp2(b_z + b_u[:, None])
        b_sum += tl.sum(b_p, 1)
        if COLS:
            b_col = tl.sum(b_p, 0)
            if ACCUM:
                b_col += b_old
            tl.store(p_col + o_n, b_col, mask=m_n)
    tl.store(Prow + i_s * s_prs + i_b64 * n_x + o_m, b_sum, mask=m_m)


@triton.jit
def _plan_program(Flag, eps, dot_scale):
    # (i_g, i_b, i_s, i_b as int64, base-2 scale of the dot, of the cost) of a plan sweep's
    # program. Program (0, 0, 0) resets the flag for this step's finishing kernel; stream
    # order puts the store after the previous step's guarded launches and before this step's
    # checks.
    i_g = tl.program_id(0)
    i_b = tl.program_id(1)
    i_s = tl.program_id(2)
    if (i_g == 0) & (i_b == 0) & (i_s == 0):
        tl.store(Flag, 0.0)
    scale2 = 2.0 * 1.4426950408889634 * dot_scale / eps
    inv_eps2 = 1.4426950408889634 / eps
    return i_g, i_b, i_s, i_b.to(tl.int64), scale2, inv_eps2


@triton.jit(do_not_specialize=_DYNAMIC)
def _plan_fwd_kernel(
    X, Y, Xsq, Ysq, U, V, Prow, Pcol, Flag,
    n_x, n_y, d, cols_per_split, n_blocks_x, n_groups,
    s_xb, s_xn, s_yb, s_yn, s_fb, s_gb, s_prs, s_pcb, s_vb,
    eps, dot_scale, sq_floor,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    D_TILES: tl.constexpr, PRECISION: tl.constexpr, COST: tl.constexpr, EVEN_D: tl.constexpr,
    GROUPED: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    # Program (i_g, i_b, i_s) sweeps column chunk i_s for the x-row blocks i_g, i_g + n_groups,
    # ...: the column partials need one row per group, not per row block, which keeps them
    # O(SMs · m) instead of O(n · m / BLOCK_M).
    i_g, i_b, i_s, i_b64, scale2, inv_eps2 = _plan_program(Flag, eps, dot_scale)
    p_col = Pcol + i_b64 * s_pcb + i_g.to(tl.int64) * n_y
    if GROUPED:
        for i_m in range(i_g, n_blocks_x, n_groups):
            # The previous row block's column stores must be visible to every thread that
            # reads them back (the reduced vector's owner may differ between loads and stores).
            tl.debug_barrier()
            _plan_rows(
                X, Y, Xsq, Ysq, U, V, Prow, p_col, i_b64, i_m, i_s, i_g,
                n_x, n_y, d, cols_per_split, s_xb, s_xn, s_yb, s_yn, s_fb, s_gb, s_prs, s_vb,
                scale2, inv_eps2, dot_scale, sq_floor,
                BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, COST, EVEN_D, True, COLS,
            )  # fmt: skip
    else:
        # One row block per group: the loop nest and the running sums cost ~10 % at 50k
        # (docs/performance.md).
        _plan_rows(
            X, Y, Xsq, Ysq, U, V, Prow, p_col, i_b64, i_g, i_s, i_g,
            n_x, n_y, d, cols_per_split, s_xb, s_xn, s_yb, s_yn, s_fb, s_gb, s_prs, s_vb,
            scale2, inv_eps2, dot_scale, sq_floor,
            BLOCK_M, BLOCK_N, BLOCK_D, D_TILES, PRECISION, COST, EVEN_D, False, COLS,
        )  # fmt: skip


@triton.jit
def _plan_finish_rows(
    P, Sq, Bias, Pot, Out, Raw, Flag, i_b, i_m, n_rows, n_parts, s_part, s_pb, s_vb, s_bias,
    eps, alpha, beta, shift2, BLOCK: tl.constexpr, PARTS: tl.constexpr,
    WRITE_RAW: tl.constexpr, COST: tl.constexpr,
):  # fmt: skip
    # Adds the partial sums of one side, checks their range and applies the soft-min epilogue
    # with log2 Σ exp2(z) = log2(sum) − u + shift2 (u: this side's bias in the plan's exponent;
    # shift2: the part of the plan's shift that is not in u, base 2).
    o_m = i_m * BLOCK + tl.arange(0, BLOCK)
    m_m = o_m < n_rows
    i_b64 = i_b.to(tl.int64)
    o_p = i_b64 * s_pb + o_m
    o_vr = i_b64 * s_vb + o_m
    # PARTS partials per load: the y side adds one partial per x-row block (hundreds at large
    # n), and one narrow load per partial left the kernel latency-bound.
    b_acc = tl.zeros([PARTS, BLOCK], tl.float32)
    o_k = tl.arange(0, PARTS)
    for k0 in range(0, n_parts, PARTS):
        m_k = (k0 + o_k) < n_parts
        p_k = P + (k0 + o_k).to(tl.int64)[:, None] * s_part + o_p[None, :]
        b_acc += tl.load(p_k, mask=m_k[:, None] & m_m[None, :], other=0.0)
    b_sum = tl.sum(b_acc, 0)
    b_u = tl.load(Bias + i_b64 * s_bias + o_m, mask=m_m, other=0.0)
    b_ok = (b_sum >= 5.421010862427522e-20) & (b_sum <= 3.0e38)  # 2^-64; NaN fails both
    b_bad = tl.max((m_m & (b_ok == 0)).to(tl.int32), 0)
    # a branch, not a store masked by a scalar: Triton 3.2's interpreter stores through a
    # false scalar mask
    if b_bad > 0:
        tl.store(Flag, 1.0)
    softmin_epilogue(
        shift2 - b_u, b_sum, Sq, Pot, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW, COST
    )


@triton.jit(do_not_specialize=_DYNAMIC)
def _plan_finish_kernel(
    Prow, Pcol, Xsq, Ysq, U, V, F, G, Fout, Gout, Fraw, Graw, Flag, Shift,
    n_x, n_y, n_cb_x, n_parts_x, n_parts_y, s_fb, s_gb, s_prs, s_pcb, s_v, has_shift,
    eps, alpha, beta_x, beta_y,
    BLOCK: tl.constexpr, PARTS: tl.constexpr, WRITE_RAW: tl.constexpr, COST: tl.constexpr,
):  # fmt: skip
    i_m = tl.program_id(0)
    i_b = tl.program_id(1)
    if i_m < n_cb_x:
        # f side: the row sums of the column chunks, [chunks, B, n]; u holds the shift.
        _plan_finish_rows(
            Prow, Xsq, U, F, Fout, Fraw, Flag, i_b, i_m, n_x, n_parts_x, s_prs, n_x, s_fb, n_x,
            eps, alpha, beta_x, 0.0, BLOCK, PARTS, WRITE_RAW, COST,
        )  # fmt: skip
    else:
        # g side: the column sums of every row-block group, [B, groups, m]; v does not hold the
        # shift, so it comes back here.
        shift2 = 0.0
        if has_shift != 0:
            shift2 = tl.load(Shift + i_b) * (1.4426950408889634 / eps)
        _plan_finish_rows(
            Pcol, Ysq, V, G, Gout, Graw, Flag, i_b, i_m - n_cb_x, n_y, n_parts_y, n_y,
            s_pcb, s_gb, s_v, eps, alpha, beta_y, shift2, BLOCK, PARTS, WRITE_RAW, COST,
        )  # fmt: skip


@triton.jit
def _bias_rows(Pot, Sq, Logw, Out, i_b, i_m, n_rows, s_vb, s_out, eps, shift2,
               BLOCK: tl.constexpr, COST: tl.constexpr):  # fmt: skip
    # Rows past n_rows up to the row stride s_out get -inf (col_bias's masked value): the
    # padding of V that the sweep reads unmasked.
    o_m = i_m * BLOCK + tl.arange(0, BLOCK)
    m_m = o_m < n_rows
    i_b64 = i_b.to(tl.int64)
    b_h, _ = col_bias(Pot, Sq, Logw, i_b64 * s_vb + o_m, m_m, 1.4426950408889634 / eps, COST)
    tl.store(Out + i_b64 * s_out + o_m, b_h - shift2, mask=o_m < s_out)


@triton.jit(do_not_specialize=_DYNAMIC)
def _plan_bias_kernel(
    Xsq, Ysq, Xlogw, Ylogw, F, G, U, V, Shift, n_x, n_y, n_cb_x, s_fb, s_gb, s_v, has_shift,
    eps, BLOCK: tl.constexpr, COST: tl.constexpr,
):  # fmt: skip
    # u_i and v_j of the plan's exponent, (B, n) and (B, s_v ≥ m): each is the column bias of the
    # soft-min sweep over that side (tiles.col_bias). The plan's shift sigma (one per problem)
    # goes into u only.
    i_m = tl.program_id(0)
    i_b = tl.program_id(1)
    if i_m < n_cb_x:
        shift2 = 0.0
        if has_shift != 0:
            shift2 = tl.load(Shift + i_b) * (1.4426950408889634 / eps)
        _bias_rows(F, Xsq, Xlogw, U, i_b, i_m, n_x, s_fb, n_x, eps, shift2, BLOCK, COST)
    else:
        _bias_rows(G, Ysq, Ylogw, V, i_b, i_m - n_cb_x, n_y, s_gb, s_v, eps, 0.0, BLOCK, COST)


def eligible(X: Side, Y: Side) -> bool:
    """True when the plan step can serve this problem: no label term (its table would have to
    be the same seen from both sides) and no zero-weight points (their plan rows are zero)."""
    return X.labels is None and not (X.has_null or Y.has_null)


def preferred(X: Side) -> bool:
    """True when the plan step is expected to be faster than the two-sweep step.

    At d <= 32 the x·yᵀ tile is cheap and the per-tile column reduction dominates: the batched
    training shape (64 problems of 1024², d = 3) took 1.3 ms per 10 plan steps against 0.79 ms
    for the two sweeps on the H200 (docs/performance.md). The interpreter always
    takes it, so that CI covers it at small sizes.
    """
    return X.x.shape[-1] > 32 or interpreting()


#: Phases of the loop in which the plan step is taken (Backend.symmetric_step's ``phase``).
PHASES = ("zero", "second", "iterate")


def phase_shift(X: Side, Y: Side, f, g, eps: float, phase: str) -> torch.Tensor | None:
    """The plan's shift sigma per problem, (B,), or None for none (docs/kernels.md, "Plan step").

    Shifting the plan's exponent by a constant sigma leaves both soft-mins exact and multiplies
    its sums by exp(-sigma / eps). The sums are trusted in ln-range [-44.4, 88.6]; a row sum
    is ln a_i + (f_i − sigma − T(g)_i) / eps, so sigma is an estimate of f_i − T(g)_i moved by
    a few eps to place the sums inside that range (N = max(n, m), ln a_i ≈ −ln N):

    * "zero" (f = g = 0): T(0)_i lies below the mean cost Ĉ = Σ a_i b_j C_ij / (Σa Σb) (Jensen)
      and far below it for points near the other cloud, so the sums spread upwards from
      ln a_i + (Ĉ − T(0)_i) / eps. sigma = −Ĉ + (34 − ln N) eps puts the rows at Ĉ near
      e^-34 and leaves 122 e-folds above them. Ĉ is a closed form in the weighted means of
      the points and of their squared norms (euclidean cost: its square root, an upper bound
      of the mean distance).
    * "second" (the first averaged step after a plain update from zero): both potentials carry
      the constant part of the solution once too often, and T(g + c) = T(g) − c, so
      f − T(g) ≈ half the sum of their weighted means m̄; minus (22 + ln N) eps to centre the
      sums in the range. With damping λ (unbalanced sides) the plain update was λ T(0), and
      f − T(g) ≈ (2λ − 1) T̄(0) = (2 − 1/λ) m̄.
    * "iterate": none (the sums are close to the weights).

    A wrong estimate only costs speed: sums outside the range send the step to the fallback.
    """
    if phase == "iterate":
        return None
    ln_n = math.log(max(X.n, Y.n))
    # One launch each (sums.py), not a dozen torch reductions.
    if phase == "second":
        lam = 0.5 * (X.damping(eps) + Y.damping(eps))
        return sums.second_shift(X, Y, f, g, 1.0 - 0.5 / lam, -(22.0 + ln_n) * eps)
    # The weighted means come from prepare's statistics: no pass over the points and no
    # n × d temporary (which set the peak memory of a fwd+bwd call, docs/performance.md). They are those of the points before the float16 rounding; the difference
    # moves the estimate by far less than eps.
    return sums.zero_shift(X, Y, (34.0 - ln_n) * eps)


def symmetric_step(X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, phase="iterate"):
    """Both half-steps of a symmetric iteration from one plan sweep, redone by the guarded
    online-LSE step when the plan's sums leave the trusted range. Same contract as
    :func:`softmin.symmetric_step`; ``phase`` (one of :data:`PHASES`) sets the plan's shift
    (:func:`phase_shift`). The first call of a kind compiles its five kernels in parallel."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    args = (X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, phase)
    # A kernel outside this key (the grouped sweep past 4 row blocks per SM) compiles on its
    # first launch.
    key = ("plan", X.x.device, X.x.shape[-1], X.x.dtype, precision, X.cost, want_raw)
    precompile_once(key, _symmetric_step, *args)
    return _symmetric_step(*args)


def _symmetric_step(X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, phase):
    B, n, _ = X.x.shape
    m = Y.x.shape[1]
    sw = sweep(X, Y, f, g, eps, precision, phase_shift(X, Y, f, g, eps, phase), cols=True)
    out = softmin.step_outputs(f, g, want_raw)
    f_new, g_new, f_raw, g_raw = out
    ncx = cdiv(n, FINISH_BLOCK)
    launch(_plan_finish_kernel, (ncx + cdiv(m, FINISH_BLOCK), B),
        sw.prow, sw.pcol, X.sq, Y.sq, sw.u, sw.v, f, g, f_new, g_new, f_raw, g_raw, sw.flag,
        sw.shift, n, m, ncx, sw.split, sw.groups, f.stride(0), g.stride(0), f.numel(),
        sw.groups * m, sw.v.stride(0), int(sw.has_shift), float(eps), float(alpha), float(beta_x), float(beta_y),
        BLOCK=FINISH_BLOCK, PARTS=FINISH_PARTS, WRITE_RAW=want_raw, COST=cost_id(X.cost),
        **FP_FUSION,
    )  # fmt: skip
    # Runs (and overwrites the outputs) only where the flag was raised.
    return softmin.symmetric_step(
        X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, out=out, guard=sw.flag
    )


@dataclass(frozen=True)
class Sweep:
    """The partial sums of one plan sweep (:func:`sweep`) and what its finishing kernel reads.

    Attributes:
        prow: (split, B, n) row sums of the plan over each column chunk.
        pcol: (B, groups, m) column sums over each group of row blocks (None without ``cols``).
        u, v: (B, n), (B, ≥ m) base-2 biases of the plan's exponent (the shift is in u; v's
            rows padded with -inf to a multiple of :data:`V_PAD`).
        flag: (1,) device flag, reset by the sweep.
        shift: the (B,) shift, or ``flag`` as a placeholder when ``has_shift`` is False.
    """

    prow: torch.Tensor
    pcol: torch.Tensor | None
    u: torch.Tensor
    v: torch.Tensor
    flag: torch.Tensor
    shift: torch.Tensor
    has_shift: bool
    split: int
    groups: int


def sweep(X, Y, f, g, eps, precision, shift, cols: bool) -> Sweep:
    """The bias and sweep launches of the plan of (f, g) over X × Y, shifted by ``shift``
    ((B,) or None): row sums per column chunk and, with ``cols``, column sums per group of
    row blocks (``COLS``), neither finished nor range-checked."""
    B, n, d = X.x.shape
    m = Y.x.shape[1]
    xx, xy, dot_scale, prec = operands(X, Y, precision)
    half = is_half(xx, prec)
    cfg = plan_config(d, half) if cols else half_config(d, half)
    cost = cost_id(X.cost)
    hopper = not cols and _hopper_sweep(X, d, half, cost, xx, xy)
    if hopper:
        cfg = hopper_half_config(d)
    assert V_PAD % cfg.block_n == 0, "the padding of v must cover every column tile"
    nbx = cdiv(n, cfg.block_m)
    if cols:
        # Row-block groups: at most GROUPS_PER_SM per SM per problem (each group owns one row
        # of column partials), the columns split as for the soft-min so that the grid fills
        # the GPU.
        groups = min(nbx, GROUPS_PER_SM * sm_count(X.x.device))
        split = split_for(groups * B, m, cfg, X.x.device)
        cps = chunk(m, split, cfg.block_n)
        split = cdiv(m, cps)
    else:
        groups = nbx
    flag = torch.empty(1, dtype=torch.float32, device=f.device)
    u = torch.empty((B, n), dtype=torch.float32, device=f.device)
    # Padded with -inf to a multiple of V_PAD (>= every BLOCK_N): the sweep reads it unmasked.
    v = torch.empty((B, cdiv(m, V_PAD) * V_PAD), dtype=torch.float32, device=f.device)
    kw = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, D_TILES=cfg.d_tiles,
        PRECISION=prec, COST=cost, EVEN_D=even_d(cfg, d, xx, xy),
        GROUPED=groups < nbx, COLS=cols,
        **cfg.launch_options(), **FP_FUSION,
    )  # fmt: skip

    def args(prow, pcol, cps):
        return (
            xx, xy, X.sq, Y.sq, u, v, prow, pcol, flag,
            n, m, d, cps, nbx, groups,
            xx.stride(0), xx.stride(1), xy.stride(0), xy.stride(1), f.stride(0), g.stride(0),
            B * n, groups * m if cols else 0, v.stride(0), float(eps), float(dot_scale),
            float(X.sq_floor),
        )  # fmt: skip

    if not cols:
        # Whole waves of the sweep's resident blocks (50k, d = 64, 196 row blocks, 2 per SM:
        # 4 chunks, 2.97 waves, where about four programs per SM gave 3 chunks in 2.23 waves).
        per_sm = None
        if X.x.is_cuda and not hopper:
            key = ("plan_half", tuple(kw.items()), xx.dtype, xy.dtype)
            per_sm = resident_blocks(key, _plan_fwd_kernel, (groups, B, 1), *args(u, u, m), **kw)
        split, cps = plan_split(nbx * B, m, cfg.block_n, X.x.device, per_sm)
    prow = torch.empty((split, B, n), dtype=torch.float32, device=f.device)
    pcol = torch.empty((B, groups, m), dtype=torch.float32, device=f.device) if cols else None
    ncx = cdiv(n, FINISH_BLOCK)
    has_shift = shift is not None
    shift = shift.contiguous() if has_shift else flag
    launch(_plan_bias_kernel, (ncx + cdiv(v.shape[1], FINISH_BLOCK), B),
        X.sq, Y.sq, X.logw, Y.logw, f, g, u, v, shift, n, m, ncx, f.stride(0), g.stride(0),
        v.stride(0), int(has_shift), float(eps),
        BLOCK=FINISH_BLOCK, COST=cost, **FP_FUSION,
    )  # fmt: skip
    if hopper:
        half_hopper.launch_sweep((nbx, B, split), xx, xy, u, v, prow, flag, n, m, cps, eps,
                                 dot_scale, cfg, launch, FP_FUSION)  # fmt: skip
        return Sweep(prow, pcol, u, v, flag, shift, has_shift, split, groups)
    launch(_plan_fwd_kernel, (groups, B, split), *args(prow, prow if pcol is None else pcol, cps),
           **kw)  # fmt: skip
    return Sweep(prow, pcol, u, v, flag, shift, has_shift, split, groups)


def _hopper_sweep(X: Side, d: int, half: bool, cost: int, xx, xy) -> bool:
    """Whether the half-step sweep runs as the Gluon Hopper kernel (half_hopper.py): switched on
    (``TUNING.hopper_half``), a Hopper GPU, and operands it handles."""
    if not TUNING.hopper_half or not half_hopper.available(X.x.device):
        return False
    hcfg = hopper_half_config(d)
    sq = cost == SQEUCLIDEAN_ID
    return half and half_hopper.supports(d, xx.dtype, sq, even_d(hcfg, d, xx, xy))


#: Scores per half-step (B·n·m) from which the plan half-step is taken. Its sweep is faster
#: than the online-LSE one (H100, d = 64, 50k²: 1.26 against 2.35 ms), but it launches four
#: kernels where the online sweep launches one: about 0.3 ms more host work per half-step
#: when the loop runs eagerly, which a 10k² sweep (about 0.1 ms) does not repay.
HALF_MIN_SCORES = 1e9


def half_eligible(rows: Side, cols: Side, eps: float) -> bool:
    """True when an alternating half-step may be read off the row sums of the plan of
    (old, col_pot) and is expected to pay: the plan step's conditions (:func:`eligible`, eps
    below the large-eps expansion) and at least :data:`HALF_MIN_SCORES` scores (the
    interpreter always takes it, so that CI covers it at small sizes). Unlike the symmetric
    plan step it has no column reduction, so it is taken at every d."""
    big = rows.x.shape[0] * rows.n * cols.n >= HALF_MIN_SCORES or interpreting()
    return big and eps < rows.large_eps and eligible(rows, cols)


def half_step(rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
    """One half-step ``alpha · old + beta · T(col_pot)`` from the row sums of the plan of
    (old, col_pot), redone by the guarded online-LSE sweep when a sum leaves the trusted range.

    Same contract as :func:`softmin.softmin`. The row sums of that plan are
    r_i = w_i exp((old_i − T_i) / eps): the old potential is the shift of each row, so the
    sweep needs no running max (one exp2 and one add per score, where the online LSE adds a
    max, a rescale and their row reductions). Within a few iterations of the loop the sums
    sit near the weights; far from an iterate they leave [2^-64, 3e38] and the fallback runs
    (no host synchronisation either way).
    """
    args = (rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision)
    key = ("plan_half", rows.x.device, rows.x.shape[-1], rows.x.dtype, precision, rows.cost,
           want_raw)  # fmt: skip
    precompile_once(key, _half_step, *args)
    return _half_step(*args)


def _half_step(rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
    B, n, _ = rows.x.shape
    m = cols.x.shape[1]
    sw = sweep(rows, cols, old, col_pot, eps, precision, None, cols=False)
    prow, u, v, flag, split = sw.prow, sw.u, sw.v, sw.flag, sw.split
    out = torch.empty_like(old)
    raw = torch.empty_like(old) if want_raw else out
    cost = cost_id(rows.cost)
    ncx = cdiv(n, FINISH_BLOCK)
    # The row side of the finishing kernel only (its grid stops before the column blocks).
    launch(_plan_finish_kernel, (ncx, B),
        prow, prow, rows.sq, cols.sq, u, v, old, col_pot, out, out, raw, raw, flag, flag,
        n, m, ncx, split, 1, old.stride(0), col_pot.stride(0), old.numel(), m, v.stride(0), 0,
        float(eps), float(alpha), float(beta), float(beta),
        BLOCK=FINISH_BLOCK, PARTS=FINISH_PARTS, WRITE_RAW=want_raw, COST=cost, **FP_FUSION,
    )  # fmt: skip
    # Runs (and overwrites the outputs) only where the flag was raised: the x side of the
    # online-LSE step is exactly this half-step.
    softmin.symmetric_step(
        rows, cols, old, col_pot, eps, alpha, beta, beta, want_raw, precision,
        out=(out, out, raw, raw), guard=flag, x_only=True,
    )  # fmt: skip
    return out, (raw if want_raw else None)
