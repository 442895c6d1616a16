"""Loop iterates from the torch backend, shared by the step tests."""

import torch

from flashsinkhorn.backends import TorchBackend


def torch_iterate(p, eps, k=3):
    """(f, g) after k torch-backend symmetric steps from zero (k = 0: zeros), in the dtype of
    the problem ``p``: the first a plain update, the others averaged, as in the loop."""
    tb = TorchBackend()
    f, g = torch.zeros_like(p.X.sq), torch.zeros_like(p.Y.sq)
    for i in range(k):
        al, w = (0.0, 1.0) if i == 0 else (0.5, 0.5)
        f, g, _, _ = tb.symmetric_step(p.X, p.Y, f, g, eps, al, w, w, False, "ieee")
    return f, g
