"""OTDD between labelled image datasets: scikit-learn's 8×8 digits and perturbed copies.

The 1797 digits (64 features, 10 classes) ship with scikit-learn: nothing is downloaded.
They are split into two random halves, D1 and D2, and D2 is perturbed in a few ways. For
each pair the script prints the optimal transport dataset distance (labels and features) and
the plain Sinkhorn divergence of the features alone, then

- saves a heat map of the 20 × 20 class-distance matrix W of (D1, noisy D2)
  (``otdd_W.png``; rows/columns 0-9 are the classes of D1, 10-19 those of D2), and
- runs a gradient flow that moves the noisy digits towards D1 along −∇ OTDD at fixed W
  and fixed labels (``otdd_flow.png``: one digit of each class at a few steps).

Usage:
    python examples/otdd.py [OUT_DIR] [--eps 1.0] [--steps 10] [--iters 20] [--lr 0.5]
        [--flow-eps 0.25] [--quick | --no-quick]

Needs ``pip install 'flashsinkhorn[examples]'`` (scikit-learn, matplotlib, tqdm; ``--help``
needs none of them). Uses CUDA and the Triton kernels when present, all 898 + 899 digits. On
the CPU (torch backend) ``--quick`` is the default: 300 digits per half, one torch thread.
Measured on a shared 2-core CPU (load average 2–6 from other jobs), whole command:
``--quick`` 8.4–12.9 s (each OTDD solve 0.1 s, the 190-pair W 0.1 s, the 10-step flow
0.9–2 s); ``--no-quick`` 22 s with ``--threads 1``, 16–125 s with torch's default two threads
(16 s at load 2, 125 s at load 6).
"""

from __future__ import annotations

import argparse
import pathlib
import time

#: Quick runs use one torch thread: on a 2-core machine busy with other jobs, torch's two
#: threads per process oversubscribe the cores (shuffled_regression.py --quick, 30 steps:
#: 10.5 s with one thread, 159 s with two, at a load average of 6).
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="out/otdd", help="output directory")
    parser.add_argument("--eps", type=float, default=1.0, help="entropic regularisation")
    parser.add_argument("--steps", type=int, default=10, help="gradient-flow steps")
    parser.add_argument("--iters", type=int, default=20, help="iterations per flow solve")
    parser.add_argument("--lr", type=float, default=0.5, help="gradient-flow step size")
    parser.add_argument("--flow-eps", type=float, default=0.25, help="eps of the flow")
    parser.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="300 digits per half (default: on when there is no CUDA device)",
    )
    parser.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help returns here, before the heavy imports

import torch  # noqa: E402

import flashsinkhorn as fs  # noqa: E402
from flashsinkhorn.otdd import class_distance_matrix, otdd_distance  # noqa: E402


def set_threads(threads: int | None, quick: bool) -> None:
    if threads is None and quick:
        threads = 1
    if threads:
        torch.set_num_threads(threads)


def shift_images(x: torch.Tensor, dx: int) -> torch.Tensor:
    """Translates 8×8 images (rows of 64 pixels) by ``dx`` columns, filling with 0."""
    img = x.reshape(-1, 8, 8)
    out = torch.zeros_like(img)
    if dx >= 0:
        out[:, :, dx:] = img[:, :, : 8 - dx]
    else:
        out[:, :, :dx] = img[:, :, -dx:]
    return out.reshape(-1, 64)


