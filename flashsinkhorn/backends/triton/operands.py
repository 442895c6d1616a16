"""Kernel operands of a pair of sides: score operands, cost arguments and the staged label table.

:func:`operands` picks the tensors the score dot reads (float16 grid copies, float16 hi/lo
parts or the points themselves) and the dot's precision flag; :func:`cost_args` turns a side's
cost description into the kernels' ``COST``/``LABELS`` constexprs and pointers, staging small
label tables on chip as float16 parts (cached per table).
"""

from __future__ import annotations

import math
import threading

import torch

from ..._triton_launch import next_pow2
from ...problem import Side
from ...tuning import TUNING
from ..kernel_costs import cost_id
from .configs import ONCHIP_MAX_V, interpreting


def interpreter_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or an exact float32 copy of bfloat16 points under the interpreter.

    The interpreter stores bfloat16 tiles as raw uint16 bit patterns and its ``tl.dot`` feeds
    them to ``np.matmul`` as integers (Triton 3.9: values ~1e9 off, then NaN potentials). The
    upcast is exact and only happens there; compiled kernels read bfloat16 directly.
    """
    if t.dtype == torch.bfloat16 and interpreting():
        return t.float()
    return t


def operands(rows: Side, cols: Side, precision: str):
    """Dot-product operands, the scale² that restores their product, and the dot precision.

    With precision "tf32" the sides carry float16 copies of the points on the same 11-bit grid
    (``problem.round_to_half_grid``): products are exact either way, and float16 halves the
    bytes and doubles the tensor-core rate. With "tf32x3" they carry float16 hi/lo parts
    (``problem.split_half``) and the kernels form hi·hi + hi·lo + lo·hi (flag "f16x3").
    """
    grid = rows.xk is not None and cols.xk is not None and not (rows.split or cols.split)
    if precision == "tf32" and grid:
        return rows.xk, cols.xk, rows.kscale * cols.kscale, "tf32"
    if precision == "tf32x3" and rows.split and cols.split:
        # float16 hi/lo parts: three exact float16 products per score (kernel flag "f16x3")
        # instead of Triton's TF32x3 on float32 operands, at twice the rate and with no
        # in-kernel splitting.
        return rows.xk, cols.xk, rows.kscale * cols.kscale, "f16x3"
    if rows.x.dtype != torch.float32:
        # float16/bfloat16 points: the dot is exact-product with fp32 accumulation whatever
        # the flag, which only selects how fp32 operands use the tensor cores.
        return interpreter_operand(rows.x), interpreter_operand(cols.x), 1.0, "tf32"
    return rows.x, cols.x, 1.0, precision


def even_d(cfg, d: int, *ops: torch.Tensor) -> bool:
    """The kernels' EVEN_D: one feature tile exactly d wide (no feature mask), and every
    operand's rows and batches start at multiples of 16 elements, which the kernels pass on to
    the compiler as an alignment hint (tiles.batch_base): their tile loads then vectorise."""
    return whole_tile(d, cfg.block_d, cfg.d_tiles, *ops)


def whole_tile(k: int, block: int, tiles: int, *ops: torch.Tensor) -> bool:
    """One tile of ``block`` columns exactly ``k`` wide, and every (B, rows, k) tensor of
    ``ops`` with rows and batches at multiples of 16 elements (:func:`even_d` for any width)."""
    if k != block or tiles != 1:
        return False
    return all(t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0 for t in ops)


def aligned_cols(*cols: tuple[int, torch.Tensor]) -> bool:
    """The soft-min kernels' ALIGNED_V: for each (number of columns, (B, m) column vector),
    the count and the vector's batch stride are multiples of 16 elements, so that the vector
    loads of a column tile vectorise (softmin._softmin_rows). The base pointers' alignment is
    Triton's own specialisation."""
    return all(m % 16 == 0 and (t.dim() < 2 or t.stride(0) % 16 == 0) for m, t in cols)


def is_half(operand: torch.Tensor, flag: str) -> bool:
    """One 16-bit score operand per point (not the split parts of "f16x3")."""
    return operand.dtype in (torch.float16, torch.bfloat16) and flag != "f16x3"


def half_parts(W: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(2, V, V) float16 parts with hi + lo = W / scale to 22 bits, and the power-of-two scale.

    The scale puts max |W| near 2^14, inside float16's range with room for the low part.
    """
    top = float(W.abs().max())
    scale = 2.0 ** (math.ceil(math.log2(top)) - 14) if top > 0 else 1.0
    w = (W.to(torch.float64) / scale).to(torch.float32)
    hi = w.to(torch.float16)
    lo = (w - hi.to(torch.float32)).to(torch.float16)
    return torch.stack([hi, lo]).contiguous(), scale


_PARTS_CACHE: dict = {}
_PARTS_LOCK = threading.Lock()


def staged_table(W: torch.Tensor) -> tuple[torch.Tensor, float]:
    """:func:`half_parts` of a label table, split once per table (keyed by its storage and
    version), not once per launch."""
    key = (W.data_ptr(), W.device, W.shape, W._version)
    with _PARTS_LOCK:
        hit = _PARTS_CACHE.get(key)
        if hit is None or hit[0] is not W:
            if len(_PARTS_CACHE) > 64:
                _PARTS_CACHE.clear()
            hit = (W, *half_parts(W))
            _PARTS_CACHE[key] = hit
    return hit[1], hit[2]


def onchip_labels(rows: Side) -> bool:
    """Whether the kernels stage the label table of ``rows`` on chip (:func:`staged_table`)."""
    return (
        rows.labels is not None and rows.lcost.shape[0] <= ONCHIP_MAX_V and not TUNING.global_labels
    )


def staged_tables(sides) -> tuple[torch.Tensor, ...]:
    """The staged label tables the launches on these row sides read: tensors of this
    module's cache, not fields of the problem, which a cached CUDA graph must be keyed by."""
    return tuple(staged_table(s.lcost)[0] for s in sides if onchip_labels(s))


def cost_args(rows: Side, cols: Side):
    """(COST, LABELS, row labels, column labels, table, V, table scale) for the kernels.

    COST is the kernel cost id of ``rows.cost`` (backends/kernel_costs.py). LABELS is 0 (no
    label term), 1 (W gathered from global memory, any V) or the padded V (16 or 32) when W is
    small enough to be staged on chip as two float16 parts (unless ``TUNING.global_labels``).
    Unused pointers are placeholders (constexpr branches never read them).
    """
    cost = cost_id(rows.cost)
    if rows.labels is None:
        return cost, 0, rows.sq, rows.sq, rows.sq, 1, 1.0
    V = rows.lcost.shape[0]
    if onchip_labels(rows):
        parts, scale = staged_table(rows.lcost)
        return cost, max(16, next_pow2(V)), rows.labels, cols.labels, parts, V, scale
    lcost = rows.lcost.to(torch.float32).contiguous()
    return cost, 1, rows.labels, cols.labels, lcost, V, 1.0
