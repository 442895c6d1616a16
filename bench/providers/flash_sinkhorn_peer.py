"""Provider for the peer ``flash-sinkhorn`` 0.4.1 (PyPI; import ``flash_sinkhorn``).

Called through its public ``SamplesLoss`` with the full cost (``half_cost=False``, so
C = ||x - y||^2 and eps is the same number as ours), fixed eps without annealing
(``use_epsilon_scaling=False``), no debiasing, no early stop (``threshold=None``), TF32
allowed and its default autotuning on. CUDA only.

Iteration count, held at ``iters`` potential updates:

- ``flash-sinkhorn-sym``: its symmetric solver always does one full initial update, then
  one averaged update per entry of its eps list, then (default ``last_extrapolation=True``)
  one full final update. We pass ``n_iters = iters - 2``: 1 + (iters - 2) + 1 = iters
  fused symmetric steps -- the same count GeomLoss does in this bench.
- ``flash-sinkhorn-alt``: ``n_iters = iters`` alternating (f then g) iterations.

Batched inputs (B, n, d) go through its natural batched call, which loops over B in
Python.
"""

from __future__ import annotations

import torch
from ttt.providers.flash_peer import fixed_samples_loss

from . import Options, Provider
from ._timing import Timing, measure_first_call


def _import():
    import flash_sinkhorn

    return flash_sinkhorn


class FlashSinkhornPeer(Provider):
    """flash-sinkhorn 0.4.1, the FlashSinkhorn paper's package."""

    name = "flash-sinkhorn"

    def versions(self) -> dict:
        fsk = _import()
        return {"flash-sinkhorn": getattr(fsk, "__version__", "?")}

    def methods(self, kind: str, opts: Options) -> list[str]:
        if kind == "firstcall":
            return ["flash-sinkhorn-sym"]
        if kind == "hvp":
            return ["flash-sinkhorn-hvp"]
        return ["flash-sinkhorn-sym", "flash-sinkhorn-alt"]

    @staticmethod
    def _loss(fsk, method: str, opts: Options, potentials: bool):
        if opts.iters < 3 and method.endswith("-sym"):
            raise ValueError(
                "flash-sinkhorn-sym needs iters >= 3 (1 init + n_iters + 1 extrapolation)"
            )
        if method.endswith("-sym"):
            return fixed_samples_loss(
                fsk, opts.eps, opts.iters - 2, backend="symmetric", potentials=potentials,
                last_extrapolation=True,
            )  # fmt: skip
        return fixed_samples_loss(fsk, opts.eps, opts.iters, potentials=potentials)

    @staticmethod
    def _info(method: str, opts: Options) -> dict:
        if method.endswith("-sym"):
            return {
                "peer_n_iters": opts.iters - 2,
                "peer_note": "1 init + n_iters averaged + 1 extrapolation",
            }
        return {"peer_n_iters": opts.iters}

    def build(self, kind, method, x, y, a, b, opts: Options):
        fsk = _import()
        info = self._info(method, opts)
        if kind == "fwd":
            loss = self._loss(fsk, method, opts, potentials=True)

            def fn():
                return loss(a, x, b, y)

            def value_of(out):
                f, g = out
                v = (a.double() * f.double()).sum() + (b.double() * g.double()).sum()
                return {"value": float(v), **info}

            return fn, value_of

        loss = self._loss(fsk, method, opts, potentials=False)
        xg = x.detach().clone().requires_grad_(True)

        def fn():
            val = loss(a, xg, b, y)
            (gx,) = torch.autograd.grad(val.sum(), xg)
            return val.detach(), gx

        def value_of(out):
            return {"value": float(out[0].double().mean()), **info}

        return fn, value_of

    def run_item(self, case, size, method, opts: Options) -> dict:
        if case.kind == "hvp":
            return self._run_hvp(case, size, opts)
        if case.kind != "firstcall":
            return super().run_item(case, size, method, opts)

        def make_fn(fsk, x, y, a, b):
            loss = self._loss(fsk, method, opts, potentials=True)
            return lambda: loss(a, x, b, y)

        stats = measure_first_call(
            _import,
            make_fn,
            size,
            opts.device,
            Timing.quick(),
            second_factor=case.params.get("second_n_factor", 1.5),
        )
        stats.update(self._info(method, opts))
        return stats

    def _run_hvp(self, case, size, opts: Options) -> dict:
        """Its ``hvp_x_sqeuclid_from_potentials`` on the shared potentials (converted to its
        OTT convention), full cost (``cost_scale=1``), strict fp32 (``allow_tf32=False``),
        damping ``tau2`` (absolute: b̂ + eps·tau2), exactly ``cg_iters`` unpreconditioned CG
        iterations (``cg_rtol = cg_atol = 0``), autotuning on (its default; the first call,
        autotuning included, is ``first_call_s``). See bench/providers/_hvp.py."""
        from . import _hvp

        fsk = _import()

        def make_fn(x, y, a, b, A, res, cg_iters, tau):
            f_hat, g_hat = _hvp.ott_potentials(res, a, b)

            def fn():
                H, info = fsk.hvp_x_sqeuclid_from_potentials(
                    x,
                    y,
                    f_hat,
                    g_hat,
                    A,
                    eps=float(res.eps),
                    cost_scale=1.0,
                    tau2=tau,
                    max_cg_iter=cg_iters,
                    cg_rtol=0.0,
                    cg_atol=0.0,
                    allow_tf32=False,
                )
                return H, info.cg_iters

            return fn

        backend = "triton" if opts.device != "cpu" else "auto"  # its HVP itself is CUDA-only
        stats = _hvp.run_case(case, size, opts, make_fn, backend, "ieee")
        stats["peer_tau2"] = float(case.params.get("tau", _hvp.TAU))
        stats["peer_tau_relative_uniform"] = _hvp.peer_relative_tau(
            stats["peer_tau2"], opts.eps, size.m
        )
        stats["peer_note"] = (
            "hvp_x_sqeuclid_from_potentials, OTT potentials f+eps*log(a), cost_scale=1, "
            "allow_tf32=False, rtol=atol=0 (fixed count), damping b_hat + eps*tau2"
        )
        return stats


PROVIDER = FlashSinkhornPeer()
