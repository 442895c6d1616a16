"""The main job: EOT value and gradient between two point clouds (`make demo`).

Runs on the GPU when there is one (50,000 points per cloud), otherwise on the CPU in the
``--quick`` size (1,500, one torch thread). Prints value, iterations, marginal error and time,
and writes a PNG of the clouds coloured by their potentials (needs matplotlib: `make demo`
installs it). Measured on a shared 2-core CPU (load average about 4 from other jobs): the
whole command took 9.6 s (solve 0.46 s, loss and gradient 1.5 s; the rest is Python start,
imports and the picture).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import flashsinkhorn as fs

#: Quick runs use one torch thread: on a 2-core machine busy with other jobs, torch's two
#: threads per process oversubscribe the cores (shuffled_regression.py --quick, 30 steps:
#: 10.5 s with one thread, 159 s with two, at a load average of 6).
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"


def set_threads(threads: int | None, quick: bool) -> None:
    if threads is None and quick:
        threads = 1
    if threads:
        torch.set_num_threads(threads)


def clouds(n: int, device: torch.device, seed: int = 0):
    """A ring and a pair of blobs in 2-D."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 2 * torch.pi
    r = 1.0 + 0.08 * torch.randn(n, generator=g)
    x = torch.stack([r * t.cos(), r * t.sin()], 1)
    c = torch.where(
        torch.rand(n, 1, generator=g) < 0.5, torch.tensor([-0.6, 0.3]), torch.tensor([0.7, -0.2])
    )
    y = c + 0.25 * torch.randn(n, 2, generator=g)
    return x.to(device), y.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=None, help="points per cloud")
    parser.add_argument("--eps", type=float, default=0.1, help="entropic regularisation")
    parser.add_argument("--out", default="out/demo.png", help="PNG to write")
    parser.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="1,500 points per cloud (default: on when there is no CUDA device)",
    )
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick if args.quick is not None else device.type == "cpu"
    set_threads(args.threads, quick)
    n = args.n or (1_500 if quick else 50_000)
    x, y = clouds(n, device)
    x.requires_grad_(True)

    fs.sinkhorn(x[:64], y[:64], eps=args.eps)  # compile the kernels outside the timing
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = fs.sinkhorn(x, y, eps=args.eps, tol=1e-3)
    err = res.marginal_error.item()
    t_solve = time.perf_counter() - t0
    print(f"device            {device} ({res.backend} backend, precision {res.precision})")
    print(f"points            {n} x 2 against {n} x 2, eps = {args.eps}")
    print(f"OT_eps value      {res.value.item():.6f}")
    print(f"iterations        {res.n_iters} (converged: {res.converged})")
    print(f"marginal error    {err:.2e}")
    print(f"solve time        {t_solve * 1e3:.1f} ms")

    if hasattr(fs, "sinkhorn_divergence"):
        t0 = time.perf_counter()
        loss = fs.sinkhorn_divergence(x, y, eps=args.eps, tol=1e-3)
        (grad,) = torch.autograd.grad(loss, x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"divergence        {loss.item():.6f}")
        print(f"|grad_x| (mean)   {grad.norm(dim=1).mean().item():.3e}")
        print(f"loss + gradient   {(time.perf_counter() - t0) * 1e3:.1f} ms")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no picture")
        return
    k = min(n, 5000)
    xs, ys = x.detach()[:k].cpu(), y[:k].cpu()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
    for ax, pts, pot, name in (
        (axes[0], xs, res.f[:k], "f on x"),
        (axes[1], ys, res.g[:k], "g on y"),
    ):
        sc = ax.scatter(pts[:, 0], pts[:, 1], c=pot.cpu(), s=3, cmap="viridis")
        ax.set_title(f"potential {name}")
        ax.set_aspect("equal")
        fig.colorbar(sc, ax=ax, shrink=0.8)
    fig.suptitle(f"flashsinkhorn: OT_eps = {res.value.item():.4f}, eps = {args.eps}, n = {n}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110, bbox_inches="tight")
    print(f"picture           {args.out}")


if __name__ == "__main__":
    main()
