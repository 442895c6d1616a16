"""Minibatch couplings for training loops: two batches in, the paired batches out.

``couple(x0, x1)`` flattens each sample's features, solves the entropic OT problem between the
two minibatches with :func:`~flashsinkhorn.sinkhorn` (squared Euclidean cost, uniform
weights) and draws the pairs from the plan with :func:`~.sampling.sample_pairs`, so the
n × m plan is never formed. The default eps is relative to the cost scale, the mean squared
distance between the two batches (docs/couplings.md).
"""

from __future__ import annotations

import math

import torch

from .. import _validation as V
from .. import limits
from .._boundary import entry_point
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


def cost_scale(x0: torch.Tensor, x1: torch.Tensor) -> tuple[float, float]:
    """(mean squared distance between the batches, squared bounding-box diagonal), read back
    in one synchronisation, which also checks the values for NaN and inf.

    The mean of ‖x0_i − x1_j‖² over all pairs is tr Cov(x0) + tr Cov(x1) + ‖mean x0 −
    mean x1‖² (no n × m term, no cancellation of large norms).

    Raises:
        ValueError: NaN or inf in ``x0`` or ``x1`` (named); two identical single points.
    """
    with torch.no_grad():
        a = x0.float() if x0.dtype != torch.float64 else x0
        b = x1.float() if x1.dtype != torch.float64 else x1
        msd = a.var(0, unbiased=False).sum() + b.var(0, unbiased=False).sum()
        msd = msd + (a.mean(0) - b.mean(0)).square().sum()
        box = torch.maximum(a.amax(0), b.amax(0)) - torch.minimum(a.amin(0), b.amin(0))
        msd_v, box2_v = torch.stack([msd, box.square().sum()]).tolist()
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
    return msd_v, box2_v


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
    cost scale. The cost-scale read is the one synchronisation besides the solver's own.
    """
    mode = V.check_choice("mode", mode, MODES)
    if rho is not None and mode != "unbalanced":
        raise ValueError(f"rho is for mode='unbalanced', got mode={mode!r}")
    eps = None if eps is None else V.check_positive("eps", eps) * scale
    rho = None if rho is None else V.check_positive("rho", rho) * scale
    msd, box2 = cost_scale(x0, x1)
    if eps is None:
        eps = default_eps(mode, msd, box2, x0.dtype)
    if mode == "unbalanced" and rho is None:
        rho = msd
    # the values were checked by the cost-scale read
    return sinkhorn(x0, x1, eps=eps, rho_x=rho, rho_y=rho, tol=tol, n_iters=n_iters,
                    backend=backend, precision=precision, path=path,
                    check_finite=False)  # fmt: skip


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
            ("auto": a stored x·yᵀ for d >= 256 when it fits 4 GiB, streaming otherwise).

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
