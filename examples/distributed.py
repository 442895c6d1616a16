"""One OT problem sharded over processes with flashsinkhorn.distributed.

    python examples/distributed.py                                 # spawns 2 CPU ranks (gloo)
    torchrun --nproc-per-node=2 examples/distributed.py            # CPUs (gloo) or GPUs (NCCL)
    torchrun --nproc-per-node=2 examples/distributed.py --points 200000 # a larger problem on GPUs
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        examples/distributed.py --points 4000000                      # two nodes, 16 GPUs

Without CUDA ``--quick`` is the default: 1,000 points per cloud, 3 gradient steps, one torch
thread per rank. Measured with two ranks on a shared 2-core CPU (load average 3–4 from other
jobs), whole command: 11.6 s; ``--no-quick`` (3,000 points, 5 steps) 21 s with
``--threads 1``.

Each rank draws its own rows of two clouds (uneven shards: rank r holds n_r points), solves
in both modes, checks that they agree, then takes a few gradient steps of the sharded
Sinkhorn divergence on its own rows of x. Under torchrun, with GPUs each rank uses one (NCCL);
otherwise gloo on the CPU, in float64. Started without torchrun (no RANK in the environment),
the script spawns ``--ranks`` CPU processes itself (gloo on 127.0.0.1, one torch thread each
unless ``--threads`` says otherwise).
"""

from __future__ import annotations

import argparse
import os
import socket

#: Quick runs use one torch thread: on a 2-core machine busy with other jobs, torch's two
#: threads per process oversubscribe the cores (shuffled_regression.py --quick, 30 steps:
#: 10.5 s with one thread, 159 s with two, at a load average of 6).
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--points", type=int, default=None, help="total points per cloud (3000; 1000 quick)"
    )
    p.add_argument("--steps", type=int, default=None, help="gradient steps (5; 3 with --quick)")
    p.add_argument("--dim", type=int, default=3)
    p.add_argument("--eps", type=float, default=0.1)
    p.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="1000 points, 3 steps (default: on when there is no CUDA device)",
    )
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP + ", per rank")
    p.add_argument(
        "--ranks", type=int, default=2, help="processes to spawn without torchrun (2; CPU, gloo)"
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help returns here, before torch is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flashsinkhorn import distributed as fsd  # noqa: E402


def set_threads(threads: int | None, quick: bool) -> None:
    if threads is None and quick:
        threads = 1
    if threads:
        torch.set_num_threads(threads)


def spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One process of a run started without torchrun: torchrun's variables, then the run."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    # one thread per rank unless asked: the ranks share the machine's cores
    torch.set_num_threads(args.threads or 1)
    main(args, backend="gloo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(args: argparse.Namespace, backend: str | None = None) -> None:
    if "RANK" not in os.environ:
        if args.ranks < 1:
            raise SystemExit(f"--ranks must be >= 1, got {args.ranks}")
        port = free_port()
        print(f"no torchrun environment: spawning {args.ranks} CPU ranks (gloo, port {port})")
        torch.multiprocessing.spawn(spawned_rank, (args.ranks, port, args), nprocs=args.ranks)
        return
    cpu = backend == "gloo" or not torch.cuda.is_available()
    quick = args.quick if args.quick is not None else cpu
    if backend is None:  # (spawned ranks have set theirs)
        set_threads(args.threads, quick)
    args.points = args.points or (1000 if quick else 3000)
    args.steps = args.steps or (3 if quick else 5)

    # NCCL on GPU LOCAL_RANK of this node, or gloo on the CPU; one node or several.
    place = fsd.init_process_group(backend)
    device = place.device
    dtype = torch.float32 if device.type == "cuda" else torch.float64
    rank, world = place.rank, place.world_size

    # Uneven shards: rank r holds a share proportional to r + 1.
    share = [(r + 1) for r in range(world)]
    n_local = args.points * share[rank] // sum(share)
    gen = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(n_local, args.dim, generator=gen, device=device, dtype=dtype)
    y = 0.5 * torch.randn(n_local, args.dim, generator=gen, device=device, dtype=dtype) + 1.0

    res = {}
    for mode in ("gather", "ring"):
        res[mode] = fsd.sinkhorn(x, y, eps=args.eps, mode=mode, tol=1e-4)
    gap = (res["gather"].f - res["ring"].f).abs().max()
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    r = res["gather"]
    if rank == 0:
        print(
            f"world {world}, n = {r.n}, m = {r.m}, d = {args.dim}: OT_eps = {float(r.value):.6f}, "
            f"{r.n_iters} iterations, converged {r.converged}, marginal error "
            f"{float(r.marginal_error):.2e}; ring vs gather potentials differ by {float(gap):.1e}"
        )

    # Gradient flow of the divergence: each rank moves its own rows of x. The loss is the
    # global one on every rank; its gradient w.r.t. x is this rank's slice (no all-reduce).
    x = x.clone().requires_grad_(True)
    for step in range(args.steps):
        loss = fsd.sinkhorn_divergence(x, y, eps=args.eps, mode="ring", tol=1e-3)
        (gx,) = torch.autograd.grad(loss, [x])
        with torch.no_grad():
            x -= 0.5 * gx / (1.0 / r.n)  # gradients scale like the weights 1/n
        if rank == 0:
            print(f"step {step}: S_eps = {float(loss.detach()):.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(ARGS)
