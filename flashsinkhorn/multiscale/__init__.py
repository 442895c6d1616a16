"""Multiscale path for low-dimensional clouds (d <= 3): Morton clustering, a coarse annealed
solve on cell centroids, and block-sparse fine soft-mins that visit only the tile pairs whose
bound of the plan's mass exceeds a threshold tied to ``tol`` (docs/multiscale.md).

- clustering.py: Morton codes, sorted and padded layouts, tiles, coarse cells;
- bounds.py: affine bounds of the potentials per tile, pair bounds, the sparsity pattern and
  the bound of the skipped mass;
- sparse_torch.py: the block-sparse log-sum-exp in torch (the kernel's oracle);
- backend.py: the Backend primitives on the pattern (soft-min, transport, gradient);
- solver.py: coarse solve, lift and fine loop;
- inputs.py: what the path accepts (the checks of ``path="multiscale"``);
- select.py: when "auto" picks the path, and the backend of a problem.
"""

from .backend import TRUNCATION_FRACTION, MultiscaleBackend
from .select import AUTO_MAX_EPS_RATIO, AUTO_MIN_SCORES, multiscale_applies, multiscale_backend
from .solver import COARSE_CLUSTERS, solve_multiscale

__all__ = [
    "AUTO_MAX_EPS_RATIO",
    "AUTO_MIN_SCORES",
    "COARSE_CLUSTERS",
    "TRUNCATION_FRACTION",
    "MultiscaleBackend",
    "multiscale_applies",
    "multiscale_backend",
    "solve_multiscale",
]
