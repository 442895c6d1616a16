"""Times one large OT problem on one GPU and sharded over several (flashsinkhorn.distributed).

One command per GPU count runs that count's part of the suite (``--suite``); the one-GPU
part runs without torchrun:

    python bench/bench_distributed.py --suite --out bench/results/distributed.json
    torchrun --standalone --nproc-per-node=2 bench/bench_distributed.py --suite \
        --out bench/results/distributed.json
    torchrun --standalone --nproc-per-node=4 bench/bench_distributed.py --suite \
        --out bench/results/distributed.json
    python bench/bench_distributed.py --table bench/results/distributed.json

The suite for W GPUs (n = m, d = 64, float32 normal clouds, y shifted by 0.5, default
precision: the TF32 grid):

- fixed iterations (``tol=None``, 10 symmetric iterations, eps = ``--eps``): n = 10⁶·√W
  (weak scaling: the work per GPU of 10⁶² on one), 2·10⁶ (strong scaling), and 4·10⁶ on
  one GPU (about two minutes on an H200) and from 4 GPUs on;
- to ``tol=1e-3`` with the default options (on GPUs: Anderson mixing of the alternating
  schedule), eps = ``--tol-eps`` (10: eps/diameter² ≈ 1.3e-3 at 2·10⁶ points, so no
  annealing ladder; about 10 iterations), at 2·10⁶;
- the Sinkhorn divergence and its gradient w.r.t. x at 2·10⁶ (10 iterations per solve), from
  4 GPUs on, gather mode.

Every sharded row has, per iteration, the wall time, the time the compute stream waited for
collectives and ring transfers ("comm") and the time of the plan kernels ("kernels"), both
from CUDA events around them (``flashsinkhorn.distributed._timing``; the maximum over
ranks), and the peak memory of every rank. Every rank draws the same clouds from one seed
and keeps its rows, so all GPU counts solve the same problem. Times are wall-clock around
one solve after warm-up solves at ``--warmup-n`` (kernel compilation), with device
synchronisation and a barrier on both sides; a sharded time is the maximum over ranks.
Rank 0 appends the rows to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist

import flashsinkhorn as fs
from flashsinkhorn import distributed as fsd
from flashsinkhorn.distributed._timing import recording

MILLION = 1_000_000


def sizes_of(n: int, world: int) -> list[int]:
    return [n // world + (1 if i < n % world else 0) for i in range(world)]


def clouds(n: int, d: int, device, rank: int = 0, world: int = 1):
    """This rank's rows of the benchmark clouds (the same clouds for every world size)."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(n, d, generator=gen, device=device)
    y = torch.randn(n, d, generator=gen, device=device) + 0.5
    lo = sum(sizes_of(n, world)[:rank])
    hi = lo + sizes_of(n, world)[rank]
    if world == 1:
        return x, y
    xs, ys = x[lo:hi].clone(), y[lo:hi].clone()
    del x, y
    return xs, ys


def append_rows(path: str, rows: list[dict]) -> None:
    old = []
    if os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(old + rows, fh, indent=1)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


