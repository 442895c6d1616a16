"""Block-sparse log-sum-exp with torch operations: the oracle of the Triton kernel.

Rows and columns are sorted, padded point sets cut into tiles of ``TILE`` points; a CSR list
names, for every row tile, the column tiles it visits. For each row i

    L_i = log Σ_{visited j} exp(h_j − ‖x_i − y_j‖² / eps),

with h_j the column bias (potential / eps + log-weight, −inf on padding), and optionally the
softmax-weighted sums Σ_j softmax_ij V_j of column values (the barycentres of the plan's rows
when V are the column points). The tiles are local: relative to a point of the row tile, the
expansion ‖a‖² + ‖b‖² − 2 a·b cancels only the digits of the pair's own extent (the kernel
forms the differences directly).

Pairs are processed in chunks and merged into running (max, sum) per row, so memory is
O(rows + chunk · TILE²). Works on any device and in float32 or float64.
"""

from __future__ import annotations

import math

import torch

from ..backends.torch_ref import exp_floored_
from .clustering import TILE

#: Score elements formed at once (pairs · TILE · TILE).
SCORE_CHUNK = 1 << 23


def csr_pairs(rowptr: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) int64 pair lists of a CSR (rowptr (R + 1,), cols (P,))."""
    counts = (rowptr[1:] - rowptr[:-1]).long()
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=cols.device), counts)
    return rows, cols.long()


def sparse_lse(
    xr: torch.Tensor,
    xc: torch.Tensor,
    hc: torch.Tensor,
    rowptr: torch.Tensor,
    cols: torch.Tensor,
    eps: float,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block-sparse LSE over the visited tiles.

    Args:
        xr: (R·TILE, 3) row points, R row tiles (all problems of a batch concatenated).
        xc: (Cn·TILE, 3) column points.
        hc: (Cn·TILE,) column bias, −inf where a column carries no mass.
        rowptr: (R + 1,) CSR offsets into ``cols``.
        cols: (P,) column tile of each visited pair, grouped by row tile.
        eps: entropic regularisation (the distance is divided by it).
        values: (Cn·TILE, p) column values, or None.

    Returns:
        ``(L (R·TILE,), S (R·TILE, p) or None)``: L = −inf for a row that visits nothing
        (or only massless columns), S the softmax-weighted sums of ``values``.
    """
    dtype = xr.dtype
    nr = xr.shape[0]
    R = nr // TILE
    xr_t = xr.reshape(R, TILE, -1)
    xc_t = xc.reshape(-1, TILE, xc.shape[-1])
    hc_t = hc.reshape(-1, TILE)
    v_t = None if values is None else values.reshape(-1, TILE, values.shape[-1])
    run_max = torch.full((R, TILE), -math.inf, dtype=dtype, device=xr.device)
    run_sum = torch.zeros((R, TILE), dtype=dtype, device=xr.device)
    run_v = None if values is None else torch.zeros((R, TILE, values.shape[-1]), dtype=dtype,
                                                     device=xr.device)  # fmt: skip
    prow, pcol = csr_pairs(rowptr, cols)
    step = max(1, SCORE_CHUNK // (TILE * TILE))
    for s in range(0, prow.numel(), step):
        r, c = prow[s : s + step], pcol[s : s + step]
        # Coordinates relative to the row tile's first point: the expansion
        # ‖a‖² + ‖b‖² − 2 a·b then cancels only the digits of the pair's own extent.
        xa = xr_t[r]
        origin = xa[:, :1, :]
        xa = xa - origin
        xb = xc_t[c] - origin
        d2 = torch.baddbmm(
            (xa * xa).sum(-1)[:, :, None] + (xb * xb).sum(-1)[:, None, :],
            xa, xb.transpose(1, 2), alpha=-2.0,
        ).clamp_min_(0.0)  # fmt: skip
        z = hc_t[c][:, None, :] - d2 / eps  # (p, TILE, TILE)
        bmax = z.amax(-1)  # (p, TILE)
        new_max = run_max.clone().scatter_reduce_(0, r[:, None].expand_as(bmax), bmax, "amax")
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        # rescale the running sums to the new maxima, then add this chunk's terms
        scale = torch.exp(run_max - safe)
        run_sum.mul_(scale)
        e = exp_floored_(z.sub_(safe[r][:, :, None]))
        run_sum.index_add_(0, r, e.sum(-1))
        if run_v is not None:
            run_v.mul_(scale[..., None])
            run_v.index_add_(0, r, torch.bmm(e, v_t[c]))
        run_max = new_max
    lse = torch.where(run_sum > 0, run_max + torch.log(run_sum), -math.inf)
    out = None
    if run_v is not None:
        out = (run_v / torch.where(run_sum > 0, run_sum, 1.0)[..., None]).reshape(nr, -1)
    return lse.reshape(nr), out
