"""Minibatch couplings for training loops: two batches in, the paired batches out.

``couple(x0, x1)`` flattens each sample's features, solves the entropic OT problem between the
two minibatches with :func:`~flashsinkhorn.sinkhorn` (squared Euclidean cost, uniform
weights) and draws the pairs from the plan with :func:`~.sampling.sample_pairs`, so the
n × m plan is never formed. The default eps is relative to the cost scale, the mean squared
distance between the two batches (docs/couplings.md).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import _validation as V
from .. import limits
from .._boundary import entry_point
from ..backends import transient_path
from ..functional import sinkhorn
from ..result import SinkhornResult
from .sampling import draw_columns, draw_rows, resolve_generator

MODES = ("entropic", "unbalanced", "exact")

#: eps / (mean squared distance) of the entropic and unbalanced modes. On 8 Gaussians → two
#: moons and on 8×8 images (docs/couplings.md) it keeps the expected pair cost within a few
#: percent of the exact OT cost while one solve converges in tens of iterations.
REL_EPS = 0.01
#: eps / (mean squared distance) of the near-exact mode (annealed down to it by the solver).
EXACT_REL_EPS = 1e-3
#: The near-exact mode keeps eps at least this many times above the plan floor of the
#: potentials' dtype (limits.plan_floor), where the plan is still resolved.
FLOOR_MARGIN = 4.0


def flatten(name: str, x: object) -> torch.Tensor:
    """(n, D) view of a minibatch (n, *features) of real floating values."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (n, ...), got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have a batch dimension, got a scalar")
    flat = x.reshape(x.shape[0], -1) if x.dim() != 2 else x
    V.check_points(name, flat)
    return flat


