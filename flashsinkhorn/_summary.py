"""The one-line text of a :class:`~flashsinkhorn.SinkhornResult` (its ``repr``).

It shows what a user checks first: the value, the iterations (annealing apart), the marginal
error and whether the solve converged. It reads only what the solve already knows: the error
of the returned plan when the convergence test passed, else the last tested one, so that
printing a result never runs a pass over the plan (nor raises where the plan cannot be read).
"""

from __future__ import annotations

import torch


def _numbers(v) -> list[float]:
    if isinstance(v, torch.Tensor):
        v = v.detach()
    return torch.as_tensor(v).reshape(-1).tolist()


def _show(v, batched: bool) -> str:
    vals = _numbers(v)
    if not batched:
        return f"{vals[0]:.6g}"
    if not vals:
        return "[]"
    return f"[{len(vals)} values in {min(vals):.6g} .. {max(vals):.6g}]"


def summary(res) -> str:
    """``SinkhornResult(value=…, n_iters=…, marginal_error=…, converged=…, …)``."""
    batched = res.f.ndim > 1
    n, k = res.n_iters, res.n_annealing
    iters = f"{n} ({k} annealing + {n - k} at eps)" if k else f"{n}"
    if res._error is not None:
        if batched:
            error = f"max {max(_numbers(res._error)):.3g}"
        else:
            error = f"{_numbers(res._error)[0]:.3g}"
        error = f"marginal_error={error}"
    elif res.errors:
        it, e = res.errors[-1]
        error = f"last_tested_error={e:.3g} (iteration {it})"
    else:
        error = "marginal_error=not tested (read .marginal_error)"
    shape = tuple(res.f.shape)
    return (
        f"SinkhornResult(value={_show(res.value, batched)}, eps={res.eps:g}, n_iters={iters}, "
        f"{error}, converged={res.converged}, f: {shape}, backend={res.backend!r}, "
        f"path={res.path!r}, precision={res.precision!r})"
    )
