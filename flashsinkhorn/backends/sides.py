"""Which implementation computes the canonical problem (``problem.prepare``'s arithmetic).

For float32 CUDA clouds three Triton launches (backends/triton/prepare.py) centre the points,
round them to the kernels' operand grid, and gather every statistic the value checks need in
one synchronisation; elsewhere ``problem.prepare`` uses torch operations. The choice and the
kernels' number formats live here, in the backend layer, so that ``problem.py`` knows neither.
"""

from __future__ import annotations

import math

import torch

from ..problem import Checks, Side, SidesFn, Stats, check_values, kernel_scale
from ..tuning import TUNING


def prepare_sides(x: torch.Tensor, y: torch.Tensor) -> SidesFn | None:
    """The fused Triton implementation for these clouds, or None for torch operations.

    ``TUNING.prepare_path``: "auto" (Triton for float32 CUDA clouds), "triton" (also on CPU
    under the interpreter) or "torch".
    """
    path = TUNING.prepare_path
    if path == "torch" or x.dtype != torch.float32 or y.dtype != torch.float32:
        return None
    if path == "triton" or x.is_cuda:
        return triton_sides
    return None


def triton_sides(X, Y, a, b, rho_x, rho_y, precision, checks: Checks):
    """The sides, the centre and the diameter (``Problem.diameter``) of float32 clouds
    (B, n, d), (B, m, d) in three Triton launches and one synchronisation."""
    from .triton import prepare as tp

    tp.precompile(X, Y, a, b, precision)
    outs = tp.outputs(X, Y, a, b, precision)
    centre, st = tp.run_stats(X, Y, a, b, outs)
    # Read back always: the range checks (limits.py) need the scale statistics too.
    rows = st.tolist()
    per = {}
    for nm, k, nan in (("a", 0, 7), ("b", 3, 8)):
        if nm in checks.names:
            lo = min(r[k] for r in rows)
            if any(r[nan] > 0 for r in rows):
                lo = math.nan
            per[nm] = (lo, max(r[k + 1] for r in rows), min(r[k + 2] for r in rows))
    gap = 0.0
    if checks.gap:
        gap = max(abs(r[2] - r[5]) / max(r[2], r[5]) if max(r[2], r[5]) > 0 else math.nan
                  for r in rows)  # fmt: skip
    amax = max(r[6] for r in rows)
    check_values(per, gap, amax, checks, X, Y)
    stats = Stats(amax, max(r[9] for r in rows), max(max(r[2], r[5]) for r in rows))
    scaled = precision in ("tf32", "tf32x3")
    kscale = kernel_scale(precision, amax) if scaled else 1.0
    ox, oy = tp.run_sides(X, Y, a, b, centre, precision, kscale, outs)
    null_a = "a" in per and per["a"][0] == 0
    null_b = "b" in per and per["b"][0] == 0
    side_x = Side(ox["x"], ox["sq"], ox["w"], ox["logw"], rho_x, ox["xk"], kscale, null_a,
                  mean=ox["mean"])  # fmt: skip
    side_y = Side(oy["x"], oy["sq"], oy["w"], oy["logw"], rho_y, oy["xk"], kscale, null_b,
                  mean=oy["mean"])  # fmt: skip
    return side_x, side_y, centre, stats
