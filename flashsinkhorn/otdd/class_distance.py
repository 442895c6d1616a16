"""The class-to-class distance matrix W of OTDD, as a few batched solves.

Entry (k, l) is the debiased Sinkhorn divergence between the class-conditional clouds α_k and
α_l, S(α_k, α_l) = OT(α_k, α_l) − ½ OT(α_k, α_k) − ½ OT(α_l, α_l). The union of both label
sets indexes W (paper eq. 33): rows 0 .. V1-1 are the classes of dataset 1, rows
V1 .. V1+V2-1 those of dataset 2.

Every unordered pair k < l is solved once: the pairs of a block (within 1, across, within 2)
are sorted by class size and solved as batched (B, N, d) problems, each batch padded to its
own largest classes with zero-weight points and bounded by ``max_batch_elements``; the self
terms OT(α_k, α_k) are batched the same way, once per class.
"""

from __future__ import annotations

import torch

from .. import _validation as V
from .._convergence import SolveReport, warn_unconverged
from ..losses import ot_cost_reported
from ..option_table import document_options, may_anneal
from ..options import SinkhornOptions, public_options
from ..solvers import estimate_diameter
from ._labels import (
    Classes,
    check_class_weights,
    check_cloud,
    check_finite_clouds,
    check_labels,
    check_num_classes,
    check_pair,
    group_classes,
)

#: Default bound on B · N · d, the elements of one side of a batched solve (2^24 = 64 MiB of
#: fp32 per side; the solver keeps a few such copies, centred and rounded, per side).
MAX_BATCH_ELEMENTS = 1 << 24


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "progress=True needs the tqdm package: pip install tqdm "
            "(or pip install 'flashsinkhorn[examples]'), or pass progress=False"
        ) from exc
    return tqdm(total=total, desc="class distances", unit="batch")


def _plan(c1: Classes, c2: Classes, d: int, budget: int) -> list[tuple]:
    """Batched solves: ``(s, t, ii, jj, Ns, Nt)`` per batch, self terms first (t = None).

    Pairs k < l of the union are grouped by block (within dataset 1, across, within
    dataset 2) so that each batch reads its two sides straight from the caller's tensors;
    within a block they are sorted by size, and each batch is padded only to its own largest
    classes (Ns rows, Nt columns) and holds at most ``budget // (max(Ns, Nt) · d)`` problems.
    Indices are local to each dataset, on the CPU.
    """
    sets = (c1, c2)
    jobs = []
    for s, cs in enumerate(sets):
        counts = torch.tensor(cs.counts)
        ks = torch.argsort(counts, descending=True, stable=True)
        jobs += [
            (s, None, k, k, Ns, Ns) for k, Ns, _ in _batches(ks, ks, counts, counts, d, budget)
        ]
    for s in range(2):
        for t in range(s, 2):
            cs, ct = sets[s], sets[t]
            if s == t:
                ii, jj = torch.triu_indices(cs.V, cs.V, 1)
            else:
                ii, jj = torch.meshgrid(torch.arange(cs.V), torch.arange(ct.V), indexing="ij")
                ii, jj = ii.flatten(), jj.flatten()
            if ii.numel() == 0:
                continue
            cnt_s, cnt_t = torch.tensor(cs.counts), torch.tensor(ct.counts)
            size = torch.maximum(cnt_s[ii], cnt_t[jj])
            order = torch.argsort(size, descending=True, stable=True)
            ii, jj = ii[order], jj[order]
            for (ki, kj), Ns, Nt in _batches(ii, jj, cnt_s, cnt_t, d, budget, pairs=True):
                jobs.append((s, t, ki, kj, Ns, Nt))
    return jobs


