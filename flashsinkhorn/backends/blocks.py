"""Row blocks and matmul precision of the PyTorch computations, shared by the torch
backend, the cost-matrix backend and the dense path's torch parts (imports only torch)."""

from __future__ import annotations

import contextlib

import torch

# Score elements materialised at once (B · rows · m); 2^24 fp32 is 64 MiB.
CHUNK_ELEMENTS = 1 << 24


@contextlib.contextmanager
def matmul_precision(precision: str, device: torch.device):
    """Sets cuBLAS TF32 for the block and restores the caller's setting afterwards.

    torch ≥ 2.9 has two APIs for the flag (``allow_tf32`` and ``fp32_precision``) and raises
    on a legacy read once the caller has used the new one. The block goes through the new API
    where it exists: a legacy read afterwards still works for a caller who only used the
    legacy one, and a flag that inherited the global ``torch.backends.fp32_precision`` goes
    back to inheriting it.
    """
    if device.type != "cuda":
        yield
        return
    flags = torch.backends.cuda.matmul
    if not hasattr(flags, "fp32_precision"):  # torch < 2.9: the legacy flag only
        saved = flags.allow_tf32
        flags.allow_tf32 = precision == "tf32"
        try:
            yield
        finally:
            flags.allow_tf32 = saved
        return
    saved = flags.fp32_precision
    # The getter resolves "none" (inherit) to the global value; equal to it means inherited,
    # or set to the same value, which restoring "none" keeps.
    if saved == getattr(torch.backends, "fp32_precision", None):
        saved = "none"
    flags.fp32_precision = "tf32" if precision == "tf32" else "ieee"
    try:
        yield
    finally:
        flags.fp32_precision = saved


def row_chunks(B: int, n: int, m: int, budget: int = CHUNK_ELEMENTS):
    """Yields row slices so that each (B, rows, m) score block stays within ``budget``."""
    rows = max(1, budget // max(1, B * m))
    for s in range(0, n, rows):
        yield slice(s, min(n, s + rows))
