"""Dense float64 reference solvers written independently of the library (NumPy/SciPy)."""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp


def cost(x, y):
    """(n, m) squared Euclidean cost in float64."""
    x = np.asarray(x, np.float64)
    y = np.asarray(y, np.float64)
    return ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)


def solve(x, y, a, b, eps, rho_x=None, rho_y=None, iters=20000, tol=1e-13):
    """Alternating log-domain Sinkhorn (optionally KL-relaxed) to float64 convergence.

    Returns (f, g, P) with P_ij = a_i b_j exp((f_i + g_j − C_ij)/eps).
    """
    return solve_cost(cost(x, y), a, b, eps, rho_x, rho_y, iters, tol)


def solve_cost(C, a, b, eps, rho_x=None, rho_y=None, iters=20000, tol=1e-13):
    """:func:`solve` for a given (n, m) cost matrix C."""
    C = np.asarray(C, np.float64)
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    with np.errstate(divide="ignore"):  # zero weights: log-weight -inf, as intended
        la, lb = np.log(a), np.log(b)
    lam_x = 1.0 if rho_x is None else rho_x / (rho_x + eps)
    lam_y = 1.0 if rho_y is None else rho_y / (rho_y + eps)
    f = np.zeros(len(a))
    g = np.zeros(len(b))
    for _ in range(iters):
        f_new = -lam_x * eps * logsumexp(lb[None, :] + (g[None, :] - C) / eps, axis=1)
        g_new = -lam_y * eps * logsumexp(la[:, None] + (f_new[:, None] - C) / eps, axis=0)
        delta = max(np.abs(f_new - f).max(), np.abs(g_new - g).max())
        f, g = f_new, g_new
        if delta < tol:
            break
    P = np.exp(la[:, None] + lb[None, :] + (f[:, None] + g[None, :] - C) / eps)
    return f, g, P


def kl(p, q):
    """Generalised KL divergence Σ p log(p/q) − p + q (0 log 0 = 0)."""
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(p > 0, p * np.log(p / q), 0.0)
    return float(t.sum() - p.sum() + q.sum())


def primal(x, y, a, b, P, eps, rho_x=None, rho_y=None):
    """Primal objective <C, P> + eps KL(P | a⊗b) + rho KL(P1 | a) + rho KL(Pᵀ1 | b)."""
    C = cost(x, y)
    val = float((C * P).sum()) + eps * kl(P, np.outer(a, b))
    if rho_x is not None:
        val += rho_x * kl(P.sum(1), a)
    if rho_y is not None:
        val += rho_y * kl(P.sum(0), b)
    return val


def softmin(x_rows, y_cols, w_cols, pot_cols, eps):
    """T_i = −eps log Σ_j w_j exp((p_j − ‖x_i − y_j‖²)/eps), float64."""
    C = cost(x_rows, y_cols)
    return -eps * logsumexp(np.log(w_cols)[None, :] + (pot_cols[None, :] - C) / eps, axis=1)
