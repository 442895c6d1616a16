"""Block-sparse online-LSE kernel of the multiscale path (flashsinkhorn/multiscale/).

One program owns one row tile of TILE sorted points and visits only the column tiles of its
CSR list: for each it forms the squared distances from coordinate differences (d <= 3: three
FMAs per score, no tensor-core product to pad), the base-2 scores h_j − ‖x_i − y_j‖²·log2e/eps
and a running (max, sum); with BARY it also accumulates the softmax-weighted column points
(the barycentres of the plan's rows, for gradients). Memory traffic is O(visited tiles · TILE)
per row tile; nothing of size n × m exists. The torch oracle is
``flashsinkhorn.multiscale.sparse_torch.sparse_lse``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, launch

LOG2E = 1.4426950408889634


# fmt: off
@triton.jit
def _lse_sparse_fwd_kernel(
    XR, XC, HC, ROWPTR, COLS, LSE, BARY,
    scale,
    TILE: tl.constexpr, BARY_OUT: tl.constexpr,
):
    # XR: (R·TILE, 3) row points; XC: (Cn·TILE, 3) column points; HC: (Cn·TILE,) column
    # bias in base 2 (−inf: no mass); ROWPTR: (R + 1,) int32; COLS: (P,) int32 column tiles;
    # LSE: (R·TILE,) natural log-sum-exp; BARY: (R·TILE, 3) softmax-weighted column points.
    # scale = log2(e) / eps.
    rt = tl.program_id(0)
    offs = tl.arange(0, TILE)
    rows = rt.to(tl.int64) * TILE + offs
    x0 = tl.load(XR + rows * 3)
    x1 = tl.load(XR + rows * 3 + 1)
    x2 = tl.load(XR + rows * 3 + 2)
    m_i = tl.full([TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE], tl.float32)
    a0 = tl.zeros([TILE], tl.float32)
    a1 = tl.zeros([TILE], tl.float32)
    a2 = tl.zeros([TILE], tl.float32)
    start = tl.load(ROWPTR + rt)
    end = tl.load(ROWPTR + rt + 1)
    for k in range(start, end):
        ct = tl.load(COLS + k).to(tl.int64)
        cols = ct * TILE + offs
        c0 = tl.load(XC + cols * 3)
        c1 = tl.load(XC + cols * 3 + 1)
        c2 = tl.load(XC + cols * 3 + 2)
        h = tl.load(HC + cols)
        d0 = x0[:, None] - c0[None, :]
        d1 = x1[:, None] - c1[None, :]
        d2 = x2[:, None] - c2[None, :]
        z = h[None, :] - (d0 * d0 + d1 * d1 + d2 * d2) * scale  # (TILE, TILE), base 2
        m_new = tl.maximum(m_i, tl.max(z, 1))
        # a row whose scores are all −inf so far keeps a zero sum (no NaN from −inf − −inf)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(z - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if BARY_OUT:
            a0 = a0 * alpha + tl.sum(p * c0[None, :], 1)
            a1 = a1 * alpha + tl.sum(p * c1[None, :], 1)
            a2 = a2 * alpha + tl.sum(p * c2[None, :], 1)
        m_i = m_new
    live = l_i > 0.0
    lse = tl.where(live, (m_i + tl.log2(tl.where(live, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(LSE + rows, lse)
    if BARY_OUT:
        inv = 1.0 / tl.where(live, l_i, 1.0)
        tl.store(BARY + rows * 3, a0 * inv)
        tl.store(BARY + rows * 3 + 1, a1 * inv)
        tl.store(BARY + rows * 3 + 2, a2 * inv)
# fmt: on


def sparse_lse(
    xr: torch.Tensor,
    xc: torch.Tensor,
    hc: torch.Tensor,
    rowptr: torch.Tensor,
    cols: torch.Tensor,
    eps: float,
    bary: bool = False,
    tile: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launches :func:`_lse_sparse_fwd_kernel` (float32).

    Args:
        xr: (R·tile, 3) float32 row points.
        xc: (Cn·tile, 3) float32 column points.
        hc: (Cn·tile,) float32 column bias (potential / eps + log-weight, natural log).
        rowptr: (R + 1,) int32 CSR offsets.
        cols: (P,) int32 visited column tiles.
        eps: entropic regularisation.
        bary: also return the softmax-weighted column points.
        tile: points per tile (a power of two).

    Returns:
        ``(L (R·tile,), barycentres (R·tile, 3) or None)`` as ``sparse_torch.sparse_lse``
        with the column points as values.
    """
    R = xr.shape[0] // tile
    lse = torch.empty(xr.shape[0], dtype=torch.float32, device=xr.device)
    out = torch.empty_like(xr) if bary else lse
    h2 = (hc * LOG2E).contiguous()
    if R > 0:
        launch(_lse_sparse_fwd_kernel, (R,),
               xr, xc, h2, rowptr, cols, lse, out, LOG2E / eps,
               TILE=tile, BARY_OUT=bary, num_warps=4, **FP_FUSION)  # fmt: skip
    return lse, (out if bary else None)
