"""Where the time of one OT coupling goes: setup, solve (iterations × time per iteration) and
sampling, beside the floor of each configuration.

``couple_indices(x0, x1)`` runs, in order: the cost-scale read (mean squared distance, the
bound of the largest distance, one synchronisation), the path choice, ``engine.bind``
(``prepare``: centring, operand copies, the statistics read; the Gram matrix x0·x1ᵀ on the
dense path; the eps ladder and range checks), ``engine.run`` (the solver loop: annealing
steps, then iterations with a convergence test every ``check_every``), then the draws: the
row marginal and ``torch.multinomial``, and the Gumbel-max column sweep. This script runs
the same steps one by one, with a CUDA event at each boundary on the current stream, so
each phase's time includes the host work and synchronisations inside it; it also times the
public call as a whole. Same data, eps (0.01 × the mean squared distance, couple's
default), tolerance (1e-3) and floors as ``bench_coupling.py``.

Usage (GPU)::

    python bench/profile_coupling.py                      # 4096, 16384, 65536 × d = 3072, 2
    python bench/profile_coupling.py --sizes 4096 --dims 3072 --reps 5
    python bench/profile_coupling.py --device cpu --sizes 512 --dims 64   # smoke test

Prints one line per (n, d): milliseconds of each phase (median over ``--reps`` calls after
one warm-up call that compiles the kernels), iterations (of which annealing), ms per
iteration, the whole public call, and the floor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench_coupling as bc  # noqa: E402  (the protocol's data and floors)

PHASES = ("scale", "bind", "solve", "marginal", "draws")


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="4096,16384,65536", help="comma-separated n = m")
    ap.add_argument("--dims", default="3072,2", help="comma-separated d")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per configuration")
    ap.add_argument("--mode", default="entropic", choices=("entropic", "exact", "unbalanced"))
    ap.add_argument("--path", default="auto", help="auto, dense or streaming")
    ap.add_argument("--check-every", type=int, default=None, help="solver test interval")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    return ap.parse_args()


class Marks:
    """Boundaries of the phases: CUDA events on the current stream, or host clocks."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.points = []

    def mark(self):
        import torch

        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.points.append(e)
        else:
            self.points.append(time.perf_counter())

    def spans(self) -> list[float]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.points, self.points[1:], strict=False)]
        return [1e3 * (b - a) for a, b in zip(self.points, self.points[1:], strict=False)]


def coupling_phases(x0, x1, args) -> tuple[list[float], dict]:
    """One coupling, step by step as ``couple_indices`` runs it: (ms per phase, facts)."""
    import torch

    from flashsinkhorn import engine, limits
    from flashsinkhorn.backends import transient_path
    from flashsinkhorn.costs import transform_points
    from flashsinkhorn.coupling.minibatch import cost_scale, default_eps
    from flashsinkhorn.coupling.sampling import draw_columns, draw_rows
    from flashsinkhorn.options import SinkhornOptions

    marks = Marks(x0.is_cuda)
    with torch.no_grad():
        marks.mark()
        cs = cost_scale(x0, x1)
        eps = default_eps(args.mode, cs.msd, cs.box2, x0.dtype)
        rho = cs.msd if args.mode == "unbalanced" else None
        path = transient_path(x0, x1, "auto") if args.path == "auto" else args.path
        marks.mark()
        kw = {} if args.check_every is None else {"check_every": args.check_every}
        opts = SinkhornOptions.build(x0, x1, eps=eps, rho_x=rho, rho_y=rho, tol=1e-3,
                                     n_iters=1000, path=path, diameter=cs.diameter,
                                     check_finite=False, **kw)  # fmt: skip
        x, y = transform_points(x0, opts.cost), transform_points(x1, opts.cost)
        bd = engine.bind(x, y, None, None, opts)
        marks.mark()
        state, value = engine.run(bd.problem, bd.backend, bd.eps_list, bd.opts)
        res = engine.finish(bd.problem, bd.backend, state, value, bd.opts)
        marks.mark()
        limits.check_plan(res.solution.problem, res.eps, "sampling from the plan")
        gen = torch.Generator(device=x0.device).manual_seed(0)
        rows = draw_rows(res, x0.shape[0], True, gen)
        marks.mark()
        draw_columns(res, rows, gen)
        marks.mark()
    facts = {"n_iters": res.n_iters, "n_annealing": res.n_annealing, "path": res.path,
             "ladder": len(bd.eps_list), "eps": res.eps}  # fmt: skip
    return marks.spans(), facts


def profile(n: int, d: int, args) -> dict:

    import flashsinkhorn as fs

    x0, x1 = bc._data(n, d)
    t0 = time.perf_counter()
    coupling_phases(x0, x1, args)  # compilation, first-call work
    # a configuration that takes seconds (a streaming path at 65,536², d = 3072) runs once
    reps = args.reps if time.perf_counter() - t0 < 5.0 else 1
    runs = [coupling_phases(x0, x1, args) for _ in range(reps)]
    ms = [statistics.median(r[0][k] for r in runs) for k in range(len(PHASES))]
    facts = runs[-1][1]
    kw = {"mode": args.mode, "replace": True}
    if args.path != "auto":
        kw["path"] = args.path
    call = lambda: fs.couple_indices(x0, x1, seed=0, **kw)  # noqa: E731
    whole, _ = bc._timed(call, reps, 10.0)
    floor = bc._floor(n, d, facts["n_iters"], facts["path"] == "dense")
    return {"n": n, "d": d, **dict(zip(PHASES, ms, strict=True)), **facts, "whole": whole,
            **floor}  # fmt: skip


def main():
    args = _parse()
    import torch

    bc.DEVICE = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_coupling.py needs a CUDA device (or --device cpu)")
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{gpu}; mode {args.mode}, path {args.path}; ms, median of {args.reps} calls")
    print(f"{'n':>6} {'d':>5} {'scale':>7} {'bind':>7} {'solve':>8} {'its':>7} {'ms/it':>7} "
          f"{'marg':>7} {'draws':>7} {'sum':>8} {'couple':>8} {'floor':>7}  path")  # fmt: skip
    t0 = time.perf_counter()
    for d in [int(s) for s in args.dims.split(",")]:
        for n in [int(s) for s in args.sizes.split(",")]:
            r = profile(n, d, args)
            if args.device == "cuda":
                torch.cuda.empty_cache()
            total = sum(r[p] for p in PHASES)
            its = f"{r['n_iters']}({r['n_annealing']})"
            per = r["solve"] / max(r["n_iters"], 1)
            print(f"{n:6d} {d:5d} {r['scale']:7.2f} {r['bind']:7.2f} {r['solve']:8.2f} "
                  f"{its:>7} {per:7.3f} {r['marginal']:7.2f} {r['draws']:7.2f} {total:8.2f} "
                  f"{r['whole']:8.2f} {r['floor_ms']:7.2f}  {r['path']}", flush=True)  # fmt: skip
    print(f"scale: cost-scale read and path choice; bind: prepare (+ Gram matrix on the dense "
          f"path), ladder, range checks; solve: the loop, its(annealing of them); marg: row "
          f"marginal + multinomial; draws: Gumbel-max column sweep; couple: the public call "
          f"as a whole. {time.perf_counter() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
