"""Counter-based Gumbel noise for sampling from a plan, identical in PyTorch and in Triton.

Drawing j given i from P_ij ∝ w_j exp((p_j − C_ij) / eps) by the Gumbel-max trick needs one
independent Gumbel variable per (draw, column). Stored, that is a k × m tensor; instead each
variable is a function of (seed, draw, column) computed where it is used: the integer hash
below runs in the torch reference (int64 arithmetic kept to 32 bits) and in the Triton kernel
(uint32 arithmetic, backends/triton/sample.py), bit for bit the same, so that one seed gives
the same pairs on every backend up to the rounding of the scores.

For a draw r of problem b (draw counter t = b·k + r, modulo 2^32), seed words (s0, s1) and
column j:

    h_t  = mix(mix(t) xor s0)
    v_tj = mix(((h_t + j · 0x9E3779B9) mod 2^32) xor s1)
    u_tj = (2 ⌊v_tj / 2^9⌋ + 1) · 2^-24        in (0, 1), exact in float32
    G_tj = −log2(−log2 u_tj)                    a standard Gumbel variable / ln 2, minus log2 ln 2

``mix`` is a 32-bit integer finaliser (xor-shift, multiply, twice). Base 2 suits the kernels,
which form base-2 scores; the constant −log2(ln 2) does not move the argmax.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
#: The multipliers of the 32-bit finaliser and the column stride (odd constants).
MIX1 = 0x7FEB352D
MIX2 = 0x846CA68B
GOLDEN = 0x9E3779B9
#: 2^-24: the spacing of the uniforms.
UNIT = 5.960464477539063e-08


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2^32 for int64 x in [0, 2^32): two 16-bit halves of c keep every product
    below 2^49, so nothing overflows int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finaliser on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX2)
    return x ^ (x >> 16)


def draw_keys(seed: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """h_t of the draw counters ``draws`` (int64, any shape) for seed words ``seed`` (2,)."""
    s0 = seed[0] & MASK32
    return mix32(mix32(draws & MASK32) ^ s0)


def gumbel2(seed: torch.Tensor, keys: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Base-2 Gumbel noise G (float32) for draw keys ``keys`` (..., r, 1) and column indices
    ``cols`` (m,): shape (..., r, m)."""
    s1 = seed[1] & MASK32
    v = mix32(((keys + _mul32(cols, GOLDEN)) & MASK32) ^ s1)
    u = ((v >> 9) * 2 + 1).to(torch.float32) * UNIT
    return -torch.log2(-torch.log2(u))


def seed_words(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """(2,) int64 seed words in [0, 2^31) drawn on ``device`` (no host synchronisation), from
    ``generator`` or, when None, from torch's default generator of that device."""
    return torch.randint(0, 2**31 - 1, (2,), generator=generator, device=device)
