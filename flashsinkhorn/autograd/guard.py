"""Makes a second derivative through our first-order backward fail loudly.

The backward passes compute gradients from the plan without recording a graph, so a
gradient of those gradients would silently miss the dependence of the plan on the inputs.
When the backward runs with ``create_graph=True`` every gradient it returns is routed through
a node whose own backward raises, so a double backward (or a gradient penalty) stops with a
clear message instead of returning a wrong value. Without ``create_graph`` this costs nothing.
"""

from __future__ import annotations

import torch

SECOND_ORDER_MESSAGE = (
    "flashsinkhorn: these second derivatives (double backward, create_graph=True then grad "
    "again) are not available: only the losses of a balanced squared-Euclidean problem "
    "(ot_cost, sinkhorn_divergence, SinkhornDivergence, SamplesLoss with p=2 and no reach) "
    "differentiate their x and y gradients again, and only once; flashsinkhorn.hvp "
    "gives Hessian-vector products of OT_eps and of the Sinkhorn divergence. The first-order "
    "gradient is exact, but differentiating it again here would silently ignore how the "
    "transport plan depends on the inputs, so it is refused."
)


class _NoSecondOrder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grad, *anchors):
        return grad.clone()

    @staticmethod
    def backward(ctx, *grad_outputs):
        raise RuntimeError(SECOND_ORDER_MESSAGE)


def guard_second_order(grads, anchors):
    """Returns ``grads`` unchanged, or wrapped in a raising node when a graph is being built.

    Args:
        grads: tuple of gradients (tensors or None) returned by a backward.
        anchors: tensors that require grad (the Function's inputs); the guard node hangs from
            them so that it is reached by any further differentiation.
    """
    if not torch.is_grad_enabled():
        return grads
    live = [t for t in anchors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not live:
        return grads
    return tuple(None if g is None else _NoSecondOrder.apply(g, *live) for g in grads)
