"""Marginal error against iterations for each schedule and acceleration (docs: Convergence).

Solves one problem between two 2-D clouds (a ring and two blobs, eps = 0.01 in units of the
squared distance, about 1e-3 of the squared diameter) with every schedule and acceleration,
testing the marginal error ‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁ after every iteration, and draws the error
histories on one log-scale plot. Runs on the CPU in float64 (torch backend); about 20 s on a
shared 2-core machine with 1,000 points per cloud.

    python examples/convergence.py docs/img/convergence.png
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default="out/convergence.png", help="PNG to write")
    parser.add_argument("--n", type=int, default=300, help="points per cloud")
    parser.add_argument("--eps", type=float, default=0.02, help="entropic regularisation")
    parser.add_argument("--tol", type=float, default=1e-5, help="marginal error to reach")
    parser.add_argument("--max-iters", type=int, default=1500, help="iteration cap")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="150 points per cloud, to a tolerance of 1e-4, at most 600 iterations",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help returns here, before torch is imported

import torch  # noqa: E402

import flashsinkhorn as fs  # noqa: E402

# (label, options): the fixed-eps settings anneal nothing, so that the curves compare the
# iterations themselves; the default call picks its own schedule, acceleration and annealing.
SETTINGS = [
    ("symmetric", {"schedule": "symmetric", "acceleration": "none", "scaling": None}),
    ("alternating", {"schedule": "alternating", "acceleration": "none", "scaling": None}),
    (
        "alternating + over-relaxation",
        {"schedule": "alternating", "acceleration": "overrelax", "scaling": None},
    ),
    (
        "alternating + Anderson",
        {"schedule": "alternating", "acceleration": "anderson", "scaling": None},
    ),
    ("default call", {}),
]


def clouds(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A noisy ring and two Gaussian blobs in 2-D, float64."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g, dtype=torch.float64) * 2 * torch.pi
    r = 1.0 + 0.08 * torch.randn(n, generator=g, dtype=torch.float64)
    x = torch.stack([r * t.cos(), r * t.sin()], 1)
    centre = torch.where(
        torch.rand(n, 1, generator=g) < 0.5,
        torch.tensor([-0.6, 0.3], dtype=torch.float64),
        torch.tensor([0.7, -0.2], dtype=torch.float64),
    )
    y = centre + 0.25 * torch.randn(n, 2, generator=g, dtype=torch.float64)
    return x, y


def histories(n: int, eps: float, tol: float, max_iters: int) -> dict[str, list[tuple[int, float]]]:
    """(iteration, marginal error) after every iteration, for each setting."""
    x, y = clouds(n)
    out = {}
    for label, options in SETTINGS:
        start = time.perf_counter()
        with warnings.catch_warnings():
            # a curve that stops at the cap is part of the comparison (its line says so)
            warnings.simplefilter("ignore", fs.ConvergenceWarning)
            res = fs.sinkhorn(x, y, eps=eps, tol=tol, n_iters=max_iters, check_every=1, **options)
        out[label] = res.errors
        print(
            f"{label:32s} {res.n_iters:5d} iterations to {res.marginal_error:.1e} "
            f"({res.schedule}, {res.acceleration}; {time.perf_counter() - start:.1f} s)"
        )
    return out


def draw(curves: dict[str, list[tuple[int, float]]], tol: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    colours = ["#7f7f7f", "#1f77b4", "#2ca02c", "#ff7f0e", "#d62728"]
    for (label, pts), colour in zip(curves.items(), colours, strict=True):
        its, errs = zip(*pts, strict=True)
        reached = errs[-1] <= tol
        note = f"{its[-1]}" if reached else f"not reached in {its[-1]}"
        # The default call is drawn wide and pale beneath the setting it picked.
        default = label == "default call"
        ax.plot(its, errs, "--" if not reached else "-", color=colour, label=f"{label} ({note})",
                linewidth=5 if default else 1.5, alpha=0.35 if default else 1.0,
                zorder=1 if default else 2)  # fmt: skip
    ax.axhline(tol, color="k", linewidth=0.8, linestyle=":")
    ax.set_yscale("log")
    ax.set_ylim(tol / 3, 10)
    ax.set_xlabel("iterations", fontsize=9)
    ax.set_ylabel("‖P1 − a‖₁ + ‖Pᵀ1 − b‖₁", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="iterations to the tolerance", title_fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    print(f"wrote {path}")


def main(args: argparse.Namespace) -> None:
    if args.quick:
        args.n, args.tol, args.max_iters = 150, 1e-4, 600
    torch.set_num_threads(args.threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    curves = histories(args.n, args.eps, args.tol, args.max_iters)
    draw(curves, args.tol, args.out)


if __name__ == "__main__":
    main(ARGS)
