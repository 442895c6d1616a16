"""Shared set-up of the ``hvp`` case: one problem, one direction, one set of potentials.

Every provider of the case differentiates the *same* plan: the potentials come from one
converged strict-fp32 solve of this library (``precision="ieee"``, outside the timed region)
on the protocol inputs of the size, and the direction A ~ N(0, 1) is drawn from a generator
seeded by the size. So the HVPs of the providers can be compared entry by entry.

What is compared (Hessian of OT_eps(x, y) with respect to x, full cost ‖x − y‖², eps = 0.1):

- ours: ``TransportHessian(res).apply(A)`` from the solve's potentials -- induced marginals,
  P y, the Schur CG and the explicit terms, all inside the timed call (nothing cached
  between calls), Jacobi-preconditioned CG on S + tau·diag(b̂) (tau *relative*).
- flash-sinkhorn 0.4.1: ``hvp_x_sqeuclid_from_potentials`` with OTT-style potentials
  f̂ = f + eps log a, ĝ = g + eps log b (its convention), ``cost_scale=1`` (full cost), its
  damping b̂ + eps·tau2 (tau2 *absolute*: eps·tau2/b̂_j ≈ eps·tau2·m relative, 1e-2 at
  m = 10⁴ for tau2 = 1e-5), unpreconditioned CG, strict fp32 (``allow_tf32=False``).

Both run exactly ``cg_iters`` CG iterations (ours: ``cg_tol=1e-30``; the peer:
``cg_rtol = cg_atol = 0``). Each row reports ``value`` = <A, H A> / <A, A> and
``rel_err_ref`` = ‖H A − H* A‖ / ‖H* A‖ against ours at tau = 0 with CG run to a true
relative residual of 1e-5 (cap 2000 iterations) on the same potentials.
"""

from __future__ import annotations

import math

import torch

#: defaults of the case (bench/cases.py may override them through ``case.params``)
CG_ITERS = 50
TAU = 1e-5
#: the converged solve that provides the potentials
SOLVE = {"tol": 1e-5, "n_iters": 2000, "precision": "ieee"}
#: the reference the rows are compared with
REF = {"tau": 0.0, "cg_tol": 1e-5, "cg_max_iter": 2000}


def setup(size, device: str, backend: str, eps: float, precision: str = "ieee"):
    """Inputs, direction and converged potentials.

    Returns ``(x, y, a, b, A, res_ref, res, solve_info)``: ``res_ref`` is the strict-fp32
    solve every provider shares; ``res`` is the solve at ``precision`` (the same object for
    ``"ieee"``; ours at ``"tf32"`` differentiates the plan of its own TF32 solve).
    """
    from cases import make_inputs, seed_for

    import flashsinkhorn as fs

    x, y, a, b = make_inputs(size, device)
    gen = torch.Generator().manual_seed(seed_for(size) + 1)
    A = torch.randn(size.n, size.d, generator=gen, dtype=torch.float64).to(torch.float32)
    A = A.contiguous().to(device)
    res_ref = fs.sinkhorn(x, y, a, b, eps=eps, backend=backend, **SOLVE)
    res = res_ref
    if precision != SOLVE["precision"]:
        opts = {**SOLVE, "precision": precision}
        res = fs.sinkhorn(x, y, a, b, eps=eps, backend=backend, **opts)
    info = {
        "solve_iters": int(res.n_iters),
        "solve_converged": bool(res.converged),
        "solve_marginal_error": float(res.marginal_error),
        "solve_precision": precision,
    }
    return x, y, a, b, A, res_ref, res, info


def ours_hvp(res, A, *, tau: float, cg_iters: int | None, cg_tol: float = 1e-30):
    """HVP w.r.t. x from the potentials of ``res``: ``(H A (n, d), CGInfo)``."""
    from flashsinkhorn.hessian import TransportHessian

    th = TransportHessian(res)
    Hx, _, info, _ = th.apply(
        A[None],
        None,
        want_y=False,
        tau=tau,
        cg_tol=cg_tol,
        cg_max_iter=cg_iters if cg_iters is not None else REF["cg_max_iter"],
    )
    return Hx[0], info


def reference(res, A):
    """H* A: ours at tau = 0, CG to a true relative residual of ``REF['cg_tol']``."""
    H, info = ours_hvp(res, A, tau=REF["tau"], cg_iters=REF["cg_max_iter"], cg_tol=REF["cg_tol"])
    return H, {
        "ref_cg_iters": int(info.iters),
        "ref_residual": float(info.residual.max()),
        "ref_note": "ours, tau=0, CG to true rel. residual 1e-5 (cap 2000), same potentials",
    }


def compare(H: torch.Tensor, A: torch.Tensor, H_ref: torch.Tensor | None) -> dict:
    """``value`` = <A, HA>/<A, A> and the relative error against the reference."""
    H64, A64 = H.double(), A.double()
    out = {
        "value": float((A64 * H64).sum() / (A64 * A64).sum()),
        "hvp_norm": float(H64.norm()),
        "finite": bool(torch.isfinite(H64).all()),
    }
    if H_ref is not None:
        R = H_ref.double()
        out["rel_err_ref"] = float((H64 - R).norm() / R.norm())
    return out


def ott_potentials(res, a, b):
    """flash-sinkhorn's (OTT) convention: P = exp((f̂ + ĝ − C)/eps), f̂ = f + eps log a."""
    eps = float(res.eps)
    f = res.f.float() + eps * torch.log(a.float())
    g = res.g.float() + eps * torch.log(b.float())
    return f.contiguous(), g.contiguous()


def run_case(case, size, opts, make_fn, backend: str, precision: str = "ieee") -> dict:
    """Set up, time ``make_fn(x, y, a, b, A, res, cg_iters, tau)()`` (returns ``(H, iters)``)
    with the protocol of bench/README.md, then compare its output with the reference."""
    from ._timing import measure_torch, release

    cg_iters = int(case.params.get("cg_iters", CG_ITERS))
    tau = float(case.params.get("tau", TAU))
    x, y, a, b, A, res_ref, res, info = setup(size, opts.device, backend, opts.eps, precision)
    fn = make_fn(x, y, a, b, A, res, cg_iters, tau)
    stats, out = measure_torch(fn, opts.device, opts.timing)
    H, iters_run = out
    del out
    release(opts.device)
    H_ref, ref_info = reference(res_ref, A)
    stats.update(compare(H, A, H_ref))
    stats.update(info)
    stats.update(ref_info)
    stats.update({"iters": cg_iters, "cg_iters_run": int(iters_run), "tau": tau})
    return stats


def peer_relative_tau(tau2: float, eps: float, m: int) -> float:
    """The peer's absolute damping eps·tau2 relative to a uniform b̂ = 1/m."""
    return eps * tau2 * m if m > 0 else math.nan
