"""Provider for this library, ``flashsinkhorn``.

Methods ``flashsinkhorn-{sym,alt}-{precision}``: symmetric (averaged Jacobi) or alternating
(Gauss-Seidel) schedule, exactly ``n_iters`` iterations (``tol=None``), full squared-
Euclidean cost at ``eps``. Forward: ``flashsinkhorn.sinkhorn``; fwd+bwd and batched:
``flashsinkhorn.ot_cost`` and its gradient with respect to x.
"""

from __future__ import annotations

import torch

from . import Options, Provider
from ._timing import Timing, is_cuda, measure_first_call

SCHEDULES = {"sym": "symmetric", "alt": "alternating"}
#: precisions of the ``hvp`` case (``flashsinkhorn-hvp-<precision>``)
HVP_PRECISIONS = ("ieee", "tf32x3", "tf32")


#: ``fwd`` methods with other costs (docs/costs.md), measured at n = m = 10,000, d = 64 only:
#: ``flashsinkhorn-cost-<name>-<precision>`` with the symmetric schedule.
COST_METHODS = {
    "euclidean": dict(cost="euclidean"),
    "cosine": dict(cost="cosine"),
    "mahalanobis": dict(feature_map="diag"),
    # OTDD label term with V = 10 classes per cloud (W staged on chip).
    "labels": dict(labels=10),
}
COST_SIZES = ((10_000, 64),)


def _cost_options(name: str, n: int, m: int, d: int, device) -> dict:
    opts = dict(COST_METHODS[name])
    if opts.get("feature_map") == "diag":
        g = torch.Generator(device="cpu").manual_seed(d)
        opts["feature_map"] = (torch.rand(d, generator=g) + 0.5).to(device)
    if "labels" in opts:
        V = opts.pop("labels")
        g = torch.Generator(device="cpu").manual_seed(V)
        opts["label_cost"] = torch.rand(V, V, generator=g).to(device)
        opts["label_x"] = torch.randint(0, V, (n,), generator=g).to(device)
        opts["label_y"] = torch.randint(0, V, (m,), generator=g).to(device)
    return opts


def _import():
    import flashsinkhorn

    return flashsinkhorn


def _parse(method: str) -> tuple[str, str]:
    # flashsinkhorn-<sched>-<precision>
    _, sched, precision = method.split("-", 2)
    return SCHEDULES[sched], precision


class Ours(Provider):
    """``flashsinkhorn`` (this repository)."""

    name = "ours"

    def versions(self) -> dict:
        fs = _import()
        return {"flashsinkhorn": getattr(fs, "__version__", "dev")}

    def methods(self, kind: str, opts: Options) -> list[str]:
        if kind == "firstcall":
            return ["flashsinkhorn-sym-tf32"]
        if kind == "hvp":  # strict fp32 is the reference protocol; TF32 as a second method
            return [f"flashsinkhorn-hvp-{p}" for p in HVP_PRECISIONS]
        out = [f"flashsinkhorn-{s}-{p}" for s in SCHEDULES for p in opts.precisions]
        if kind == "fwd":
            out += [f"flashsinkhorn-cost-{c}-tf32" for c in COST_METHODS]
        return out

    def _backend(self, opts: Options) -> str:
        if opts.ours_backend:
            return opts.ours_backend
        return "triton" if is_cuda(opts.device) else "auto"

    def _solve_fn(self, fs, schedule, precision, x, y, a, b, opts: Options):
        backend = self._backend(opts)

        def fn():
            return fs.sinkhorn(
                x,
                y,
                a,
                b,
                eps=opts.eps,
                n_iters=opts.iters,
                tol=None,
                schedule=schedule,
                backend=backend,
                precision=precision,
            )

        return fn

    def build(self, kind, method, x, y, a, b, opts: Options):
        fs = _import()
        if method.startswith("flashsinkhorn-cost-"):
            return self._build_cost(fs, method, x, y, a, b, opts)
        schedule, precision = _parse(method)
        if kind == "fwd":
            fn = self._solve_fn(fs, schedule, precision, x, y, a, b, opts)

            def value_of(res):
                info = {"value": float(res.value)}
                n_it = getattr(res, "n_iters", None)
                if n_it is not None:
                    info["iters_run"] = int(n_it)
                for attr in ("path", "method", "backend"):  # which path the library took
                    v = getattr(res, attr, None)
                    if isinstance(v, str):
                        info[f"ours_{attr}"] = v
                return info

            return fn, value_of

        xg = x.detach().clone().requires_grad_(True)

        def fn():
            loss = fs.ot_cost(
                xg,
                y,
                a,
                b,
                eps=opts.eps,
                n_iters=opts.iters,
                tol=None,
                schedule=schedule,
                precision=precision,
            )
            (gx,) = torch.autograd.grad(loss.sum(), xg)
            return loss.detach(), gx

        def value_of(out):
            return float(out[0].double().mean())

        return fn, value_of

    def _build_cost(self, fs, method, x, y, a, b, opts: Options):
        _, _, name, precision = method.split("-", 3)
        n, d = x.shape[-2], x.shape[-1]
        if is_cuda(opts.device) and (n, d) not in COST_SIZES:
            raise ValueError(f"{method} is measured at n = m = 10,000, d = 64 only")
        extra = _cost_options(name, n, y.shape[-2], d, x.device)
        backend = self._backend(opts)

        def fn():
            return fs.sinkhorn(
                x, y, a, b, eps=opts.eps, n_iters=opts.iters, tol=None, schedule="symmetric",
                backend=backend, precision=precision, **extra,
            )  # fmt: skip

        def value_of(res):
            return {"value": float(res.value), "iters_run": int(res.n_iters), "cost": name}

        return fn, value_of

    def run_item(self, case, size, method, opts: Options) -> dict:
        if case.kind == "hvp":
            return self._run_hvp(case, size, method, opts)
        if case.kind != "firstcall":
            return super().run_item(case, size, method, opts)
        schedule, precision = _parse(method)

        def make_fn(fs, x, y, a, b):
            return self._solve_fn(fs, schedule, precision, x, y, a, b, opts)

        return measure_first_call(
            _import,
            make_fn,
            size,
            opts.device,
            Timing.quick(),
            second_factor=case.params.get("second_n_factor", 1.5),
        )

    def _run_hvp(self, case, size, method, opts: Options) -> dict:
        """HVP w.r.t. x from converged potentials (bench/providers/_hvp.py): the timed call
        builds the plan's cache (induced marginals, P y) and runs exactly ``cg_iters`` CG
        iterations (``cg_tol=1e-30``, so the tolerance never stops it)."""
        from . import _hvp

        precision = method.rsplit("-", 1)[1]

        def make_fn(x, y, a, b, A, res, cg_iters, tau):
            def fn():
                H, info = _hvp.ours_hvp(res, A, tau=tau, cg_iters=cg_iters)
                return H, info.iters

            return fn

        stats = _hvp.run_case(case, size, opts, make_fn, self._backend(opts), precision)
        stats["ours_precision"] = precision
        return stats


PROVIDER = Ours()