def flatten_pair(x0: object, x1: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, D) and (m, D) views of two minibatches with the same number of features per sample,
    the same dtype and device."""
    f0, f1 = flatten("x0", x0), flatten("x1", x1)
    if f0.shape[1] != f1.shape[1]:
        raise ValueError(
            f"x0 and x1 must have the same number of features per sample, got "
            f"{tuple(x0.shape[1:])} and {tuple(x1.shape[1:])}"
        )
    V.check_pair(f0, f1)
    return f0, f1


class CostScale(NamedTuple):
    """Scales of the squared distances between two minibatches (host floats).

    Attributes:
        msd: mean squared distance over all pairs (the unit of the default eps).
        box2: squared diagonal of the bounding box of both batches (the plan floor's range).
        diameter: an upper bound of the largest distance ‖x0_i − x1_j‖: the smaller of the
            box diagonal and max_i ‖x0_i − c‖ + max_j ‖x1_j − c‖ (c the joint mean), where
            the eps ladder starts.
    """

    msd: float
    box2: float
    diameter: float


def cost_scale(x0: torch.Tensor, x1: torch.Tensor) -> CostScale:
    """The scales of the cost between two flattened batches, read back in one
    synchronisation, which also checks the values for NaN and inf. O((n + m) d) work: no
    n × m term.

    The mean of ‖x0_i − x1_j‖² over all pairs is tr Cov(x0) + tr Cov(x1) + ‖mean x0 −
    mean x1‖², formed from the distances to the joint mean c (no cancellation of large
    norms). The same distances bound the largest one by the triangle inequality through c;
    four passes over each batch (mean, per-feature maximum and minimum, distances to c). In high
    dimension that bound is far below the box diagonal (4096 flattened 3 × 32 × 32 images,
    N(0, I) against U[−1, 1]: 91 against 402), whose square made the eps rule anneal (eps =
    2.5e-4 of it) from 20 times the largest cost, while eps is 5e-3 of the bound's square
    and the solve converges without a ladder (10 iterations against 17 with it,
    docs/couplings.md).

    Raises:
        ValueError: NaN or inf in ``x0`` or ``x1`` (named); two identical single points.
    """
    with torch.no_grad():
        a = x0.float() if x0.dtype != torch.float64 else x0
        b = x1.float() if x1.dtype != torch.float64 else x1
        n, m = a.shape[0], b.shape[0]
        ma, mb = a.mean(0), b.mean(0)
        # amax and amin, not aminmax: its column reduction ran 6x slower on the CPU
        box = torch.maximum(a.amax(0), b.amax(0)) - torch.minimum(a.amin(0), b.amin(0))
        c = ((n * ma + m * mb) / (n + m))[None]
        # distances to the joint mean from direct differences (no ‖x‖² − 2 x·c + ‖c‖²
        # cancellation), without an (n, d) temporary
        ra, rb = (torch.cdist(t, c, compute_mode="donot_use_mm_for_euclid_dist")[:, 0]
                  for t in (a, b))  # fmt: skip
        # mean ‖x_i − c‖² = tr Cov(x) + ‖mean x − c‖², with mean x − c = m/(n+m) (ma − mb)
        # (and n/(n+m) for y): the cross term 2nm/(n+m)² ‖ma − mb‖² completes the msd
        cross = 2.0 * n * m / (n + m) ** 2 * (ma - mb).square().sum()
        msd = ra.square().mean() + rb.square().mean() + cross
        vals = torch.stack([msd, box.square().sum(), ra.amax() + rb.amax()]).tolist()
    msd_v, box2_v, reach = vals
    if not math.isfinite(msd_v):
        for name, t in (("x0", x0), ("x1", x1)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} must not contain NaN or inf")
        raise ValueError("the squared distances between x0 and x1 overflow; rescale the data")
    if not msd_v > 0:
        raise ValueError(
            "x0 and x1 are the same single point (zero mean squared distance): every coupling "
            "is optimal"
        )
    return CostScale(msd_v, box2_v, min(math.sqrt(box2_v), reach))


def default_eps(mode: str, msd: float, box2: float, dtype: torch.dtype) -> float:
    """The eps of ``mode`` for a mean squared distance ``msd`` (and squared bounding-box
    diagonal ``box2``, which sets the plan floor of the near-exact mode)."""
    if mode != "exact":
        return REL_EPS * msd
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    floor = limits.PLAN_FLOOR_ULPS * torch.finfo(pdtype).eps * box2
    return max(EXACT_REL_EPS * msd, FLOOR_MARGIN * floor)


def solve_batches(
    x0: torch.Tensor,
    x1: torch.Tensor,
    *,
    eps: float | None,
    mode: str,
    rho: float | None,
    tol: float | None,
    n_iters: int,
    backend: str,
    precision: str,
    path: str = "auto",
    scale: float = 1.0,
) -> SinkhornResult:
    """The solve behind a coupling of two flattened, checked batches.

    ``eps`` and ``rho`` are absolute (times ``scale``); None takes the mode's default from the
    cost scale; an eps ladder, where the rule anneals, starts at the cost scale's bound of the
    largest distance. ``path`` "auto" takes the stored Gram matrix wherever it fits the free
    memory (``backends.transient_path``): the result is used once. The cost-scale read is the
    one synchronisation besides the solver's own.
    """
    mode = V.check_choice("mode", mode, MODES)
    if rho is not None and mode != "unbalanced":
        raise ValueError(f"rho is for mode='unbalanced', got mode={mode!r}")
    eps = None if eps is None else V.check_positive("eps", eps) * scale
    rho = None if rho is None else V.check_positive("rho", rho) * scale
    cs = cost_scale(x0, x1)
    if eps is None:
        eps = default_eps(mode, cs.msd, cs.box2, x0.dtype)
    if mode == "unbalanced" and rho is None:
        rho = cs.msd
    if path == "auto":
        path = transient_path(x0, x1, backend)
    # the values were checked by the cost-scale read; the ladder (if the rule anneals: with a
    # tolerance only) starts at the bound of the largest distance instead of the box diagonal
    diameter = cs.diameter if tol is not None else None
    return sinkhorn(x0, x1, eps=eps, rho_x=rho, rho_y=rho, tol=tol, n_iters=n_iters,
                    backend=backend, precision=precision, path=path,
                    diameter=diameter, check_finite=False)  # fmt: skip


@entry_point
def couple_indices(
    x0: torch.Tensor,
    x1: torch.Tensor,
    *,
    eps: float | None = None,
    mode: str = "entropic",
    rho: float | None = None,
    k: int | None = None,
    replace: bool = False,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    tol: float | None = 1e-3,
    n_iters: int = 1000,
    backend: str = "auto",
    precision: str = "auto",
    path: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index pairs (i, j) of an OT coupling of two minibatches; see :func:`couple`.

    Returns:
        ``(i, j)``: (k,) int64 indices into ``x0`` and ``x1``.
    """
    f0, f1 = flatten_pair(x0, x1)
    n = f0.shape[0]
    k = n if k is None else V.check_int("k", k, 1)
    replace = V.check_bool("replace", replace)
    if not replace and k > n:
        raise ValueError(f"k must be <= len(x0) = {n} without replacement, got {k}")
    gen = resolve_generator(generator, seed, f0.device)
    with torch.no_grad():
        res = solve_batches(f0.detach(), f1.detach(), eps=eps, mode=mode, rho=rho, tol=tol,
                            n_iters=n_iters, backend=backend, precision=precision,
                            path=path)  # fmt: skip
        limits.check_plan(res.solution.problem, res.eps, "sampling from the plan")
        rows = draw_rows(res, k, replace, gen)
        cols = draw_columns(res, rows, gen)
    return rows[0], cols[0]


@entry_point
def couple(
    x0: torch.Tensor,
    x1: torch.Tensor,
    *,
    eps: float | None = None,
    mode: str = "entropic",
    rho: float | None = None,
    k: int | None = None,
    replace: bool = False,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    tol: float | None = 1e-3,
    n_iters: int = 1000,
    backend: str = "auto",
    precision: str = "auto",
    path: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs two minibatches by an optimal-transport plan: returns ``(x0[i], x1[j])``.

    The cost is the squared Euclidean distance between flattened samples, with uniform
    weights. The plan is solved by :func:`~flashsinkhorn.sinkhorn` and sampled without being
    stored: rows i from its row marginal, then j ~ P_ij / â_i by a streamed Gumbel-max
    (:func:`~flashsinkhorn.coupling.sample_pairs`). On CUDA the only host synchronisations
    are the cost-scale read (when eps or rho is derived from it) and the solver's
    convergence tests.

    Args:
        x0: (n, ...) source minibatch (noise), any feature shape (e.g. images (n, C, H, W)).
        x1: (m, ...) target minibatch (data), the same number of features per sample.
        eps: entropic regularisation in units of the squared distance. Default None: a
            fraction of the mean squared distance s between the batches, 0.01·s for
            "entropic" and "unbalanced", 1e-3·s for "exact" (kept at least 4 times above the
            float32 plan floor, docs/precision.md).
        mode: "entropic" (default), "unbalanced" (KL-relaxed marginals of strength ``rho``:
            outliers of either batch may be left out) or "exact" (a near-exact plan: eps
            annealed to 1e-3·s; an entropic approximation whose expected pair cost was
            measured within 1 % of ``ot.emd``'s exact cost, docs/couplings.md).
        rho: marginal relaxation of "unbalanced", in units of the squared distance; default
            the mean squared distance s.
        k: number of pairs; default n = len(x0).
        replace: draw the rows with replacement (i.i.d. pairs from the plan). Default False:
            k distinct rows (all of x0 when k = n), each with its partner j drawn from the
            plan's row.
        generator: ``torch.Generator`` on the batches' device (default: torch's default
            generator there).
        seed: int seed instead of ``generator``.
        tol: marginal-error tolerance of the solve (default 1e-3); None runs ``n_iters``.
        n_iters: iteration cap of the solve. Default 1000.
        backend: "auto" (Triton on CUDA, torch otherwise), "torch" or "triton".
        precision: dot-product precision, as in :func:`~flashsinkhorn.sinkhorn`.
        path: how the Triton backend reads the cost, as in :func:`~flashsinkhorn.sinkhorn`
            ("auto": on CUDA a stored x·yᵀ for float32 batches with d >= 256 when it fits
            40 % of the free memory, streaming otherwise).

    Returns:
        ``(x0[i], x1[j])``, shapes (k, ...) like the inputs (differentiable through the
        indexing; the pairing itself is not).

    Raises:
        ValueError, TypeError: invalid arguments, naming them; non-finite values; an eps
            below what float32 resolves (docs/precision.md).

    Example:
        ```python
        x0 = torch.randn_like(x1)                  # noise
        x0, x1 = flashsinkhorn.couple(x0, x1)      # OT-paired minibatch
        t = torch.rand(len(x0), 1, 1, 1)
        xt = (1 - t) * x0 + t * x1                 # flow-matching target: x1 − x0
        ```
    """
    i, j = couple_indices(x0, x1, eps=eps, mode=mode, rho=rho, k=k, replace=replace,
                          generator=generator, seed=seed, tol=tol, n_iters=n_iters,
                          backend=backend, precision=precision, path=path)  # fmt: skip
    return x0[i], x1[j]
