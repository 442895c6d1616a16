"""Spatial clustering of a point cloud on the device: Morton order, tiles and coarse cells.

Each cloud of the batch is sorted along a Morton (Z-order) curve of a grid over its bounding
box, so that points close in space are mostly close in the order. Two structures are read off
the sorted order:

- *tiles*: ``TILE`` consecutive points, the unit of the block-sparse soft-min (a tile of rows
  meets a tile of columns or skips it); a tile never spans one of the largest jumps of the
  curve (it is padded instead). The tiles are padded to whole groups of ``SUPER`` tiles (the
  coarse unit of the pair search, bounds.py); padding points repeat the tile's last real
  point and carry no mass (log-weight −inf).
- *cells*: the Morton cells of one grid level, the clusters of the coarse solve (their
  weighted centroids and total weights). The level is the finest whose number of non-empty
  cells stays within a budget.

Everything is torch operations on the points' device; the level choice reads one small
tensor back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Points per tile: the block size of the sparse soft-min kernels (rows and columns).
TILE = 64
#: Tiles per super tile: the first level of the tile-pair search (bounds.py).
SUPER = 16
#: Largest dimension of the multiscale path (Morton codes of d·BITS bits in an int64).
MAX_DIM = 3
#: Grid bits per coordinate of the Morton codes (a 2^20 grid per axis).
BITS = 20


@dataclass(frozen=True)
class Layout:
    """One side of a problem in Morton order, cut into tiles and padded to whole super tiles.

    Tiles hold consecutive sorted points, but a tile never spans one of the largest jumps of
    the curve (:func:`_breaks`): a new tile starts there and the previous one is padded, so
    that no tile's bounding box stretches across empty space between two parts of a cloud.

    Attributes:
        order: (B, n) int64, ``order[b, k]`` the original index of the k-th sorted point.
        slot: (B, n) int64, the padded position of the k-th sorted point.
        perm: (B, N) int64, the original index of the point in each padded position (padding
            repeats the tile's last real point, so tile boxes need no mask).
        inv: (B, n) int64, the padded position of each original point.
        real: (B, N) bool, positions holding a point (not padding).
        x: (B, N, 3) points in the potential dtype, zero-padded to 3 coordinates (the kernels
            read 3), N = number of tiles · TILE.
        w: (B, N) weights (0 on padding).
        logw: (B, N) log-weights (−inf on padding and zero weights).
        codes: (B, n) int64 sorted Morton codes.
        n: number of real points per problem.
        d: number of coordinates of the points (<= 3).
    """

    order: torch.Tensor
    slot: torch.Tensor
    perm: torch.Tensor
    inv: torch.Tensor
    real: torch.Tensor
    x: torch.Tensor
    w: torch.Tensor
    logw: torch.Tensor
    codes: torch.Tensor
    n: int
    d: int

    @property
    def B(self) -> int:
        return self.x.shape[0]

    @property
    def N(self) -> int:
        return self.x.shape[1]

    @property
    def tiles(self) -> int:
        """Tiles per problem (including tiles that hold only padding)."""
        return self.N // TILE

    def sort(self, t: torch.Tensor, fill: float | None = 0.0) -> torch.Tensor:
        """(B, N, ...) of a per-point (B, n, ...) tensor in padded order, ``fill`` on padding
        (None: the value of the point that the padding position repeats)."""
        idx, real = self.perm, self.real
        if t.dim() == 3:
            idx = idx[..., None].expand(-1, -1, t.shape[-1])
            real = real[..., None]
        out = t.gather(1, idx)
        return out if fill is None else torch.where(real, out, fill)

    def unsort(self, t: torch.Tensor) -> torch.Tensor:
        """(B, n, ...) in the original order from a (B, N, ...) padded-order tensor."""
        idx = self.inv
        if t.dim() == 3:
            idx = idx[..., None].expand(-1, -1, t.shape[-1])
        return t.gather(1, idx)


def morton_codes(x: torch.Tensor, bits: int = BITS) -> torch.Tensor:
    """(B, n) int64 Morton codes of points (B, n, d), d <= 3, on a 2^bits grid per axis over
    each problem's bounding box (the same scale on every axis, so cells are cubes)."""
    B, n, d = x.shape
    xd = x.to(torch.float64)
    lo = xd.amin(1, keepdim=True)
    span = (xd.amax(1, keepdim=True) - lo).amax(-1, keepdim=True)
    span = torch.where(span > 0, span, torch.ones_like(span))
    top = float(2**bits - 1)
    q = ((xd - lo) / span * top).clamp_(0, top).to(torch.int64)
    code = torch.zeros((B, n), dtype=torch.int64, device=x.device)
    # bit b of axis k goes to bit b·d + k: interleave from the least significant bit
    for b in range(bits):
        for k in range(d):
            code |= ((q[..., k] >> b) & 1) << (b * d + k)
    return code


#: At most one tile in BREAK_SHARE starts at a jump of the curve (the padding it costs).
BREAK_SHARE = 8


def _breaks(xs: torch.Tensor) -> torch.Tensor:
    """(B, n) bool: a tile starts at this sorted point. The first point, and after the
    largest gaps between consecutive points that exceed the median extent of a plain tile
    (at most one per BREAK_SHARE tiles)."""
    B, n, d = xs.shape
    brk = torch.zeros((B, n), dtype=torch.bool, device=xs.device)
    brk[:, 0] = True
    nt = n // TILE
    k = min(n - 1, nt // BREAK_SHARE)
    if k < 1:
        return brk
    gap = (xs[:, 1:] - xs[:, :-1]).norm(dim=-1)
    tiles = xs[:, : nt * TILE].reshape(B, nt, TILE, d)
    ext = (tiles.amax(2) - tiles.amin(2)).norm(dim=-1).median(-1).values
    top = torch.where(gap > ext[:, None], gap, -1.0).topk(k, dim=1)
    brk[:, 1:].scatter_(1, top.indices, top.values > 0)
    return brk


def build_layout(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> Layout:
    """Sorts one side's points along the Morton curve and cuts them into padded tiles.

    Args:
        x: (B, n, d) points, d <= 3.
        w: (B, n) non-negative weights.
        dtype: potential dtype of the sorted copy (float32 or float64).
    """
    B, n, d = x.shape
    if d > MAX_DIM:
        raise ValueError(f"the multiscale layout supports d <= {MAX_DIM}, got d = {d}")
    dev = x.device
    codes, order = torch.sort(morton_codes(x), dim=1, stable=True)
    xs = x.to(dtype).gather(1, order[..., None].expand(-1, -1, d))
    # segments between breaks, each padded to whole tiles
    seg = _breaks(xs).to(torch.int64).cumsum(1) - 1  # (B, n)
    S = int(seg[:, -1].max()) + 1
    ar = torch.arange(n, device=dev).expand(B, n)
    length = torch.zeros((B, S), dtype=torch.int64, device=dev).scatter_add_(
        1, seg, torch.ones_like(seg)
    )
    first = torch.full((B, S), n, dtype=torch.int64, device=dev).scatter_reduce_(
        1, seg, ar.contiguous(), "amin"
    )
    padded = -(-length // TILE) * TILE
    offset = padded.cumsum(1) - padded
    slot = offset.gather(1, seg) + ar - first.gather(1, seg)  # (B, n)
    unit = TILE * SUPER
    N = max(unit, -(-int(padded.sum(1).max()) // unit) * unit)
    src = torch.full((B, N), -1, dtype=torch.int64, device=dev)
    src.scatter_(1, slot, ar.contiguous())
    real = src >= 0
    # padding takes the previous real point (the tile's last; positions before any point of
    # a problem cannot occur: its first slot is 0)
    src = src.cummax(1).values.clamp_min(0)
    perm = order.gather(1, src)
    inv = torch.empty_like(order).scatter_(1, order, slot)
    xp = x.to(dtype).gather(1, perm[..., None].expand(-1, -1, d))
    if d < MAX_DIM:
        xp = torch.cat([xp, xp.new_zeros((B, N, MAX_DIM - d))], -1)
    wp = torch.where(real, w.to(dtype).gather(1, perm), 0.0)
    logw = torch.where(wp > 0, wp.clamp_min(1e-300).log(), -math.inf)
    return Layout(order, slot, perm, inv, real, xp.contiguous(), wp, logw, codes, n, d)


@dataclass(frozen=True)
class Cells:
    """Coarse clusters of one side: the non-empty Morton cells of one grid level.

    Attributes:
        x: (B, K, d) weighted centroids (the unweighted mean where a cell has no mass),
            K the largest number of cells over the batch; missing cells repeat the first.
        w: (B, K) total weight of each cell (0 for missing cells).
        of_point: (B, n) cell of each sorted point.
        count: (B,) int64 number of cells of each problem.
        side: edge length of a cell, in the points' units (the largest over the batch).
    """

    x: torch.Tensor
    w: torch.Tensor
    of_point: torch.Tensor
    count: torch.Tensor
    side: float


def _span(x: torch.Tensor) -> float:
    """Largest edge of the bounding box of any problem of the batch (the Morton grid's)."""
    return float((x.amax(1) - x.amin(1)).amax())


def cells(layout: Layout, x: torch.Tensor, max_cells: int) -> Cells:
    """The finest Morton level with at most ``max_cells`` non-empty cells per problem.

    Args:
        layout: the side's layout (its sorted codes).
        x: (B, n, d) the side's points (original order), for the cell edge length.
        max_cells: budget of clusters per problem (>= 1).
    """
    codes, d, B = layout.codes, layout.d, layout.B
    # Cells of every level at once: level l keeps the top l·d bits of the codes.
    counts = []
    for level in range(BITS + 1):
        c = codes >> ((BITS - level) * d)
        counts.append((c[:, 1:] != c[:, :-1]).sum(1).amax() + 1)
    counts = torch.stack(counts).tolist()
    level = max((lv for lv, k in enumerate(counts) if k <= max_cells), default=0)
    c = codes >> ((BITS - level) * d)
    new = torch.ones_like(c, dtype=torch.bool)
    new[:, 1:] = c[:, 1:] != c[:, :-1]
    of_point = new.to(torch.int64).cumsum(1) - 1
    count = of_point[:, -1] + 1
    K = int(counts[level])
    xs = layout.x.gather(1, layout.slot[..., None].expand(-1, -1, MAX_DIM))[..., :d]
    ws = layout.w.gather(1, layout.slot)
    flat = (of_point + K * torch.arange(B, device=codes.device)[:, None]).reshape(-1)
    wsum = torch.zeros(B * K, dtype=ws.dtype, device=ws.device).index_add_(0, flat, ws.reshape(-1))
    num = torch.zeros((B * K, d), dtype=xs.dtype, device=xs.device)
    num.index_add_(0, flat, (ws[..., None] * xs).reshape(-1, d))
    # cells without mass still need a position: their plain mean
    cnt = torch.zeros(B * K, dtype=ws.dtype, device=ws.device)
    cnt.index_add_(0, flat, torch.ones_like(ws).reshape(-1))
    plain = torch.zeros_like(num).index_add_(0, flat, xs.reshape(-1, d))
    weighted = num / wsum.clamp_min(1e-300)[:, None]
    cx = torch.where((wsum > 0)[:, None], weighted, plain / cnt.clamp_min(1)[:, None])
    cx, wsum = cx.reshape(B, K, d), wsum.reshape(B, K)
    missing = torch.arange(K, device=codes.device)[None, :] >= count[:, None]
    cx = torch.where(missing[..., None], cx[:, :1], cx)
    side = _span(x) / 2**level
    return Cells(cx.contiguous(), wsum, of_point, count, side)
