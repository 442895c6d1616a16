"""Plain PyTorch backend: dense for small problems, row-chunked with bounded memory otherwise.

It is the CPU default, the float64 path and the oracle the Triton kernels are tested against.
"""

from __future__ import annotations

import contextlib

import torch

from ..problem import Side
from .base import Backend

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


def scores(rows_x: torch.Tensor, cols: Side, col_pot: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, r, m) log-domain scores (2 x·y + p_j − ‖y_j‖²)/eps + log w_j of a row block."""
    h = (col_pot - cols.sq) / eps + cols.logw
    xr = rows_x.to(h.dtype)
    yc = cols.x.to(h.dtype)
    return torch.baddbmm(h.unsqueeze(1), xr, yc.transpose(1, 2), alpha=2.0 / eps)


def label_block(rows: Side, sl: slice, cols: Side) -> torch.Tensor:
    """(B, r, m) label term label_weight · W[l_i, l_j] of a row block (rows' orientation)."""
    li = rows.labels[:, sl].long()
    lj = cols.labels.long()
    return rows.lcost[li[:, :, None], lj[:, None, :]]


def distance_block(rows_x: torch.Tensor, rsq: torch.Tensor, cols: Side, dtype) -> torch.Tensor:
    """(B, r, m) sqrt(max(‖r_i‖² + ‖c_j‖² − 2 r_i·c_j, sq_floor)): the euclidean kernel cost,
    from the same expansion the kernels use (clamped: rounding may make it slightly < 0)."""
    xr = rows_x.to(dtype)
    yc = cols.x.to(dtype)
    d2 = torch.baddbmm(rsq[:, :, None] + cols.sq[:, None, :], xr, yc.transpose(1, 2), alpha=-2.0)
    return d2.clamp_min(cols.sq_floor).sqrt()


def block_scores(rows: Side, sl: slice, cols: Side, col_pot: torch.Tensor, eps: float):
    """Scores of a row block for any kernel cost.

    Returns ``(z, offset, dist)``: z (B, r, m) log-domain scores such that the soft-min is
    ``T_i = offset_i − eps · LSE_j z_ij`` and the plan ``P_ij = exp(h_i + z_ij)`` with
    ``h_i = (p_i − offset_i)/eps + log w_i``; ``offset`` is ‖r_i‖² for the squared Euclidean
    cost (the shifted form) and 0 for the euclidean cost; ``dist`` is the (B, r, m) distance
    block for the euclidean cost (None otherwise).
    """
    dtype = col_pot.dtype
    dist = None
    if rows.cost == "euclidean":
        dist = distance_block(rows.x[:, sl], rows.sq[:, sl], cols, dtype)
        z = (col_pot[:, None, :] - dist) / eps + cols.logw[:, None, :]
        offset = torch.zeros_like(rows.sq[:, sl])
    else:
        z = scores(rows.x[:, sl], cols, col_pot, eps)
        offset = rows.sq[:, sl]
    if rows.labels is not None:
        z = z - label_block(rows, sl, cols) / eps
    return z, offset, dist


def cost_block(rows: Side, sl: slice, cols: Side, dtype) -> torch.Tensor:
    """(B, r, m) full cost C_ij of a row block (kernel cost plus label term)."""
    if rows.cost == "euclidean":
        C = distance_block(rows.x[:, sl], rows.sq[:, sl], cols, dtype)
    else:
        xr, yc = rows.x[:, sl].to(dtype), cols.x.to(dtype)
        C = torch.baddbmm(
            rows.sq[:, sl, None] + cols.sq[:, None, :], xr, yc.transpose(1, 2), alpha=-2.0
        )
    if rows.labels is not None:
        C = C + label_block(rows, sl, cols)
    return C


class TorchBackend(Backend):
    """Reference backend built from batched matmuls and ``torch.logsumexp``."""

    name = "torch"
    path = "dense"  # row blocks of the score matrix are materialised

    def __init__(self, chunk_elements: int = CHUNK_ELEMENTS):
        self.chunk_elements = chunk_elements

    def softmin(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
        B, n, _ = rows.x.shape
        m = cols.x.shape[1]
        T = torch.empty_like(rows.sq)
        with matmul_precision(precision, rows.x.device):
            for sl in row_chunks(B, n, m, self.chunk_elements):
                if rows.cost == "sqeuclidean" and rows.labels is None:
                    lse = torch.logsumexp(scores(rows.x[:, sl], cols, col_pot, eps), dim=2)
                    T[:, sl] = rows.sq[:, sl] - eps * lse
                    continue
                z, offset, _ = block_scores(rows, sl, cols, col_pot, eps)
                T[:, sl] = offset - eps * torch.logsumexp(z, dim=2)
        out = beta * T if alpha == 0.0 else alpha * old + beta * T
        return out, (T if want_raw else None)

    def transport(self, rows, cols, row_pot, col_pot, eps, V, A, Bw, precision):
        from .torch_transport import transport

        return transport(
            rows, cols, row_pot, col_pot, eps, V, A, Bw, precision, self.chunk_elements
        )

    def transport_grad(self, rows, cols, row_pot, col_pot, eps, precision):
        from .torch_transport import transport_grad

        return transport_grad(rows, cols, row_pot, col_pot, eps, precision, self.chunk_elements)
