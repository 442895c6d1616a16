"""Differentiable losses: OT_eps and the debiased Sinkhorn divergence (cost ‖x − y‖²).

Both run a forward solve without recording a graph and differentiate by the envelope
theorem (:class:`~flashsinkhorn.autograd.OTCostFunction`): memory stays O((n + m) d) in the
backward too. A second derivative w.r.t. the points (double backward) applies the streaming
HVP of :mod:`flashsinkhorn.hessian`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _validation as V
from ._boundary import entry_point
from ._convergence import SolveReport, report, warn_unconverged
from .autograd import OTCostFunction
from .autograd.divergence import DivergenceFunction
from .costs import transform_points
from .engine import solve_divergence, solve_points
from .option_table import document_options
from .options import SinkhornOptions, public_options


def _ot_cost_points(
    x, y, a, b, opts: SinkhornOptions, reports: list[SolveReport] | None = None, label: str = ""
) -> torch.Tensor:
    """OT_eps of already transformed points (differentiable, label_cost included); appends
    how the solve ended to ``reports``."""
    spec = opts.cost
    res = solve_points(x, y, a, b, opts)
    if reports is not None:
        reports.append(report(label, res))
    return OTCostFunction.apply(
        x, y, a, b, res, opts.hvp, spec.label_cost, spec.label_weight, spec.is_default
    )


@entry_point
@document_options(
    path='as in :func:`flashsinkhorn.sinkhorn`; "multiscale" (d <= 3) differentiates through '
    'the block-sparse plan (first derivatives only; docs/multiscale.md). Default "auto".',
    hvp_options="Schur-solve settings of the second derivative (``create_graph=True`` then "
    "grad again, which applies the streaming HVP): keys ``tau``, ``cg_tol``, ``cg_max_iter``, "
    "``cg_check_every`` (defaults 1e-5, 1e-6, 500, 10; docs/hvp.md). Second derivatives exist "
    "for the default squared Euclidean cost only.",
    cost='"sqeuclidean" (default), "euclidean" or "cosine"; as in '
    ":func:`flashsinkhorn.sinkhorn`. Gradients: docs/costs.md (the euclidean cost uses the "
    "subgradient 0 where x_i = y_j).",
    feature_map="(k, d) or (d,) linear map of the features (gradients flow through it to the "
    "points; the map itself is not differentiated). Default None.",
    label_cost="(V, V) label cost W; differentiable when it requires grad: dOT/dW[k, l] = "
    "label_weight · Σ_{i: label_x_i = k, j: label_y_j = l} P_ij. Default None.",
)
def ot_cost(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    n_iters: int = 1000,
    tol: float | None = 1e-3,
    check_every: int = 10,
    schedule: str = "auto",
    acceleration: str = "auto",
    omega: float | None = None,
    anderson_memory: int = 5,
    scaling: float | str | None = "auto",
    diameter: float | None = None,
    rho_x: float | None = None,
    rho_y: float | None = None,
    backend: str = "auto",
    precision: str = "auto",
    check_finite: bool = True,
    path: str = "auto",
    progress: bool | Callable[[int, float], object] | None = None,
    hvp_options: dict | None = None,
    cost: str = "sqeuclidean",
    feature_map: torch.Tensor | None = None,
    label_x: torch.Tensor | None = None,
    label_y: torch.Tensor | None = None,
    label_cost: torch.Tensor | None = None,
    feature_weight: float = 1.0,
    label_weight: float = 1.0,
) -> torch.Tensor:
    """Entropic OT value OT_eps(a, b), differentiable w.r.t. ``x``, ``y``, ``a`` and ``b``.

    Same problem and options as :func:`flashsinkhorn.sinkhorn` (cost C_ij = ‖x_i − y_j‖²);
    returns its ``value``. Gradients (envelope theorem, induced marginals â = P1, b̂ = Pᵀ1 of
    the plan actually computed, so early-stopped solves give consistent gradients):
    ∇_x = 2 (diag(â) x − P y), ∇_y = 2 (diag(b̂) y − Pᵀ x), ∇_a = f, ∇_b = g (balanced; for
    KL-relaxed marginals the partial derivative of the dual objective, see docs/transport.md).

    Args:
        x: (n, d) or (B, n, d) source points.
        y: (m, d) or (B, m, d) target points.
        a: weights of x, (n,) or (B, n) (a shared (n,) is allowed for batched x); default
            uniform.
        b: weights of y, (m,) or (B, m); default uniform.
        {options}

    Returns:
        A 0-d tensor, or (B,) for batched inputs, in float32 (float64 for float64 inputs).

    Raises:
        ValueError, TypeError: for invalid arguments, naming the argument.
        RuntimeError: when differentiated twice through the weights, or through an
            unbalanced problem (second derivatives exist for x and y of balanced OT only).

    Examples:
        One point on each side: the plan is 1, so the value is ‖x − y‖² and the gradient
        2 (x − y).

        >>> import torch
        >>> import flashsinkhorn as fs
        >>> x = torch.zeros(1, 2, requires_grad=True)
        >>> loss = fs.ot_cost(x, torch.ones(1, 2), eps=0.1)
        >>> round(loss.item(), 4)
        2.0
        >>> loss.backward()
        >>> x.grad
        tensor([[-2., -2.]])
    """
    reports: list[SolveReport] = []
    opts, out = ot_cost_reported(
        x, y, a, b, reports, "OT(x, y)", hvp_options=hvp_options, **public_options(locals())
    )
    warn_unconverged("ot_cost", reports, opts.n_iters, opts.tol)
    return out


def ot_cost_reported(
    x, y, a, b, reports: list[SolveReport], label: str, *, hvp_options=None, **options
) -> tuple[SinkhornOptions, torch.Tensor]:
    """:func:`ot_cost` without its warning: the solve's report goes to ``reports``, for a
    caller that runs several solves and warns once (OTDD)."""
    V.check_points("x", x)
    V.check_points("y", y)
    V.check_pair(x, y)
    opts = SinkhornOptions.build(x, y, hvp_options=hvp_options, **options)
    xt, yt = transform_points(x, opts.cost), transform_points(y, opts.cost)
    return opts, _ot_cost_points(xt, yt, a, b, opts, reports, label)


@entry_point
@document_options()
def sinkhorn_divergence(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    eps: float,
    n_iters: int = 1000,
    tol: float | None = 1e-3,
    check_every: int = 10,
    schedule: str = "auto",
    acceleration: str = "auto",
    omega: float | None = None,
    anderson_memory: int = 5,
    scaling: float | str | None = "auto",
    diameter: float | None = None,
    rho_x: float | None = None,
    rho_y: float | None = None,
    backend: str = "auto",
    precision: str = "auto",
    check_finite: bool = True,
    path: str = "auto",
    progress: bool | Callable[[int, float], object] | None = None,
    hvp_options: dict | None = None,
    cost: str = "sqeuclidean",
    feature_map: torch.Tensor | None = None,
    label_x: torch.Tensor | None = None,
    label_y: torch.Tensor | None = None,
    label_cost: torch.Tensor | None = None,
    feature_weight: float = 1.0,
    label_weight: float = 1.0,
) -> torch.Tensor:
    r"""Debiased Sinkhorn divergence S = OT(a, b) − ½ OT(a, a) − ½ OT(b, b).

    $$
    S_\varepsilon(a, b) = \mathrm{OT}_\varepsilon(a, b) - \tfrac12\,\mathrm{OT}_\varepsilon(a, a)
    - \tfrac12\,\mathrm{OT}_\varepsilon(b, b)
    $$

    With KL-relaxed marginals (``rho_x == rho_y = rho``) the unbalanced debiasing term
    eps/2 (m_a − m_b)² is added (Séjourné et al.), so that S >= 0 also for unequal masses.

    S ≥ 0, S(a, a) = 0 and S(a, b) = S(b, a) (up to the solver tolerance); it is the training
    loss most users want. Options as in :func:`ot_cost` (``path="multiscale"`` runs all three
    solves, the self terms included, on the multiscale path), except that ``rho_x`` and ``rho_y``
    must be equal (both None, or the same number): a relaxation of one marginal only, or two
    different ones, has no debiased divergence with S(a, a) = 0 and S >= 0 (a ValueError;
    docs/transport.md). With ``scaling`` all three solves anneal from the same diameter (that
    of both clouds, estimated when None). ``progress`` reports each of the three solves in turn
    (OT(x, y), then the self terms).

    The cost arguments (``cost``, ``feature_map``, ``label_x``, ``label_y``, ``label_cost``,
    ``feature_weight``, ``label_weight``) are those of :func:`ot_cost`; the self terms use
    (label_x, label_x) and (label_y, label_y), so W is over the union of both label sets.

    Args:
        x: (n, d) or (B, n, d) source points.
        y: (m, d) or (B, m, d) target points.
        a: weights of x, (n,) or (B, n); default uniform.
        b: weights of y, (m,) or (B, m); default uniform.
        {options}

    Returns:
        A 0-d tensor, or (B,) for batched inputs, differentiable w.r.t. x, y, a, b.

    Examples:
        >>> import torch
        >>> import flashsinkhorn as fs
        >>> x = torch.rand(200, 3, requires_grad=True)
        >>> y = torch.rand(300, 3) + 1.0
        >>> abs(fs.sinkhorn_divergence(x, x, eps=0.1).item()) < 1e-4   # S(a, a) = 0
        True
        >>> loss = fs.sinkhorn_divergence(x, y, eps=0.1)
        >>> loss.backward()                                           # streaming gradient
        >>> bool(loss > 0), x.grad.shape
        (True, torch.Size([200, 3]))
    """
    return divergence(
        "sinkhorn_divergence", x, y, a, b, hvp_options=hvp_options, **public_options(locals())
    )


def divergence(where: str, x, y, a, b, *, hvp_options=None, **options) -> torch.Tensor:
    """:func:`sinkhorn_divergence` for the public function ``where`` (named in warnings)."""
    V.check_points("x", x)
    V.check_points("y", y)
    V.check_pair(x, y)
    opts = SinkhornOptions.build(x, y, hvp_options=hvp_options, **options)
    V.check_divergence_rho(opts.rho_x, opts.rho_y)
    reports: list[SolveReport] = []
    out = divergence_points(x, y, a, b, opts, reports)
    warn_unconverged(where, reports, opts.n_iters, opts.tol)
    return out


def divergence_points(x, y, a, b, opts: SinkhornOptions, reports: list[SolveReport]):
    """S_eps of checked clouds with validated options (``rho_x == rho_y``); the three solves
    append their reports (for the caller's :func:`warn_unconverged`)."""
    spec = opts.cost
    xt, yt = transform_points(x, spec), transform_points(y, spec)
    terms = solve_divergence(xt, yt, a, b, opts)
    labels = ("OT(x, y)", "OT(x, x)", "OT(y, y)")
    reports += [report(lab, r) for lab, r in zip(labels, terms, strict=True)]
    div = DivergenceFunction.apply(
        xt, yt, a, b, terms, opts.hvp, spec.label_cost, spec.label_weight, spec.is_default
    )
    if opts.rho_x is not None:
        # Unbalanced debiasing (Séjourné et al.): with the generalised KL in OT_eps, the two
        # self terms over-correct by eps/2 (m_a − m_b)²; adding it back keeps S >= 0 (the
        # fuzzing found S < 0 without it). It vanishes for equal masses.
        div = div + 0.5 * opts.eps * (_mass(a, x, div) - _mass(b, y, div)) ** 2
    return zero_if_identical(div, xt, yt, a, b, spec.label_x, spec.label_y)


def zero_if_identical(div, x, y, a, b, label_x=None, label_y=None) -> torch.Tensor:
    """S with the problems of identical measures set to exactly 0 (and their gradient to 0).

    S(μ, μ) = 0 is an identity, but the three solves stop at a tolerance along different
    iterations (OT(x, y) two potentials, the self terms one), so their values differ by up to
    tol·(cost range) and S came out negative for x and x.clone() (−1.7e-7 at 400 points in
    float64). The test runs on the device: an elementwise comparison of the clouds, weights
    and labels, no synchronisation. S has its minimum there, so its gradient is 0 as well.

    Args:
        div: () or (B,) divergence.
        x, y: (n, d) / (B, n, d) points as solved (transformed); other shapes never match.
        a, b: weights as the caller passed them ((n,), (n, 1), (B, n), (B, n, 1)) or None.
        label_x, label_y: labels of the label-augmented cost, or None.
    """
    if x.shape != y.shape:
        return div
    same = (x == y).all(-1).all(-1)
    wa, wb = _weights_like(a, x), _weights_like(b, y)
    if wa.shape[-1] != wb.shape[-1]:
        return div
    same = same & (wa == wb).all(-1)
    if label_x is not None or label_y is not None:
        if label_x is None or label_y is None or label_x.shape != label_y.shape:
            return div
        same = same & (label_x == label_y).all(-1)
    return torch.where(same.reshape(div.shape), torch.zeros_like(div), div)


def _weights_like(w: torch.Tensor | None, points: torch.Tensor) -> torch.Tensor:
    """(n,) or (B, n) weights of ``points``; uniform 1/n for None."""
    if w is None:
        n = points.shape[-2]
        return torch.full((n,), 1.0 / n, dtype=points.dtype, device=points.device)
    return w[..., 0] if w.dim() == points.dim() else w


def _mass(w: torch.Tensor | None, points: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Total mass of a weight vector ((n,), (n, 1), (B, n), (B, n, 1)); 1 for uniform weights."""
    if w is None:
        return torch.ones((), dtype=like.dtype, device=like.device)
    if w.dim() == points.dim():
        w = w[..., 0]
    return w.sum(-1).to(like.dtype)
