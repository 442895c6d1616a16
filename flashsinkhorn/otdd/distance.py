"""The optimal transport dataset distance (OTDD) between two labelled datasets.

Cost between labelled points z = (x, ℓ) and z' = (y, ℓ'):

    C(z, z') = feature_weight · ‖x − y‖² + label_weight · W[ℓ, ℓ'],

with W the class-to-class distance matrix over the union of both label sets
(:func:`class_distance_matrix`). The distance is the debiased Sinkhorn divergence of the two
datasets under this cost: three streaming solves whose kernels look W up per tile.
"""

from __future__ import annotations

import torch

from .. import _validation as V
from .._convergence import reported_as
from ..losses import divergence
from ..option_table import document_options
from ..options import SinkhornOptions, public_options
from ._labels import (
    check_class_weights,
    check_cloud,
    check_finite_clouds,
    check_labels,
    check_num_classes,
    check_pair,
)
from .class_distance import class_distance_matrix

_W_OPTIONS = (
    "eps", "n_iters", "tol", "check_every", "schedule", "acceleration", "omega",
    "anderson_memory", "scaling", "diameter", "backend", "precision", "check_finite",
    "max_batch_elements", "progress",
)  # fmt: skip


def augment_labels(
    l1: torch.Tensor, l2: torch.Tensor, num_classes: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of both datasets as indices into the union W of :func:`class_distance_matrix`.

    Args:
        l1: (n1,) integer labels of dataset 1, in 0 .. V1-1.
        l2: (n2,) integer labels of dataset 2, in 0 .. V2-1.
        num_classes: (V1, V2); default None: (max(l1) + 1, max(l2) + 1).

    Returns:
        ``(l1, l2 + V1)`` as int64 tensors: the ``label_x`` / ``label_y`` to pass to
        :func:`flashsinkhorn.sinkhorn` (or ``ot_cost``, ``sinkhorn_divergence``) together with
        ``label_cost=W``.

    Raises:
        ValueError, TypeError: labels that are not 1-D integer tensors of class indices.
    """
    v1, v2 = check_num_classes(num_classes)
    V1 = check_labels("l1", l1, None, v1)
    check_labels("l2", l2, None, v2)
    if l1.device != l2.device:
        raise ValueError(f"l1 and l2 must be on the same device, got {l1.device} and {l2.device}")
    return l1.long(), l2.long() + V1


@document_options()
def otdd_distance(
    x1: torch.Tensor,
    l1: torch.Tensor,
    x2: torch.Tensor,
    l2: torch.Tensor,
    *,
    eps: float,
    a1: torch.Tensor | None = None,
    a2: torch.Tensor | None = None,
    feature_weight: float = 1.0,
    label_weight: float = 1.0,
    label_cost: torch.Tensor | None = None,
    num_classes: tuple[int, int] | None = None,
    differentiable_w: bool = False,
    w_options: dict | None = None,
    n_iters: int = 1000,
    tol: float | None = 1e-3,
    check_every: int = 10,
    schedule: str = "auto",
    acceleration: str = "auto",
    omega: float | None = None,
    anderson_memory: int = 5,
    scaling: float | str | None = "auto",
    diameter: float | None = None,
    backend: str = "auto",
    precision: str = "auto",
    check_finite: bool = True,
    progress: bool = False,
) -> torch.Tensor:
    r"""Debiased OTDD between two labelled datasets, differentiable w.r.t. the points.

    OTDD = S_eps(D1, D2) = OT(D1, D2) − ½ OT(D1, D1) − ½ OT(D2, D2) with the label-augmented
    cost $\lambda_1 \|x - y\|^2 + \lambda_2\, W[\ell, \ell']$
    (``feature_weight · ‖x − y‖² + label_weight · W[ℓ, ℓ']``); the self terms pair each
    dataset's labels with themselves, which is why W covers the union of the label sets
    (index k for class k of dataset 1, V1 + k' for class k' of dataset 2; see
    :func:`class_distance_matrix`).

    Gradients: w.r.t. ``x1``, ``x2`` (and ``a1``, ``a2``) by the envelope theorem of the
    three solves. When W is built here it is, by default, a constant (detached): the
    gradient is that of the feature term at fixed class distances — the cheap choice, with no
    graph through the V² class problems. ``differentiable_w=True`` also differentiates
    through W (its class problems keep their solver state for the backward; see
    ``class_distance_matrix(differentiable=True)``), giving the total derivative of the
    distance w.r.t. the points. A caller-supplied ``label_cost`` that requires grad receives
    its gradient (the plan's mass per class pair, times ``label_weight``).

    Args:
        x1: (n1, d) points of dataset 1.
        l1: (n1,) integer labels of dataset 1, in 0 .. V1-1.
        x2: (n2, d) points of dataset 2, same dtype and device as ``x1``.
        l2: (n2,) integer labels of dataset 2, in 0 .. V2-1.
        eps: entropic regularisation of the outer problems (units of the augmented cost);
            also that of the class problems unless ``w_options`` sets another.
        a1: (n1,) probability weights of dataset 1; default None: uniform 1/n1.
        a2: (n2,) probability weights of dataset 2; default None: uniform 1/n2.
        feature_weight: λ1 >= 0, weight of ‖x − y‖². Default 1.0 (the paper uses 0.5).
        label_weight: λ2 >= 0, weight of W[ℓ, ℓ']. Default 1.0 (the paper uses 0.5).
        label_cost: a precomputed (V1 + V2, V1 + V2) W in the layout above; default None:
            built with :func:`class_distance_matrix` (from ``a1``, ``a2`` and the solver
            options below, overridden by ``w_options``).
        num_classes: (V1, V2); default None: (max(l1) + 1, max(l2) + 1).
        differentiable_w: differentiate through a W built here. Default False (W detached).
        w_options: options of the W builder that differ from the outer ones (keys ``eps``,
            ``n_iters``, ``tol``, ``check_every``, ``schedule``, ``scaling``, ``diameter``,
            ``backend``, ``precision``, ``check_finite``, ``max_batch_elements``,
            ``progress``). Default None.
        n_iters: iterations per solve (the maximum when ``tol`` is set). Default 1000.
        tol: marginal-error tolerance; None runs exactly ``n_iters`` iterations. Default 1e-3.
        check_every: iterations between convergence tests. Default 10.
        diameter: annealing start; default None: estimated from both datasets.
        {options}
        progress: tqdm progress bar while W is built (needs ``tqdm``). Default False.

    Returns:
        A 0-d tensor, float32 (float64 for float64 points).

    Raises:
        ValueError, TypeError: for invalid arguments, naming the argument.

    Examples:
        >>> import torch
        >>> from flashsinkhorn.otdd import otdd_distance
        >>> x1, l1 = torch.rand(60, 2, requires_grad=True), torch.arange(60) % 3
        >>> x2, l2 = torch.rand(40, 2) + 0.5, torch.arange(40) % 2
        >>> d = otdd_distance(x1, l1, x2, l2, eps=0.1)
        >>> d.backward()                               # moves the points of dataset 1
        >>> bool(d > 0), x1.grad.shape
        (True, torch.Size([60, 2]))
    """
    check_cloud("x1", x1)
    check_cloud("x2", x2)
    check_pair("x1", x1, "x2", x2)
    v1, v2 = check_num_classes(num_classes)
    V1 = check_labels("l1", l1, x1, v1)
    V2 = check_labels("l2", l2, x2, v2)
    a1c = check_class_weights("a1", a1, x1)
    a2c = check_class_weights("a2", a2, x2)
    _check_equal_mass(a1c, a2c, x1.dtype)
    if V.check_bool("check_finite", check_finite):
        check_finite_clouds(("x1", x1), ("x2", x2))
    fw = V.check_nonnegative("feature_weight", feature_weight)
    lw = V.check_nonnegative("label_weight", label_weight)
    differentiable_w = V.check_bool("differentiable_w", differentiable_w)
    progress = V.check_bool("progress", progress)
    # The outer solver options, checked before W is built.
    outer = public_options(locals())
    for k in ("feature_weight", "label_weight", "label_cost"):
        outer.pop(k, None)
    SinkhornOptions.build(**outer)

    if label_cost is None:
        opts = dict(outer, progress=progress)
        if w_options is not None:
            if not isinstance(w_options, dict):
                raise TypeError(f"w_options must be a dict or None, got {type(w_options)}")
            unknown = sorted(set(w_options) - set(_W_OPTIONS))
            if unknown:
                raise ValueError(
                    f"w_options got unknown keys {unknown}; allowed: {', '.join(_W_OPTIONS)}"
                )
            opts.update(w_options)
        with reported_as("otdd_distance"):
            label_cost = class_distance_matrix(
                x1, l1, x2, l2, a1=a1, a2=a2, num_classes=(V1, V2),
                differentiable=differentiable_w, **opts,
            )  # fmt: skip
    else:
        _check_label_cost(label_cost, V1 + V2, x1)
        if w_options is not None or differentiable_w:
            raise ValueError(
                "w_options and differentiable_w apply to a W built here; they must be left "
                "unset when label_cost is given"
            )
    return divergence(
        "otdd_distance", x1, x2, a1, a2, label_x=l1, label_y=l2.long() + V1,
        label_cost=label_cost, feature_weight=fw, label_weight=lw, **outer,
    )  # fmt: skip


def _check_equal_mass(a1: torch.Tensor | None, a2: torch.Tensor | None, dtype) -> None:
    """The outer divergence is balanced: a1 and a2 (None: uniform, mass 1) must carry the
    same mass, with the tolerance of the solver's own check, named here as a1 and a2."""
    if a1 is None and a2 is None:
        return
    masses = [1.0 if a is None else float(a.detach().double().sum()) for a in (a1, a2)]
    for name, mass in zip(("a1", "a2"), masses, strict=True):
        if not mass > 0:
            raise ValueError(f"{name} must have a positive total mass (all weights are zero)")
    gap = abs(masses[0] - masses[1]) / max(masses)
    rtol = 1e-6 if dtype == torch.float64 else 1e-4
    if gap > rtol:
        raise ValueError(
            f"a1 and a2 must have the same total mass (uniform weights have mass 1), got "
            f"{masses[0]:.6g} and {masses[1]:.6g} (relative gap {gap:.2e} > {rtol:g})"
        )


def _check_label_cost(W: object, size: int, x: torch.Tensor) -> None:
    if not isinstance(W, torch.Tensor):
        raise TypeError(
            f"label_cost must be a torch.Tensor (V1 + V2, V1 + V2) or None, got {type(W)}"
        )
    if not W.is_floating_point():
        raise TypeError(f"label_cost must have a real floating dtype, got {W.dtype}")
    if W.shape != (size, size):
        raise ValueError(
            f"label_cost must have shape (V1 + V2, V1 + V2) = ({size}, {size}) for the union "
            f"of the label sets, got {tuple(W.shape)}"
        )
    if W.device != x.device:
        raise ValueError(
            f"label_cost must be on the device of the points ({x.device}), got {W.device}"
        )
