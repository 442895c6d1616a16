"""The main job: EOT value and gradient between two point clouds (`make demo`).

Runs on the GPU when there is one (50,000 points per cloud), otherwise on the CPU in the
``--quick`` size (1,500, one torch thread). Prints the result, value, iterations, marginal
error and time, and writes a PNG (needs matplotlib: `make demo` installs it) of where the mass
goes and how fast: both clouds on one axis with a line from sampled points of x to their
barycentric images (the plan's average destination), and the marginal error against the
iterations. Measured on a shared 2-core CPU (load average about 4 from other jobs): the
whole command took 9.6 s (solve 0.46 s, loss and gradient 1.5 s; the rest is Python start,
imports and the picture).
"""

from __future__ import annotations

import argparse
import os
import time

#: Quick runs use one torch thread: on a 2-core machine busy with other jobs, torch's two
#: threads per process oversubscribe the cores (shuffled_regression.py --quick, 30 steps:
#: 10.5 s with one thread, 159 s with two, at a load average of 6).
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"
#: Stopping tolerance of the solves (marginal error, L1).
TOL = 1e-3
#: Points of x whose transport lines are drawn.
LINES = 150


def parse_args(argv=None) -> argparse.Namespace:
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
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help returns here, before torch is imported

import torch  # noqa: E402

import flashsinkhorn as fs  # noqa: E402


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


def main(args: argparse.Namespace) -> None:
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
    res = fs.sinkhorn(x, y, eps=args.eps, tol=TOL)
    err = res.marginal_error.item()
    t_solve = time.perf_counter() - t0
    print(res)
    print(f"device            {device} ({res.backend} backend, precision {res.precision})")
    print(f"points            {n} x 2 against {n} x 2, eps = {args.eps}")
    print(f"OT_eps value      {res.value.item():.6f}")
    print(f"iterations        {res.n_iters} (converged: {res.converged})")
    print(f"marginal error    {err:.2e}")
    print(f"solve time        {t_solve * 1e3:.1f} ms")

    t0 = time.perf_counter()
    loss = fs.sinkhorn_divergence(x, y, eps=args.eps, tol=TOL)
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
    # The convergence curve: the same solve, its error tested after every iteration.
    curve = fs.sinkhorn(x.detach(), y, eps=args.eps, tol=TOL, check_every=1)
    draw(args.out, x.detach(), y, res, curve, args.eps, plt)
    print(f"picture           {args.out}")


def draw(out: str, x: torch.Tensor, y: torch.Tensor, res, curve, eps: float, plt):
    """Left: both clouds and a line from sampled x_i to T(x_i); right: error per iteration."""
    n = x.shape[0]
    g = torch.Generator().manual_seed(1)
    pick = torch.randperm(n, generator=g)[: min(LINES, n)]
    T = res.barycentric_map()[pick].cpu()
    k = min(n, 5000)
    xs, ys, xp = x[:k].cpu(), y[:k].cpu(), x[pick].cpu()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.8), width_ratios=[1.1, 1])
    ax.scatter(xs[:, 0], xs[:, 1], s=3, c="tab:blue", alpha=0.35, label="x (ring)")
    ax.scatter(ys[:, 0], ys[:, 1], s=3, c="tab:orange", alpha=0.35, label="y (two blobs)")
    segs = torch.stack([xp, T], 1).numpy()
    from matplotlib.collections import LineCollection

    ax.add_collection(LineCollection(segs, colors="0.15", linewidths=0.6, alpha=0.7))
    ax.scatter(xp[:, 0], xp[:, 1], s=9, c="tab:blue", edgecolors="k", linewidths=0.3)
    ax.scatter(T[:, 0], T[:, 1], s=9, c="tab:red", label="T(x_i) (barycentric image)")
    ax.set_aspect("equal")
    ax.set_title(f"transport of {len(pick)} sampled points (n = {n}, eps = {eps:g})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=3, fontsize=8, markerscale=2)
    its, errs = zip(*curve.errors, strict=True)
    bx.semilogy(its, errs, marker=".", ms=3)
    bx.axhline(TOL, color="0.5", ls="--", lw=0.8, label=f"tol = {TOL:g}")
    bx.set_xlabel("iteration")
    bx.set_ylabel("marginal error ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁")
    bx.set_title(f"error tested after every iteration ({curve.schedule}, {curve.acceleration})")
    bx.grid(True, which="both", alpha=0.3)
    bx.legend(fontsize=8)
    fig.suptitle(f"flashsinkhorn: OT_eps = {res.value.item():.4f}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return fig


if __name__ == "__main__":
    main(ARGS)
