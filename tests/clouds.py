"""Random weighted clouds shared by the test modules."""

import torch


def weighted_clouds(n=37, m=29, d=3, B=None, seed=0, dtype=torch.float64):
    """(x, y, a, b): x uniform in the unit cube, y shrunk and shifted (the clouds overlap
    partly), positive weights normalised to 1; (B, …)-batched when B is given."""
    g = torch.Generator().manual_seed(seed)
    lead = () if B is None else (B,)
    x = torch.rand(*lead, n, d, generator=g, dtype=dtype)
    y = torch.rand(*lead, m, d, generator=g, dtype=dtype) * 0.8 + 0.3
    a = torch.rand(*lead, n, generator=g, dtype=dtype) + 0.2
    b = torch.rand(*lead, m, generator=g, dtype=dtype) + 0.2
    return x, y, a / a.sum(-1, keepdim=True), b / b.sum(-1, keepdim=True)
