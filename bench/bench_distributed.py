"""Times one large OT problem on one GPU and sharded over several (flashsinkhorn.distributed).

Launch the sharded runs with torchrun (one GPU per rank, NCCL); the one-GPU baseline runs
without it:

    python bench/bench_distributed.py --single --points 1000000 --out out/distributed.json
    torchrun --nproc-per-node=2 bench/bench_distributed.py --points 1000000 \
        --out out/distributed.json
    torchrun --nproc-per-node=2 bench/bench_distributed.py --check --out out/distributed.json
    python bench/bench_distributed.py --table out/distributed.json

Every run appends JSON rows ``{"case": "distributed", "device", "world_size", "n", "m", "d",
"iterations", "mode", "ms", ...}`` to ``--out`` (rank 0 writes). Points are standard normal
in float32 (``tol=None``, fixed iterations, default precision: TF32 grid); shard r of each
cloud is drawn from its own seed, so the one-GPU baseline solves the same clouds when
``--shards`` equals the world size of the sharded run. Times are wall-clock around one solve
after a warm-up solve at a small size (kernel compilation), with device synchronisation and
a barrier on both sides; the sharded time is the maximum over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import flashsinkhorn as fs
from flashsinkhorn import distributed as fsd


def shard(n: int, world: int, r: int, d: int, seed: int, device) -> torch.Tensor:
    """Rows of shard r (of ``world`` near-equal shards) of an (n, d) normal cloud."""
    sizes = [n // world + (1 if i < n % world else 0) for i in range(world)]
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + r)
    return torch.randn(sizes[r], d, generator=gen, device=device)


def cloud(n, world, d, seed, device, shift=0.0):
    return torch.cat([shard(n, world, r, d, seed, device) for r in range(world)]) + shift


def append_rows(path: str, rows: list[dict]) -> None:
    old = []
    if os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
    with open(path, "w") as fh:
        json.dump(old + rows, fh, indent=1)


def base_row(args, world, mode, ms, res) -> dict:
    return {
        "case": "distributed",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "world_size": world,
        "n": args.n,
        "m": args.n,
        "d": args.d,
        "iterations": args.iters,
        "mode": mode,
        "ms": ms,
        "eps": args.eps,
        "schedule": "symmetric",
        "precision": res.precision,
        "value": float(res.value),
        "n_iters": res.n_iters,
        "torch": torch.__version__,
    }


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_single(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    solve = dict(eps=args.eps, tol=None, n_iters=args.iters)
    for n in (args.warmup_n, args.n):
        x = cloud(n, args.shards, args.d, 1, device)
        y = cloud(n, args.shards, args.d, 2, device, 0.5)
        sync()
        t0 = time.perf_counter()
        res = fs.sinkhorn(x, y, **solve)
        sync()
        ms = 1e3 * (time.perf_counter() - t0)
        del x, y
    row = base_row(args, 1, "single", ms, res)
    print(json.dumps(row), flush=True)
    if args.out:
        append_rows(args.out, [row])


def init() -> tuple[int, int, torch.device]:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def timed(fn, device):
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    sync()
    ms = 1e3 * (time.perf_counter() - t0)
    t = torch.tensor([ms], device=device, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return out, float(t)


def run_sharded(args) -> None:
    rank, world, device = init()
    rows = []
    for mode in args.modes.split(","):
        solve = dict(eps=args.eps, tol=None, n_iters=args.iters, mode=mode, compute_error=False)
        for n in (args.warmup_n, args.n):
            x = shard(n, world, rank, args.d, 1, device)
            y = shard(n, world, rank, args.d, 2, device) + 0.5
            res, ms = timed(lambda x=x, y=y: fsd.sinkhorn(x, y, **solve), device)  # noqa: B023
            del x, y
        row = base_row(args, world, mode, ms, res)
        if rank == 0:
            print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if rank == 0 and args.out:
        append_rows(args.out, rows)
    dist.destroy_process_group()


def run_check(args) -> None:
    """Sharded vs one-process solve and gradients on the same (small) clouds, every mode."""
    rank, world, device = init()
    n, d = args.check_n, args.d
    sizes = [n // world + (1 if i < n % world else 0) for i in range(world)]
    sizes[0] += 7  # uneven shards
    sizes[-1] -= 7
    gen = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(n, d, generator=gen, device=device)
    y = torch.randn(n, d, generator=gen, device=device) + 0.5
    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])
    eps = args.eps
    rows = []
    for schedule in ("symmetric", "alternating"):
        ref = fs.sinkhorn(x, y, eps=eps, tol=1e-3, schedule=schedule)
        xr, yr = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        fs.ot_cost(xr, yr, eps=eps, tol=1e-3, schedule=schedule).backward()
        for mode in ("gather", "ring"):
            res = fsd.sinkhorn(x[sl], y[sl], eps=eps, tol=1e-3, schedule=schedule, mode=mode)
            xl = x[sl].clone().requires_grad_(True)
            yl = y[sl].clone().requires_grad_(True)
            fsd.ot_cost(xl, yl, eps=eps, tol=1e-3, schedule=schedule, mode=mode).backward()
            scale = float(ref.f.abs().max())
            errs = torch.tensor(
                [
                    float((res.f - ref.f[sl]).abs().max()) / scale,
                    float((res.g - ref.g[sl]).abs().max()) / scale,
                    abs(float(res.value - ref.value)) / abs(float(ref.value)),
                    float((xl.grad - xr.grad[sl]).norm() / xr.grad[sl].norm()),
                    float((yl.grad - yr.grad[sl]).norm() / yr.grad[sl].norm()),
                    float(res.n_iters != ref.n_iters),
                ],
                device=device,
                dtype=torch.float64,
            )
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            e = errs.tolist()
            rows.append(
                {
                    "case": "distributed_check",
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "world_size": world, "n": n, "d": d, "mode": mode, "schedule": schedule,
                    "precision": res.precision, "rel_err_f": e[0], "rel_err_g": e[1],
                    "rel_err_value": e[2], "rel_err_grad_x": e[3], "rel_err_grad_y": e[4],
                    "n_iters_differ": bool(e[5]), "n_iters": res.n_iters,
                    "ref_n_iters": ref.n_iters,
                }
            )  # fmt: skip
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0 and args.out:
        append_rows(args.out, rows)
    dist.destroy_process_group()


def table(path: str) -> None:
    with open(path) as fh:
        rows = json.load(fh)
    single = {r["n"]: r["ms"] for r in rows if r["case"] == "distributed" and r["mode"] == "single"}
    head = ("device", "GPUs", "n = m", "d", "its", "mode", "ms", "speed-up")
    print("{:<22} {:>4} {:>9} {:>4} {:>4} {:<7} {:>10} {:>8}".format(*head))
    for r in rows:
        if r["case"] != "distributed":
            continue
        base = single.get(r["n"])
        sp = f"{base / r['ms']:.2f}x" if base and r["mode"] != "single" else ""
        print(
            f"{r['device'][:22]:<22} {r['world_size']:>4} {r['n']:>9} {r['d']:>4} "
            f"{r['iterations']:>4} {r['mode']:<7} {r['ms']:>10.1f} {sp:>8}"
        )
    for r in rows:
        if r["case"] == "distributed_check":
            print(
                f"check {r['mode']:<6} {r['schedule']:<11} n={r['n']} "
                f"rel err f {r['rel_err_f']:.1e} "
                f"value {r['rel_err_value']:.1e} grad_x {r['rel_err_grad_x']:.1e} "
                f"grad_y {r['rel_err_grad_y']:.1e} its {r['n_iters']}/{r['ref_n_iters']}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--points", dest="n", type=int, default=1_000_000, help="points per cloud (n = m)"
    )
    p.add_argument("--dim", dest="d", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--eps", type=float, default=1.0, help="entropic regularisation")
    p.add_argument("--modes", default="gather,ring")
    p.add_argument("--warmup-n", type=int, default=20_000)
    p.add_argument("--single", action="store_true", help="one-GPU baseline, no torchrun")
    p.add_argument("--shards", type=int, default=2, help="shard seeds for --single")
    p.add_argument("--check", action="store_true", help="correctness vs one process")
    p.add_argument("--check-n", type=int, default=40_000)
    p.add_argument("--out", default=None, help="JSON file the rows are appended to")
    p.add_argument("--table", default=None, help="print the table of a JSON file and exit")
    args = p.parse_args()
    if args.table:
        table(args.table)
    elif args.single:
        run_single(args)
    elif args.check:
        run_check(args)
    else:
        run_sharded(args)


if __name__ == "__main__":
    main()