class Group:
    """World size, rank and device of this process (one process: no torch.distributed)."""

    def __init__(self):
        self.sharded = "WORLD_SIZE" in os.environ
        if not self.sharded:
            self.rank, self.world = 0, 1
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            return
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            self.device = torch.device("cuda", local)
        else:
            dist.init_process_group("gloo")
            self.device = torch.device("cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def max(self, values: list[float]) -> list[float]:
        if not self.sharded:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def gather(self, value: float) -> list[float]:
        if not self.sharded:
            return [value]
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [float(v) for v in out]

    def timed(self, fn):
        """(fn(), wall ms, comm ms, kernel ms, peak GB per rank); times are the maxima over
        ranks."""
        reset_peak()
        sync()
        if self.sharded:
            dist.barrier()
        with recording() as rec:
            t0 = time.perf_counter()
            out = fn()
            sync()
            ms = 1e3 * (time.perf_counter() - t0)
        split = rec.totals()
        ms, comm, kern = self.max([ms, split.get("comm", 0.0), split.get("kernels", 0.0)])
        return out, ms, comm, kern, self.gather(peak_gb())


def solve_fn(g: Group, x, y, mode: str, opts: dict):
    if g.sharded:
        return lambda: fsd.sinkhorn(x, y, mode=mode, compute_error=False, **opts)
    return lambda: fs.sinkhorn(x, y, **opts)


def row(g: Group, case: str, n: int, d: int, mode: str, res, ms, comm, kern, peak, opts):
    its = res.n_iters
    route = (res.schedule, res.acceleration) if g.sharded else (
        res.route.schedule, res.route.acceleration)  # fmt: skip
    return {
        "case": case, "device": device_name(), "world_size": g.world, "n": n, "m": n, "d": d,
        "mode": mode if g.sharded else "single", "eps": opts["eps"], "tol": opts.get("tol"),
        "iterations": its, "converged": bool(res.converged), "schedule": route[0],
        "acceleration": route[1], "precision": res.precision if g.sharded else
        res.route.precision, "value": float(res.value), "ms": ms, "ms_per_iter": ms / its,
        "comm_ms_per_iter": comm / its, "kernels_ms_per_iter": kern / its,
        "peak_gb_per_rank": peak, "torch": torch.__version__,
    }  # fmt: skip


def emit(g: Group, args, r: dict) -> None:
    if g.rank == 0:
        print(json.dumps(r), flush=True)
        if args.out:
            append_rows(args.out, [r])


def default_sizes(world: int) -> dict[str, list[int]]:
    weak = int(round(MILLION * math.sqrt(world)))
    fixed = sorted({weak, 2 * MILLION} | ({4 * MILLION} if world == 1 or world >= 4 else set()))
    return {
        "fixed": fixed,
        "tol": [2 * MILLION],
        "div": [2 * MILLION] if world >= 4 else [],
    }


def parse_sizes(text: str | None, default: list[int]) -> list[int]:
    if text is None:
        return default
    return [int(float(v)) for v in text.split(",") if v]


def warm_up(g: Group, args, modes, divergence: bool) -> None:
    """Compiles every kernel variant the suite launches, at a small size (at least 10⁹ scores
    per rank and half-step: the plan half-steps and Anderson mixing are taken from there)."""
    x, y = clouds(args.warmup_n, args.d, g.device, g.rank, g.world)
    for mode in modes:
        for opts in (dict(eps=args.eps, tol=None, n_iters=3), dict(eps=args.tol_eps)):
            solve_fn(g, x, y, mode, opts)()
    if g.sharded and divergence:
        xr = x.clone().requires_grad_(True)
        fsd.sinkhorn_divergence(xr, y, eps=args.eps, tol=None, n_iters=3).backward()
    sync()


def run_suite(args) -> None:
    g = Group()
    sizes = default_sizes(g.world)
    fixed = parse_sizes(args.sizes, sizes["fixed"])
    tol_sizes = parse_sizes(args.tol_sizes, sizes["tol"])
    div_sizes = parse_sizes(args.div_sizes, sizes["div"])
    modes = args.modes.split(",") if g.sharded else ["single"]
    warm_up(g, args, modes, bool(div_sizes))
    fixed_opts = dict(eps=args.eps, tol=None, n_iters=args.iters)
    tol_opts = dict(eps=args.tol_eps, tol=1e-3)
    for case, ns, opts in (("fixed", fixed, fixed_opts), ("tol", tol_sizes, tol_opts)):
        for n in ns:
            x, y = clouds(n, args.d, g.device, g.rank, g.world)
            for mode in modes:
                res, *t = g.timed(solve_fn(g, x, y, mode, opts))
                emit(g, args, row(g, f"distributed_{case}", n, args.d, mode, res, *t, opts))
            del x, y
    for n in div_sizes:
        x, y = clouds(n, args.d, g.device, g.rank, g.world)
        xr = x.requires_grad_(True)
        opts = dict(eps=args.eps, tol=None, n_iters=args.iters, mode="gather")
        loss, ms_f, comm_f, kern_f, peak_f = g.timed(
            lambda xr=xr, y=y: fsd.sinkhorn_divergence(xr, y, **opts)  # noqa: B023
        )
        _, ms_b, comm_b, kern_b, peak_b = g.timed(loss.backward)
        grad_norm = xr.grad.norm() ** 2
        if g.sharded:
            dist.all_reduce(grad_norm)
        r = {
            "case": "distributed_divergence", "device": device_name(), "world_size": g.world,
            "n": n, "m": n, "d": args.d, "mode": "gather", "eps": args.eps,
            "iterations": args.iters, "value": float(loss.detach()),
            "grad_x_norm": float(grad_norm.sqrt()), "forward_ms": ms_f, "backward_ms": ms_b,
            "forward_comm_ms": comm_f, "forward_kernels_ms": kern_f, "backward_comm_ms": comm_b,
            "backward_kernels_ms": kern_b, "torch": torch.__version__,
            "peak_gb_per_rank": [max(a, b) for a, b in zip(peak_f, peak_b, strict=True)],
        }  # fmt: skip
        emit(g, args, r)
        del x, y, xr, loss
    if g.sharded:
        dist.destroy_process_group()


def run_check(args) -> None:
    """Sharded vs one-process solve and gradients on the same (small) clouds, every mode and
    schedule, and the default (tol 1e-3: Anderson mixing on GPUs from 10⁹ scores)."""
    g = Group()
    n, d, world, rank, device = args.check_n, args.d, g.world, g.rank, g.device
    sizes = sizes_of(n, world)
    sizes[0] += 7  # uneven shards
    sizes[-1] -= 7
    gen = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(n, d, generator=gen, device=device)
    y = torch.randn(n, d, generator=gen, device=device) + 0.5
    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])
    eps = args.eps
    for schedule in ("symmetric", "alternating", "auto"):
        kw = dict(eps=eps, tol=1e-3, schedule=schedule)
        ref = fs.sinkhorn(x, y, **kw)
        xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        fs.ot_cost(xr, yr, **kw).backward()
        for mode in ("gather", "ring"):
            res = fsd.sinkhorn(x[sl], y[sl], mode=mode, **kw)
            xl = x[sl].clone().requires_grad_(True)
            yl = y[sl].clone().requires_grad_(True)
            fsd.ot_cost(xl, yl, mode=mode, **kw).backward()
            scale = float(ref.f.abs().max())
            e = g.max(
                [
                    float((res.f - ref.f[sl]).abs().max()) / scale,
                    float((res.g - ref.g[sl]).abs().max()) / scale,
                    abs(float(res.value - ref.value)) / abs(float(ref.value)),
                    float((xl.grad - xr.grad[sl]).norm() / xr.grad[sl].norm()),
                    float((yl.grad - yr.grad[sl]).norm() / yr.grad[sl].norm()),
                    float(res.n_iters != ref.n_iters),
                ]
            )
            emit(g, args, {
                "case": "distributed_check", "device": device_name(), "world_size": world,
                "n": n, "d": d, "mode": mode, "schedule": res.schedule,
                "acceleration": res.acceleration, "precision": res.precision,
                "rel_err_f": e[0], "rel_err_g": e[1], "rel_err_value": e[2],
                "rel_err_grad_x": e[3], "rel_err_grad_y": e[4], "n_iters_differ": bool(e[5]),
                "n_iters": res.n_iters, "ref_n_iters": ref.n_iters,
            })  # fmt: skip
    dist.destroy_process_group()


