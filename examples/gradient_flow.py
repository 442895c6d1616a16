"""Gradient flow of the Sinkhorn divergence: a cloud flows onto another.

Each step moves the source points along −∇_x S_eps(x, y), the debiased Sinkhorn divergence,
whose gradient is computed by fused streaming kernels (envelope theorem, no n × m tensor on
GPU). The step is scaled by 1 / a_i = n, so that each point moves towards its entropic
barycentric target. Frames are written as PNG files.

Usage:
    python examples/gradient_flow.py [OUT_DIR] [--steps 40] [--n 500] [--every 5] [--quick]

On CUDA (Triton backend) the default is n = 500 points, 40 steps. On the CPU (torch backend)
``--quick`` is the default: n = 250, 24 steps, a frame every 4, one torch thread. Measured on
a shared 2-core CPU (load average 3–6 from other jobs), whole command: ``--quick`` 9.4 s (the
flow itself 4.1 s); ``--no-quick`` 24 s with ``--threads 1``, 80 s with torch's default two
threads. Needs matplotlib (``pip install 'flashsinkhorn[examples]'``); ``--help`` does not.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

#: Quick runs use one torch thread: on a 2-core machine busy with other jobs, torch's two
#: threads per process oversubscribe the cores (shuffled_regression.py --quick, 30 steps:
#: 10.5 s with one thread, 159 s with two, at a load average of 6).
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="out/gradient_flow", help="output directory")
    parser.add_argument("--steps", type=int, default=None, help="steps (40; 24 with --quick)")
    parser.add_argument("--n", type=int, default=None, help="points per cloud (500; 250 quick)")
    parser.add_argument("--every", type=int, default=None, help="a frame every k steps (5; 4)")
    parser.add_argument("--eps", type=float, default=0.004)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="small sizes (default: on when there is no CUDA device)",
    )
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help returns here, before the heavy imports

import torch  # noqa: E402

import flashsinkhorn as fs  # noqa: E402


def set_threads(threads: int | None, quick: bool) -> None:
    if threads is None and quick:
        threads = 1
    if threads:
        torch.set_num_threads(threads)


def two_moons(n: int, gen: torch.Generator) -> torch.Tensor:
    """Target: two interleaved half circles."""
    t = torch.rand(n, generator=gen) * math.pi
    upper = torch.rand(n, generator=gen) < 0.5
    pts = torch.stack([torch.cos(t), torch.sin(t)], 1)
    pts[~upper] = torch.stack([1 - torch.cos(t[~upper]), 0.5 - torch.sin(t[~upper])], 1)
    return pts * 0.45 + torch.tensor([0.3, 0.35]) + 0.02 * torch.randn(n, 2, generator=gen)


def main(args: argparse.Namespace) -> None:
    import matplotlib  # after the arguments: --help needs no matplotlib

    matplotlib.use("Agg")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick if args.quick is not None else device == "cpu"
    set_threads(args.threads, quick)
    args.n = args.n or (250 if quick else 500)
    args.steps = args.steps or (24 if quick else 40)
    args.every = args.every or (4 if quick else 5)
    print(f"device {device}, n = {args.n}, {args.steps} steps{' (quick)' if quick else ''}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(args.n, 2, generator=gen) * 0.08 + torch.tensor([0.2, 0.8])).to(device)
    y = two_moons(args.n, gen).to(device)
    x.requires_grad_(True)
    # eps annealing then a fixed number of iterations: a predictable cost per step (a training
    # loop wants no data-dependent host synchronisation).
    loss_fn = fs.SinkhornDivergence(eps=args.eps, scaling=0.6, n_iters=20, tol=None)

    t0 = time.perf_counter()
    frame = 0
    for step in range(args.steps + 1):
        loss = loss_fn(x, y)
        (grad,) = torch.autograd.grad(loss, x)
        if step % args.every == 0 or step == args.steps:
            _save(out / f"frame_{frame:03d}.png", x.detach(), y, step, loss.detach().item())
            frame += 1
        with torch.no_grad():
            x -= args.lr * args.n * grad  # 1/a_i = n: a step towards the barycentric target
    print(f"{args.steps} steps, {frame} frames in {out}/ ({time.perf_counter() - t0:.1f} s)")


def _save(path, x, y, step, loss) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 4), dpi=100)
    ax.scatter(*y.cpu().T, s=4, c="tab:orange", alpha=0.5, label="target")
    ax.scatter(*x.cpu().T, s=4, c="tab:blue", label="source")
    ax.set(xlim=(-0.2, 1.35), ylim=(-0.15, 1.1), xticks=[], yticks=[], aspect="equal")
    ax.set_title(f"step {step}   S = {loss:.2e}", fontsize=9)
    ax.legend(loc="lower right", fontsize=7, markerscale=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main(ARGS)
