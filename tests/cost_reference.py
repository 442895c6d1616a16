"""Dense float64 references for the costs of docs/costs.md, written from the definitions
(independent of flashsinkhorn's point transforms and kernels)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import logsumexp


def feature_cost(x, y, cost="sqeuclidean", L=None, weight=1.0):
    """(n, m) float64 torch cost c(Lx, Ly) times weight; differentiable in x and y."""
    x = x.to(torch.float64)
    y = y.to(torch.float64)
    if L is not None:
        L = L.to(torch.float64)
        x, y = (x * L, y * L) if L.dim() == 1 else (x @ L.T, y @ L.T)
    diff = x[:, None, :] - y[None, :, :]
    if cost == "sqeuclidean":
        C = (diff**2).sum(-1)
    elif cost == "euclidean":
        C = (diff**2).sum(-1).sqrt()
    else:
        nx = x.norm(dim=-1, keepdim=True)
        ny = y.norm(dim=-1, keepdim=True)
        C = 1.0 - (x / nx) @ (y / ny).T
    return weight * C


def full_cost(x, y, cost="sqeuclidean", L=None, fw=1.0, lx=None, ly=None, W=None, lw=1.0):
    C = feature_cost(x, y, cost, L, fw)
    if W is not None:
        C = C + lw * W.to(torch.float64)[lx.long()[:, None], ly.long()[None, :]]
    return C


def solve_cost(C, a, b, eps, iters=50000, tol=1e-14):
    """Alternating log-domain Sinkhorn on a dense cost (float64). Returns (f, g, P, value)."""
    C = np.asarray(C, np.float64)
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    la, lb = np.log(a), np.log(b)
    f = np.zeros(len(a))
    g = np.zeros(len(b))
    for _ in range(iters):
        f_new = -eps * logsumexp(lb[None, :] + (g[None, :] - C) / eps, axis=1)
        g_new = -eps * logsumexp(la[:, None] + (f_new[:, None] - C) / eps, axis=0)
        delta = max(np.abs(f_new - f).max(), np.abs(g_new - g).max())
        f, g = f_new, g_new
        if delta < tol:
            break
    P = np.exp(la[:, None] + lb[None, :] + (f[:, None] + g[None, :] - C) / eps)
    return f, g, P, float(a @ f + b @ g)


def envelope_grads(x, y, P, **cost_kw):
    """(∇_x, ∇_y) of <P, C(x, y)> at a fixed plan P: the envelope gradient of OT_eps."""
    x = x.detach().to(torch.float64).requires_grad_(True)
    y = y.detach().to(torch.float64).requires_grad_(True)
    C = full_cost(x, y, **cost_kw)
    val = (torch.as_tensor(P) * C).sum()
    return torch.autograd.grad(val, (x, y))


def label_grad(P, lx, ly, V, lw=1.0):
    """(V, V) Σ_{i: lx_i = k, j: ly_j = l} P_ij · lw."""
    G = np.zeros((V, V))
    np.add.at(G, (np.asarray(lx)[:, None], np.asarray(ly)[None, :]), np.asarray(P))
    return lw * G