def table(path: str) -> None:
    with open(path) as fh:
        rows = json.load(fh)
    base = {(r["case"], r["n"]): r for r in rows if r.get("world_size") == 1}
    one = base.get(("distributed_fixed", MILLION))
    head = ("case", "GPUs", "n = m", "mode", "its", "ms", "ms/it", "comm/it", "kern/it",
            "peak GB", "speed-up", "weak eff.")  # fmt: skip
    print("{:<6} {:>4} {:>9} {:<7} {:>4} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}".format(*head))
    for r in rows:
        if r["case"] not in ("distributed_fixed", "distributed_tol"):
            continue
        ref = base.get((r["case"], r["n"]))
        speed = f"{ref['ms'] / r['ms']:.2f}x" if ref and r["world_size"] > 1 else ""
        weak = ""
        if one and r["case"] == "distributed_fixed" and r["world_size"] > 1:
            if abs(r["n"] - MILLION * math.sqrt(r["world_size"])) < 1000:
                weak = f"{one['ms_per_iter'] / r['ms_per_iter']:.1%}"
        print(
            f"{r['case'][12:]:<6} {r['world_size']:>4} {r['n']:>9} {r['mode']:<7} "
            f"{r['iterations']:>4} {r['ms']:>9.0f} {r['ms_per_iter']:>8.1f} "
            f"{r['comm_ms_per_iter']:>8.1f} {r['kernels_ms_per_iter']:>8.1f} "
            f"{max(r['peak_gb_per_rank']):>8.2f} {speed:>8} {weak:>9}"
        )
    for r in rows:
        if r["case"] == "distributed_divergence":
            print(f"divergence {r['world_size']} GPUs n={r['n']}: forward {r['forward_ms']:.0f} "
                  f"ms, backward {r['backward_ms']:.0f} ms, value {r['value']:.6g}, "
                  f"|grad_x| {r['grad_x_norm']:.4g}")  # fmt: skip
        if r["case"] == "distributed_check":
            its = f"{r['n_iters']}/{r['ref_n_iters']}"
            print(f"check {r['mode']:<6} {r['schedule']:<11} {r['acceleration']:<9} "
                  f"n={r['n']} f {r['rel_err_f']:.1e} value {r['rel_err_value']:.1e} "
                  f"grad_x {r['rel_err_grad_x']:.1e} its {its}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", action="store_true", help="this GPU count's part of the suite")
    p.add_argument("--sizes", default=None, help="fixed-iteration sizes (comma list)")
    p.add_argument("--tol-sizes", default=None, help="sizes solved to tol 1e-3")
    p.add_argument("--div-sizes", default=None, help="sizes of the divergence and gradient")
    p.add_argument("--dim", dest="d", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--eps", type=float, default=1.0, help="eps of the fixed-iteration runs")
    p.add_argument("--tol-eps", type=float, default=10.0, help="eps of the runs to tol")
    p.add_argument("--modes", default="gather,ring")
    p.add_argument("--warmup-n", type=int, default=80_000)
    p.add_argument("--check", action="store_true", help="correctness vs one process")
    p.add_argument("--check-n", type=int, default=40_000)
    p.add_argument("--out", default=None, help="JSON file the rows are appended to")
    p.add_argument("--table", default=None, help="print the table of a JSON file and exit")
    args = p.parse_args()
    if args.table:
        table(args.table)
    elif args.check:
        run_check(args)
    else:
        run_suite(args)


if __name__ == "__main__":
    main()
