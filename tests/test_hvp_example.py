"""The parameter Hessian of examples/shuffled_regression.py (25 HVPs in one batched CG) against
the library's double backward and finite differences of the gradient."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "shuffled_regression.py"


@pytest.fixture(scope="module")
def sr():
    pytest.importorskip("scipy")
    spec = importlib.util.spec_from_file_location("shuffled_regression", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SOLVE = dict(eps=0.5, scaling=0.9**0.5, tol=1e-11, n_iters=100000, schedule="alternating",
             backend="torch", precision="ieee")  # fmt: skip


@pytest.mark.parametrize("tau", [0.0, 1e-3])
def test_block_hessian_matches_double_backward(sr, tau):
    X, Y, _, W0 = sr.make_data(60, 5, seed=3)
    obj = sr.Objective(X, Y, SOLVE, dict(tau=tau, cg_tol=1e-12, cg_max_iter=5000))
    _, _, th = obj.evaluate(W0)
    H, info = obj.hessian(th)
    assert H.shape == (25, 25) and info.converged
    for k in (0, 7, 24):
        col = obj.hvp_double_backward(W0, k)
        assert np.linalg.norm(H[:, k] - col) <= 1e-8 * np.linalg.norm(col)
    assert abs(sr.lambda_min(H) - np.linalg.eigvalsh(H)[0]) <= 1e-8 * np.abs(H).max()


def test_block_hessian_and_gradient_vs_finite_differences(sr):
    X, Y, _, W0 = sr.make_data(50, 5, seed=4)
    obj = sr.Objective(X, Y, SOLVE, dict(tau=0.0, cg_tol=1e-12, cg_max_iter=5000))
    L, g, th = obj.evaluate(W0)
    H, _ = obj.hessian(th)
    h, cols = 1e-5, [0, 6, 12, 18, 24]
    fd_H, fd_g = np.zeros((25, len(cols))), np.zeros(len(cols))
    for i, k in enumerate(cols):
        E = torch.zeros(25, dtype=torch.float64)
        E[k] = h
        E = E.reshape(5, 5)
        Lp, gp, _ = obj.evaluate(W0 + E)
        Lm, gm, _ = obj.evaluate(W0 - E)
        fd_H[:, i] = ((gp - gm) / (2 * h)).reshape(-1).numpy()
        fd_g[i] = (Lp - Lm) / (2 * h)
    assert np.linalg.norm(g.reshape(-1).numpy()[cols] - fd_g) <= 1e-6 * np.linalg.norm(fd_g)
    assert np.linalg.norm(H[:, cols] - fd_H) <= 1e-5 * np.linalg.norm(fd_H)