def _batches(ii, jj, cnt_s, cnt_t, d: int, budget: int, pairs: bool = False):
    """Splits pairs sorted by decreasing size into batches within the element budget."""
    p = 0
    while p < ii.numel():
        first = max(int(cnt_s[ii[p]]), int(cnt_t[jj[p]]))
        per = max(1, budget // (first * d))
        ki, kj = ii[p : p + per], jj[p : p + per]
        Ns, Nt = int(cnt_s[ki].max()), int(cnt_t[kj].max())
        yield ((ki, kj) if pairs else ki), Ns, Nt
        p += per


@document_options()
def class_distance_matrix(
    x1: torch.Tensor,
    l1: torch.Tensor,
    x2: torch.Tensor,
    l2: torch.Tensor,
    *,
    eps: float,
    a1: torch.Tensor | None = None,
    a2: torch.Tensor | None = None,
    num_classes: tuple[int, int] | None = None,
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
    differentiable: bool = False,
    max_batch_elements: int | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Class-to-class distances W over the union of the label sets of two datasets.

    W[k, l] is the debiased Sinkhorn divergence S_eps(α_k, α_l) between the class-conditional
    distributions, with cost ‖x − y‖² (so W is in units of squared distance, like the feature
    term of the OTDD cost). Index layout (paper eq. 33)::

        W = [[W11, W12],      W11: (V1, V1) classes of dataset 1 against each other
             [W21, W22]]      W12: (V1, V2) class k of dataset 1 against class k' of
                              dataset 2, at W[k, V1 + k']; W21 = W12ᵀ; W22: (V2, V2)

    so class k of dataset 1 has index k and class k' of dataset 2 has index V1 + k' — the
    labels to pass with this W as ``label_cost`` are ``l1`` and ``l2 + V1`` (see
    :func:`augment_labels`). Labels are class indices: V1 = ``max(l1) + 1`` and V2 =
    ``max(l2) + 1`` unless ``num_classes`` is given, and every class must have a point.

    All pairs are solved as batched problems (one launch per half-step for a whole batch),
    the self terms OT(α_k, α_k) once per class; W is symmetric by construction with an exact
    zero diagonal, and negative round-off is clamped to 0.

    Args:
        x1: (n1, d) points of dataset 1.
        l1: (n1,) integer labels of dataset 1, in 0 .. V1-1.
        x2: (n2, d) points of dataset 2, same dtype and device as ``x1``.
        l2: (n2,) integer labels of dataset 2, in 0 .. V2-1.
        eps: entropic regularisation of the class problems (units of squared distance).
        a1: (n1,) non-negative weights of dataset 1; each class is renormalised to mass 1.
            Default None: uniform within each class.
        a2: (n2,) weights of dataset 2, the same way.
        num_classes: (V1, V2); default None: (max(l1) + 1, max(l2) + 1).
        n_iters: iterations per class problem (the maximum when ``tol`` is set). Default 1000.
        tol: marginal-error tolerance of every class problem (a batch stops when all of its
            problems pass); None runs exactly ``n_iters`` iterations. Default 1e-3.
        check_every: iterations between convergence tests. Default 10.
        {options}
        scaling: "auto" (default), None (fixed eps) or an annealing factor in (0, 1), as in
            :func:`flashsinkhorn.sinkhorn`; every class problem starts from the same diameter.
        diameter: the annealing start; default None: the bounding-box diagonal of both
            datasets.
        differentiable: False (default) computes W without an autograd graph. True keeps
            the graph, so W is differentiable w.r.t. ``x1``, ``x2`` (and ``a1``, ``a2``);
            the backward then holds the solver state of every batch until it runs:
            O(V² N d) memory, with N the largest class.
        max_batch_elements: bound on B · N · d per batched solve (B class pairs, N points
            in its largest padded class); the pairs are split into as many batches as needed
            (at least one pair each). Default None: 2^24.
        progress: show a tqdm progress bar over the batched solves (needs ``tqdm``).
            Default False.

    Returns:
        W, a (V1 + V2, V1 + V2) tensor in float32 (float64 for float64 points) on the
        points' device.

    Raises:
        ValueError, TypeError: for invalid arguments, naming the argument (labels of the
            wrong shape or dtype, empty classes, mismatched feature sizes, ...).
        ImportError: ``progress=True`` without tqdm installed.

    Examples:
        >>> import torch
        >>> from flashsinkhorn.otdd import class_distance_matrix
        >>> x1, l1 = torch.rand(60, 2), torch.arange(60) % 3     # 3 classes
        >>> x2, l2 = torch.rand(40, 2), torch.arange(40) % 2     # 2 classes
        >>> W = class_distance_matrix(x1, l1, x2, l2, eps=0.1)
        >>> W.shape, bool((W.diagonal() == 0).all()), torch.equal(W, W.T)
        (torch.Size([5, 5]), True, True)
    """
    check_cloud("x1", x1)
    check_cloud("x2", x2)
    check_pair("x1", x1, "x2", x2)
    v1, v2 = check_num_classes(num_classes)
    V1 = check_labels("l1", l1, x1, v1)
    V2 = check_labels("l2", l2, x2, v2)
    a1 = check_class_weights("a1", a1, x1)
    a2 = check_class_weights("a2", a2, x2)
    if V.check_bool("check_finite", check_finite):
        check_finite_clouds(("x1", x1), ("x2", x2))
    # The solver options, checked before anything runs.
    solver = SinkhornOptions.build(**public_options(locals()))
    eps, diameter = solver.eps, solver.diameter
    if max_batch_elements is None:
        max_batch_elements = MAX_BATCH_ELEMENTS
    max_batch_elements = V.check_int("max_batch_elements", max_batch_elements, 1)
    differentiable = V.check_bool("differentiable", differentiable)
    progress = V.check_bool("progress", progress)

    wdtype = torch.float64 if x1.dtype == torch.float64 else torch.float32
    c1 = group_classes("l1", l1, a1, V1, wdtype, "a1")
    c2 = group_classes("l2", l2, a2, V2, wdtype, "a2")
    if may_anneal(solver.scaling, solver.tol) and diameter is None:
        with torch.no_grad():
            diameter = estimate_diameter(x1.detach()[None], x2.detach()[None])
        diameter = diameter if diameter > 0 else None
    options = {**public_options(locals()), "diameter": diameter}

    d = x1.shape[1]
    sets = ((x1, c1, 0), (x2, c2, V1))
    jobs = _plan(c1, c2, d, max_batch_elements)
    bar = _progress_bar(len(jobs), progress)

    def gathered(s: int, k: torch.Tensor, N: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Rows are padded with their class's last point, so the first N columns hold every
        # point of the classes in ``k`` when N is their largest count.
        x, cs, _ = sets[s]
        k = k.to(x.device)
        return x[cs.index[k, :N]], cs.weight[k, :N]

    def advance():
        if bar is not None:
            bar.update(1)

    grad_ctx = torch.enable_grad() if differentiable else torch.no_grad()
    reports: list[SolveReport] = []

    own = solver.for_self_transport()
    self_options = {**options, "schedule": own.schedule, "acceleration": own.acceleration}

    def ot_cost(x, y, a, b, label):
        kw = self_options if label == "self terms" else options
        return ot_cost_reported(x, y, a, b, reports, label, **kw)[1]

    try:
        with grad_ctx:
            self_idx, self_val, self_ot = [], [], None
            rows, cols, vals = [], [], []
            for s, t, ii, jj, Ns, Nt in jobs:
                if t is None:  # self terms OT(α_k, α_k) of dataset s, once per class
                    xs, ws = gathered(s, ii, Ns)
                    self_val.append(ot_cost(xs, xs, ws, ws, "self terms"))
                    self_idx.append(ii.to(x1.device) + sets[s][2])
                    advance()
                    continue
                if self_ot is None:  # (V1 + V2,) in union order
                    self_ot = torch.cat(self_val).new_zeros(V1 + V2)
                    self_ot = self_ot.index_put((torch.cat(self_idx),), torch.cat(self_val))
                xs, ws = gathered(s, ii, Ns)
                xt, wt = gathered(t, jj, Nt)
                ot = ot_cost(xs, xt, ws, wt, "class pairs")
                gi = ii.to(x1.device) + sets[s][2]
                gj = jj.to(x1.device) + sets[t][2]
                vals.append(ot - 0.5 * (self_ot[gi] + self_ot[gj]))
                rows.append(gi)
                cols.append(gj)
                advance()
            # V1, V2 >= 1: the cross block always has a pair.
            upper = vals[0].new_zeros(V1 + V2, V1 + V2)
            upper = upper.index_put((torch.cat(rows), torch.cat(cols)), torch.cat(vals))
            W = (upper + upper.T).clamp_min(0.0)
    finally:
        if bar is not None:
            bar.close()
    warn_unconverged(
        "class_distance_matrix", reports, solver.n_iters, solver.tol, "batched Sinkhorn solve"
    )
    return W
