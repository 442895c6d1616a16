"""Where the multiscale path applies: the "auto" rule, and the backend of a problem."""

from __future__ import annotations

from ..backends import kernel_cpu
from ..solvers import estimate_diameter
from .backend import MultiscaleBackend
from .clustering import MAX_DIM
from .inputs import DTYPES

#: "auto" takes the multiscale path from this many scores per half-step (B·n·m) on; on CPU
#: tensors also wherever the stored kernel of the CPU path does not fit its memory budget
#: (``backends.kernel_cpu.KERNEL_MAX_BYTES``): below it the kernel's matrix–vector products
#: win (5000², d = 2, eps = 1e-3, one thread, back to back: 12.2 s against 53 s multiscale),
#: above it the alternative is the log-domain soft-min, which recomputes every exponential.
AUTO_MIN_SCORES = 10**10
#: ... and only for eps <= AUTO_MAX_EPS_RATIO · diameter² (the fine tiles then meet a small
#: fraction of the other cloud; docs/multiscale.md).
AUTO_MAX_EPS_RATIO = 1e-3


def multiscale_applies(x, y, opts) -> bool:
    """The path of a solve: True for ``path="multiscale"``; for "auto", True when the inputs
    qualify (d <= 3, float32/float64, the plain cost, precision "auto" or "ieee", a
    tolerance) and B·n·m >= :data:`AUTO_MIN_SCORES` (on CPU tensors, or B·n·m values above the
    stored kernel's budget) and eps <= :data:`AUTO_MAX_EPS_RATIO` · diameter² (the diameter
    from ``opts.diameter`` or the bounding box: one reduction)."""
    if opts.path == "multiscale":
        return True
    if opts.path != "auto" or opts.tol is None:
        return False
    d = x.shape[-1]
    ok = d <= MAX_DIM and x.dtype in DTYPES and opts.cost.is_default
    ok = ok and opts.precision in ("auto", "ieee")
    B = x.shape[0] if x.dim() == 3 else 1
    scores = B * x.shape[-2] * y.shape[-2]
    big = scores >= AUTO_MIN_SCORES
    if x.device.type == "cpu":
        big = big or scores * x.element_size() > kernel_cpu.KERNEL_MAX_BYTES
    if not (ok and big):
        return False
    diam = opts.diameter
    if diam is None:
        xb = x if x.dim() == 3 else x[None]
        yb = y if y.dim() == 3 else y[None]
        diam = estimate_diameter(xb.detach(), yb.detach())
    return opts.eps <= AUTO_MAX_EPS_RATIO * diam * diam


def multiscale_backend(base, problem, opts) -> MultiscaleBackend:
    """The multiscale backend of a prepared problem."""
    return MultiscaleBackend(base, problem, opts.tol)
