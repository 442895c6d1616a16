"""Flow matching with minibatch OT couplings: independent pairs, POT's exact plan, and ours.

A small MLP v(x, t) is trained to match x1 − x0 along x_t = (1 − t) x0 + t x1, where each
training step pairs a noise minibatch x0 with a data minibatch x1 in one of three ways:

- ``independent``: x0 and x1 as drawn (plain conditional flow matching);
- ``pot``: torchcfm's OT-CFM pairing (``OTPlanSampler("exact")`` when torchcfm is installed,
  otherwise the same recipe written here with POT: the dense squared-distance matrix copied
  to the host, ``ot.emd``, pairs drawn from the flattened plan);
- ``ours``: ``flashsinkhorn.couple(x0, x1)`` (entropic plan at eps = 0.01 × the mean squared
  distance, solved and sampled on the batches' device without forming the plan).

Two problems: 8 Gaussians → two moons (2-D), and 8×8 images (a bright 3×3 square at one of
nine positions plus pixel noise, 64 features). For each coupling the script reports the
straightness of the learned paths (mean of ‖v(x_t, t) − (x_1 − x_0)‖² along 32-step Euler
trajectories, relative to ‖x_1 − x_0‖²: 0 for straight paths), the Sinkhorn divergence of
2-step and 32-step samples to held-out data, and the time spent coupling; it draws samples
and trajectories to ``OUT/flow_matching_2d.png`` and ``OUT/flow_matching_images.png``.

Usage:
    python examples/flow_matching.py [--out out/flow_matching] [--quick] [--steps N]

``--quick`` (the default without CUDA): batch 96, 80 training steps per model, one torch
thread; the full run (default on CUDA) uses batch 512 and 2,000 steps. Both evaluate on 1,000
samples. Needs matplotlib (and
POT for the ``pot`` coupling: ``pip install 'flashsinkhorn[examples]' pot``); ``--help``
does not.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

METHODS = ("independent", "pot", "ours")
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"


def parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/flow_matching", help="output folder")
    ap.add_argument("--steps", type=int, default=None, help="training steps (2000; 80 quick)")
    ap.add_argument("--batch", type=int, default=None, help="minibatch size (512; 96 quick)")
    ap.add_argument("--quick", action=argparse.BooleanOptionalAction, default=None,
                    help="CPU-sized run (default: on when there is no CUDA device)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


# ----- data -----


def gaussians8(n, gen):
    import torch

    k = torch.randint(0, 8, (n,), generator=gen)
    ang = k.float() * (math.pi / 4)
    centres = torch.stack([torch.cos(ang), torch.sin(ang)], 1) * 4.0
    return centres + 0.4 * torch.randn(n, 2, generator=gen)


def moons(n, gen):
    import torch

    t = torch.rand(n, generator=gen) * math.pi
    upper = torch.rand(n, generator=gen) < 0.5
    pts = torch.stack([torch.cos(t), torch.sin(t)], 1)
    low = torch.stack([1 - torch.cos(t), 0.5 - torch.sin(t)], 1)
    pts = torch.where(upper[:, None], pts, low)
    return (pts - torch.tensor([0.5, 0.25])) * 2.5 + 0.1 * torch.randn(n, 2, generator=gen)


def squares(n, gen):
    """(n, 1, 8, 8) images: a 3×3 square of value 1 at one of nine positions, noise 0.05."""
    import torch

    img = torch.zeros(n, 8, 8)
    pos = torch.randint(0, 3, (n, 2), generator=gen) * 2 + 1
    for dy in range(-1, 2):
        for dx in range(-1, 2):
            img[torch.arange(n), pos[:, 0] + dy, pos[:, 1] + dx] = 1.0
    return (img * 2 - 1 + 0.05 * torch.randn(n, 8, 8, generator=gen))[:, None]


PROBLEMS = {
    "2d": (gaussians8, moons, 2, 128),
    "images": (lambda n, g: _noise_images(n, g), squares, 64, 256),
}


def _noise_images(n, gen):
    import torch

    return torch.randn(n, 1, 8, 8, generator=gen)


# ----- couplings -----


def pot_coupling():
    """torchcfm's exact OT-CFM sampler, or the same recipe with POT (None if neither)."""
    try:
        from torchcfm.optimal_transport import OTPlanSampler

        return OTPlanSampler("exact").sample_plan
    except ImportError:
        pass
    try:
        import numpy as np
        import ot
    except ImportError:
        return None
    import torch

    rng = np.random.default_rng(0)

    def sample_plan(x0, x1):
        M = torch.cdist(x0.flatten(1), x1.flatten(1)) ** 2
        pi = ot.emd(ot.unif(len(x0)), ot.unif(len(x1)), M.detach().cpu().numpy())
        p = pi.reshape(-1) / pi.sum()
        i, j = np.divmod(rng.choice(p.size, size=len(x0), p=p), pi.shape[1])
        return x0[torch.as_tensor(i)], x1[torch.as_tensor(j)]

    return sample_plan


def coupling(method):
    import flashsinkhorn as fs

    if method == "independent":
        return lambda x0, x1: (x0, x1)
    if method == "pot":
        return pot_coupling()
    return lambda x0, x1: fs.couple(x0, x1)


# ----- model, training, sampling -----


