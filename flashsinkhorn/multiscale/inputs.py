"""What the multiscale path accepts: the checks of ``path="multiscale"`` (options.py runs
them with the other argument checks, before anything is solved)."""

from __future__ import annotations

import torch

from .clustering import MAX_DIM

#: Point dtypes of the multiscale path.
DTYPES = (torch.float32, torch.float64)


def check_options(x: torch.Tensor, cost_is_default: bool, precision: str) -> None:
    """Raises a ValueError when ``path="multiscale"`` cannot run these inputs.

    Args:
        x: the source points (checked already), (n, d) or (B, n, d).
        cost_is_default: the cost is the plain ‖x − y‖² (no feature map, weight or labels).
        precision: the requested precision.
    """
    d = x.shape[-1]
    if d > MAX_DIM:
        raise ValueError(
            f"path='multiscale' supports points of dimension d <= {MAX_DIM}, got d = {d}; use "
            "path='auto' (it pays for d <= 3 only, docs/multiscale.md)"
        )
    if x.dtype not in DTYPES:
        raise ValueError(
            f"path='multiscale' supports float32 and float64 points, got {x.dtype}; convert "
            "them or use path='auto'"
        )
    if not cost_is_default:
        raise ValueError(
            "path='multiscale' supports the squared Euclidean cost only (cost='sqeuclidean', "
            "no feature_map, feature_weight=1, no labels); use path='auto'"
        )
    if precision not in ("auto", "ieee"):
        raise ValueError(
            f"path='multiscale' computes distances in exact float32/float64: precision must be "
            f"'auto' or 'ieee', got {precision!r}"
        )
