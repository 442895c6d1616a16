"""Plan sums of one block of a sharded problem, and half-steps finished from summed plan sums.

A rank of a sharded problem holds a block of the plan: its rows against some columns. The
plan sweep of the symmetric step (plan.py) over that block gives the row sums of its rows
(complete when the block holds every column) and the column sums over its rows (partial: the
ranks' partials add up to the plan's column sums, one all-reduce). :func:`block_sums` runs the
sweep and returns both, unfinished; :func:`sums_step` finishes a half-step from sums that
may have been added up elsewhere:

    T_i = old_i − sigma − eps ln(s_i / w_i),   out = alpha · old + beta · T,

with sigma the plan's shift (docs/kernels.md, "Plan step"). The sums are trusted in
[2^-64, 3e38] as in the plan step; outside, a device flag is raised and, given the columns,
the guarded online-LSE launch redoes the half-step (no host synchronisation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv, launch
from ..kernel_costs import cost_id
from . import plan, softmin
from .configs import FINISH_BLOCK
from .tiles import col_bias, softmin_epilogue


@triton.jit(do_not_specialize=["n", "s_b", "has_shift"])
def _sums_step_kernel(
    Sums, Sq, Logw, Old, Out, Raw, Flag, Shift, n, s_b, has_shift, eps, alpha, beta,
    BLOCK: tl.constexpr, WRITE_RAW: tl.constexpr, COST: tl.constexpr,
):  # fmt: skip
    i_m = tl.program_id(0)
    i_b64 = tl.program_id(1).to(tl.int64)
    o_m = i_m * BLOCK + tl.arange(0, BLOCK)
    m_m = o_m < n
    o_v = i_b64 * s_b + o_m
    b_sum = tl.load(Sums + i_b64 * n + o_m, mask=m_m, other=1.0)
    # the rows' own bias in the plan's exponent (without the shift): u_i of plan.py
    b_h, _ = col_bias(Old, Sq, Logw, o_v, m_m, 1.4426950408889634 / eps, COST)
    shift2 = 0.0
    if has_shift != 0:
        shift2 = tl.load(Shift + i_b64) * (1.4426950408889634 / eps)
    b_ok = (b_sum >= 5.421010862427522e-20) & (b_sum <= 3.0e38)  # 2^-64; NaN fails both
    b_bad = tl.max((m_m & (b_ok == 0)).to(tl.int32), 0)
    if b_bad > 0:  # a branch, not a scalar mask (plan.py's finishing kernel)
        tl.store(Flag, 1.0)
    softmin_epilogue(
        shift2 - b_h, b_sum, Sq, Old, Out, Raw, o_v, m_m, eps, alpha, beta, WRITE_RAW, COST
    )


def block_sums(X, Y, f, g, eps, precision, shift, cols: bool):
    """``(rows (B, n), cols (B, m) or None)``: the sums of the plan of (f, g) over X × Y,
    shifted by ``shift`` ((B,) or None), float32, not range-checked."""
    sw = plan.sweep(X, Y, f.contiguous(), g.contiguous(), eps, precision, shift, cols)
    rows = sw.prow[0] if sw.split == 1 else sw.prow.sum(0)
    if not cols:
        return rows, None
    return rows, sw.pcol[:, 0] if sw.groups == 1 else sw.pcol.sum(1)


def sums_step(rows, sums, old, eps, alpha, beta, want_raw, shift, redo):
    """``(out, raw or None, flag)``: the half-step of ``rows`` from the plan sums ``sums``
    ((B, n), the plan of (old, some column potential) shifted by ``shift``), and the (1,)
    float32 flag raised where a sum left the trusted range. ``redo``: ``(cols, col_pot,
    precision)`` of the whole column side, whose guarded online-LSE half-step then overwrites
    the outputs; None leaves them wrong there (the caller redoes the step)."""
    B, n = old.shape
    old = old.contiguous()
    sq, logw = rows.sq.contiguous(), rows.logw.contiguous()
    out = torch.empty_like(old)
    raw = torch.empty_like(old) if want_raw else out
    flag = torch.zeros(1, dtype=torch.float32, device=old.device)
    has_shift = shift is not None
    launch(_sums_step_kernel, (cdiv(n, FINISH_BLOCK), B),
        sums.contiguous(), sq, logw, old, out, raw, flag,
        shift.contiguous() if has_shift else flag, n, old.stride(0), int(has_shift),
        float(eps), float(alpha), float(beta),
        BLOCK=FINISH_BLOCK, WRITE_RAW=want_raw, COST=cost_id(rows.cost), **FP_FUSION,
    )  # fmt: skip
    if redo is not None:
        cols, col_pot, precision = redo
        softmin.symmetric_step(
            rows, cols, old, col_pot.contiguous(), eps, alpha, beta, beta, want_raw, precision,
            out=(out, out, raw, raw), guard=flag, x_only=True,
        )  # fmt: skip
    return out, (raw if want_raw else None), flag