def mlp(d, width):
    import torch.nn as nn

    return nn.Sequential(
        nn.Linear(d + 1, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(),
        nn.Linear(width, width), nn.SiLU(), nn.Linear(width, d),
    )  # fmt: skip


def velocity(model, x, t):
    import torch

    flat = x.flatten(1)
    tt = t.reshape(-1, 1).expand(len(flat), 1)
    return model(torch.cat([flat, tt], 1)).view_as(x)


def train(problem, method, steps, batch, device, seed):
    import torch

    src, tgt, d, width = PROBLEMS[problem]
    pair = coupling(method)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = mlp(d, width).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    t_couple = 0.0
    for _ in range(steps):
        x0, x1 = src(batch, gen).to(device), tgt(batch, gen).to(device)
        t0 = time.perf_counter()
        x0, x1 = pair(x0, x1)
        t_couple += time.perf_counter() - t0
        t = torch.rand(batch, 1, generator=gen).to(device)
        tb = t.view(-1, *([1] * (x0.dim() - 1)))
        xt = (1 - tb) * x0 + tb * x1
        loss = (velocity(model, xt, t) - (x1 - x0)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, t_couple


def integrate(model, x0, n_steps):
    """Euler trajectory (n_steps + 1, *x0.shape) and the velocities along it."""
    import torch

    xs, vs = [x0], []
    with torch.no_grad():
        x = x0
        for k in range(n_steps):
            t = torch.full((1, 1), k / n_steps, device=x0.device)
            v = velocity(model, x, t)
            vs.append(v)
            x = x + v / n_steps
            xs.append(x)
    return torch.stack(xs), torch.stack(vs)


def straightness(xs, vs):
    """mean_k ‖v_k − (x_K − x_0)‖² / mean ‖x_K − x_0‖² (0: straight, constant-speed paths)."""
    disp = xs[-1] - xs[0]
    dev = (vs - disp[None]).flatten(2).square().sum(-1).mean()
    return float(dev / disp.flatten(1).square().sum(-1).mean())


def divergence(a, b):
    import flashsinkhorn as fs

    a, b = a.flatten(1), b.flatten(1)
    msd = float(a.var(0).sum() + b.var(0).sum() + (a.mean(0) - b.mean(0)).square().sum())
    return float(fs.sinkhorn_divergence(a, b, eps=0.01 * msd))


def evaluate(model, problem, n, device, seed):
    import torch

    src, tgt, _, _ = PROBLEMS[problem]
    gen = torch.Generator().manual_seed(seed + 1000)
    x0, data = src(n, gen).to(device), tgt(n, gen).to(device)
    xs, vs = integrate(model, x0, 32)
    few, _ = integrate(model, x0, 2)
    return {"straightness": straightness(xs, vs), "div_2": divergence(few[-1], data),
            "div_32": divergence(xs[-1], data)}, xs, few[-1], data  # fmt: skip


# ----- figures -----


def plot_2d(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(4 * len(results), 8), squeeze=False)
    for c, (method, r) in enumerate(results.items()):
        xs, few, data = (t.cpu() for t in (r["xs"], r["few"], r["data"]))
        ax = axes[0, c]
        for k in range(0, xs.shape[1], max(1, xs.shape[1] // 120)):
            ax.plot(xs[:, k, 0], xs[:, k, 1], lw=0.5, color="tab:blue", alpha=0.5)
        ax.scatter(xs[0, :, 0], xs[0, :, 1], s=1, color="k")
        ax.scatter(xs[-1, :, 0], xs[-1, :, 1], s=1, color="tab:red")
        ax.set_title(f"{method}: paths (32 Euler steps)\nstraightness {r['straightness']:.3f}")
        ax = axes[1, c]
        ax.scatter(data[:, 0], data[:, 1], s=1, color="0.7", label="data")
        ax.scatter(few[:, 0], few[:, 1], s=1, color="tab:red", label="2 Euler steps")
        ax.set_title(f"2-step samples, S_eps to data {r['div_2']:.3f}")
        ax.legend(loc="lower right", markerscale=6, fontsize=7)
        for ax in axes[:, c]:
            ax.set_aspect("equal")
            ax.set_xlim(-6, 6)
            ax.set_ylim(-6, 6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_images(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(3.6 * len(results), 4), squeeze=False)
    for c, (method, r) in enumerate(results.items()):
        imgs = r["few"][:36].cpu().reshape(6, 6, 8, 8).permute(0, 2, 1, 3).reshape(48, 48)
        ax = axes[0, c]
        ax.imshow(imgs.clamp(-1, 1), cmap="gray", vmin=-1, vmax=1)
        ax.set_title(f"{method}: 2-step samples\nstraightness {r['straightness']:.3f}, "
                     f"S_eps {r['div_2']:.2f}", fontsize=9)  # fmt: skip
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main():
    args = parse()
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    quick = args.quick if args.quick is not None else device.type != "cuda"
    threads = args.threads if args.threads is not None else (1 if quick else None)
    if threads:
        torch.set_num_threads(threads)
    steps = args.steps or (80 if quick else 2000)
    batch = args.batch or (96 if quick else 512)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"device {device}, {steps} steps, batch {batch}")
    for problem in PROBLEMS:
        results = {}
        for method in METHODS:
            if coupling(method) is None:
                print(f"{problem:6s} {method:11s} skipped (needs torchcfm or POT)")
                continue
            t0 = time.perf_counter()
            model, t_couple = train(problem, method, steps, batch, device, args.seed)
            total = time.perf_counter() - t0
            stats, xs, few, data = evaluate(model, problem, 1000, device, args.seed)
            results[method] = {**stats, "xs": xs, "few": few, "data": data}
            print(f"{problem:6s} {method:11s} straightness {stats['straightness']:.3f}  "
                  f"S_eps 2 steps {stats['div_2']:.4f}  32 steps {stats['div_32']:.4f}  "
                  f"coupling {1e3 * t_couple / steps:.1f} ms/step  "
                  f"train {total:.1f} s")  # fmt: skip
        path = out / f"flow_matching_{problem}.png"
        (plot_2d if problem == "2d" else plot_images)(results, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
