"""The stages of the multiscale solve on a 2-D example, drawn into one PNG.

Two clouds (a mixture of Gaussians and a noisy ring) are solved with
``flashsinkhorn.sinkhorn(path="multiscale")``; the figure shows

1. the Morton tiles of x (points coloured by tile) and the coarse cells' centroids;
2. the coarse plan between the centroids (the strongest couplings, as segments);
3. the block-sparse pattern of the fine stage: which (x tile, y tile) pairs the soft-mins
   visit, against all pairs.

Usage:
    python examples/multiscale_stages.py --out docs/img/multiscale_stages.png
    python examples/multiscale_stages.py --quick          # fewer points (CPU)
"""

from __future__ import annotations

import argparse
import os


def parse(argv=None):
    ap = argparse.ArgumentParser(description="Draw the coarse and fine multiscale stages (2-D).")
    ap.add_argument("--out", default="out/multiscale_stages.png", help="PNG to write")
    ap.add_argument("--n", type=int, default=20_000, help="points per cloud")
    ap.add_argument("--quick", action="store_true", help="3,000 points per cloud")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return ap.parse_args(argv)


def clouds(n: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[-0.6, -0.4], [0.5, -0.5], [0.0, 0.6], [-0.7, 0.5]])
    lab = torch.randint(0, 4, (n,), generator=g)
    x = centres[lab] + 0.12 * torch.randn(n, 2, generator=g)
    t = torch.rand(n, generator=g) * 6.2832
    r = 1.2 + 0.04 * torch.randn(n, generator=g)
    y = torch.stack([r * torch.cos(t), r * torch.sin(t)], 1)
    return x, y


def main(argv=None):
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import flashsinkhorn as fs
    from flashsinkhorn.multiscale.clustering import TILE, cells
    from flashsinkhorn.multiscale.solver import _budget, coarse_side

    n = 3000 if args.quick else args.n
    x, y = clouds(n)
    diam = float((torch.cat([x, y]).amax(0) - torch.cat([x, y]).amin(0)).norm())
    eps = (0.01 * diam) ** 2
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = fs.sinkhorn(x.to(dev), y.to(dev), eps=eps, tol=1e-3, path="multiscale")
    be = res.solution.backend
    p = res.solution.problem
    lx, ly = be.layout(p.X), be.layout(p.Y)
    cx, cy = cells(lx, p.X.x, _budget(n)), cells(ly, p.Y.x, _budget(n))
    print(f"n = {n}: value {float(res.value):.5f}, {res.n_iters} fine iterations after "
          f"{be.state.coarse_iters} coarse ones on {int(cx.count[0])} + {int(cy.count[0])} cells "
          f"(eps_c = {be.state.eps_coarse:.3g}, eps = {eps:.3g}); {be.state.pattern.pairs} of "
          f"{lx.tiles * ly.tiles} tile pairs visited")  # fmt: skip
    # the coarse plan at eps_c, from a solve on the centroids alone
    CX, CY = coarse_side(p.X, cx), coarse_side(p.Y, cy)
    C = torch.cdist(CX.x[0], CY.x[0]) ** 2
    coarse = fs.solve(C, CX.w[0], CY.w[0], eps=be.state.eps_coarse, tol=1e-3)
    plan = coarse.plan().cpu()

    centre = p.centre[0].cpu()
    slot = lx.slot[0].cpu()
    pts = lx.x[0].cpu()[slot, :2] + centre
    tile = slot // TILE
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    ax = axes[0]
    ax.scatter(pts[:, 0], pts[:, 1], c=tile % 20, cmap="tab20", s=1)
    yc = y.cpu()
    ax.scatter(yc[:, 0], yc[:, 1], c="0.8", s=0.5)
    cxc = CX.x[0].cpu() + centre
    ax.scatter(cxc[:, 0], cxc[:, 1], c="k", s=6)
    ax.set_title(f"Morton tiles of x ({TILE} points, colour) and {int(cx.count[0])} cells")
    ax = axes[1]
    cyc = CY.x[0].cpu() + centre
    ax.scatter(cxc[:, 0], cxc[:, 1], s=300 * CX.w[0].cpu(), c="tab:blue")
    ax.scatter(cyc[:, 0], cyc[:, 1], s=300 * CY.w[0].cpu(), c="tab:orange")
    top = plan > plan.max() * 0.05
    for i, j in top.nonzero().tolist():
        ax.plot([cxc[i, 0], cyc[j, 0]], [cxc[i, 1], cyc[j, 1]], c="k", lw=0.3, alpha=0.6)
    ax.set_title(f"coarse plan at eps_c = {be.state.eps_coarse:.2g}")
    ax = axes[2]
    mask = torch.zeros(lx.tiles, ly.tiles)
    mask[be.state.pattern.rows.cpu(), be.state.pattern.cols.cpu()] = 1
    # tiles holding points (the padding tiles at the end are never visited)
    rx = lx.real[0].reshape(-1, TILE).any(1).cpu()
    ry = ly.real[0].reshape(-1, TILE).any(1).cpu()
    real_x, real_y = int(rx.sum()), int(ry.sum())
    ax.imshow(mask[rx][:, ry], cmap="Greys", interpolation="nearest", aspect="auto")
    frac = be.state.pattern.pairs / (real_x * real_y)
    ax.set_title(f"fine stage: visited tile pairs ({100 * frac:.1f}%)")
    ax.set_xlabel("y tile (Morton order)")
    ax.set_ylabel("x tile (Morton order)")
    for a in axes[:2]:
        a.set_aspect("equal")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