def main(args: argparse.Namespace) -> None:
    # After the arguments: --help needs neither matplotlib nor scikit-learn.
    import matplotlib
    from sklearn.datasets import load_digits

    matplotlib.use("Agg")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick if args.quick is not None else device == "cpu"
    set_threads(args.threads, quick)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixels in [0, 1]
    l = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(l), generator=torch.Generator().manual_seed(0))
    half = len(l) // 2
    i1, i2 = perm[:half], perm[half:]
    if quick:
        i1, i2 = i1[:300], i2[:300]
    x1, l1 = x[i1].to(device), l[i1].to(device)
    x2, l2 = x[i2].to(device), l[i2].to(device)
    gen = torch.Generator().manual_seed(1)
    noise = (0.15 * torch.randn(x2.shape, generator=gen)).to(device)

    # The paper's weights λ1 = λ2 = 1/2; solves to a marginal error of 1e-3.
    opts = dict(eps=args.eps, tol=1e-3, feature_weight=0.5, label_weight=0.5)
    w_opts = dict(eps=args.eps, tol=1e-3)
    variants = {
        "D2 (another half of the digits)": (x2, l2),
        "D2 + pixel noise (sd 0.15)": ((x2 + noise).clamp(0, 1), l2),
        "D2 + pixel noise (sd 0.3)": ((x2 + 2 * noise).clamp(0, 1), l2),
        "D2 shifted by 1 column": (shift_images(x2, 1), l2),
        "D2 shifted by 2 columns": (shift_images(x2, 2), l2),
        "D2 with labels permuted (k -> k+1 mod 10)": (x2, (l2 + 1) % 10),
    }
    print(f"D1: {len(l1)} digits, D2: {len(l2)}, d = 64, eps = {args.eps}, device = {device}")
    print("OTDD: cost 0.5 ‖x − y‖² + 0.5 W[l, l']; features only: cost ‖x − y‖²")
    print(f"{'D1 against':44s} {'OTDD':>8s} {'features only':>14s} {'time':>7s}")
    for name, (xv, lv) in variants.items():
        t0 = time.perf_counter()
        dist = otdd_distance(x1, l1, xv, lv, **opts)
        feat = fs.sinkhorn_divergence(x1, xv, **w_opts)
        dt = time.perf_counter() - t0
        print(f"{name:44s} {dist.item():8.3f} {feat.item():14.3f} {dt:6.1f}s")

    # The class-distance matrix of (D1, noisy D2): classes of D1 at 0-9, of D2 at 10-19.
    xs = (x2 + 2 * noise).clamp(0, 1)
    t0 = time.perf_counter()
    W = class_distance_matrix(x1, l1, xs, l2, progress=True, **w_opts)
    print(f"W: {tuple(W.shape)} from {W.shape[0] * (W.shape[0] - 1) // 2} class pairs in "
          f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
    _save_W(out / "otdd_W.png", W.cpu())

    # Gradient flow of the noisy digits towards D1 (labels and W fixed; the step is scaled
    # by 1 / a_i = n, so each point moves towards its entropic barycentric target).
    # A fixed number of iterations per solve: a predictable cost per step.
    # A smaller eps (annealed down to) keeps the entropic barycentric targets sharp.
    flow_opts = dict(opts, eps=args.flow_eps, scaling=0.5, tol=None, n_iters=args.iters)
    xf = xs.clone().requires_grad_(True)
    show = [int((l2 == k).nonzero()[0]) for k in range(10)]
    frames, values = {}, []
    keep = sorted({0, args.steps // 4, args.steps // 2, args.steps})
    t0 = time.perf_counter()
    for step in range(args.steps + 1):
        loss = otdd_distance(x1, l1, xf, l2, label_cost=W, **flow_opts)
        values.append(loss.item())
        if step in keep:
            frames[step] = xf.detach()[show].cpu()
        if step == args.steps:
            break
        (grad,) = torch.autograd.grad(loss, xf)
        with torch.no_grad():
            xf -= args.lr * len(l2) * grad
    print(f"gradient flow: OTDD {values[0]:.3f} -> {values[-1]:.3f} in {args.steps} steps "
          f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    _save_flow(out / "otdd_flow.png", frames, values)
    print(f"figures in {out}/: otdd_W.png, otdd_flow.png")


def _save_W(path, W) -> None:
    import matplotlib.pyplot as plt

    V = W.shape[0]
    fig, ax = plt.subplots(figsize=(5.2, 4.4), dpi=100)
    im = ax.imshow(W.numpy(), cmap="viridis")
    ticks = list(range(V))
    labels = [f"{k % (V // 2)}" for k in ticks]
    ax.set_xticks(ticks, labels, fontsize=6)
    ax.set_yticks(ticks, labels, fontsize=6)
    half = V // 2 - 0.5
    ax.axhline(half, color="w", lw=0.8)
    ax.axvline(half, color="w", lw=0.8)
    ax.set_title("W: D1 classes | noisy D2 classes", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="debiased Sinkhorn divergence")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _save_flow(path, frames, values) -> None:
    import matplotlib.pyplot as plt

    steps = sorted(frames)
    fig, axes = plt.subplots(len(steps), 10, figsize=(8, 0.9 * len(steps) + 0.4), dpi=100)
    for r, s in enumerate(steps):
        for k in range(10):
            ax = axes[r, k]
            ax.imshow(frames[s][k].reshape(8, 8).clamp(0, 1).numpy(), cmap="gray_r", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
            if k == 0:
                ax.set_ylabel(f"step {s}\n{values[s]:.2f}", fontsize=7)
    fig.suptitle("gradient flow of noisy digits towards D1 along −∇ OTDD", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main(ARGS)
