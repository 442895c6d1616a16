"""float32 against float64 over eps/diameter²: the measurements behind docs/precision.md.

For each eps/diameter² (diameter: the bounding-box diagonal of both clouds) and every cloud
of a fixed grid (sizes, dimensions, scales, offsets), solves the same problem in float32 and
float64 with the same fixed number of iterations and reports the worst relative error of the
value and of the ot_cost gradient (x and y together). Below the plan floor the library
refuses gradients (limits.PLAN_FLOOR_ULPS); the script lowers the floor to 0 to show why.

    python bench/precision_range.py            # torch backend, about 10 min on 2 CPU cores
    python bench/precision_range.py --quick    # fewer clouds
    TRITON_INTERPRET=1 python bench/precision_range.py --backend triton --quick
"""

from __future__ import annotations

import argparse
import itertools
import math
import warnings

import torch

import flashsinkhorn as fs
from flashsinkhorn import limits
from flashsinkhorn.solvers import estimate_diameter

RATIOS = [1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 3e-5, 1e-4, 1e-3, 1e-2, 1.0, 1e2, 1e4, 1e6, 1e8]


def clouds(quick: bool):
    g = torch.Generator().manual_seed(0)
    sizes = [(7, 5), (31, 23)] if quick else [(7, 5), (31, 23), (100, 80)]
    dims = [1, 3] if quick else [1, 3, 16]
    for (n, m), d, scale, off in itertools.product(sizes, dims, [1.0, 1e3], [0.0, 100.0]):
        x = torch.randn(n, d, generator=g) * scale + off * scale
        y = torch.randn(m, d, generator=g) * scale + (off + 0.5) * scale
        yield x.float(), y.float()


def run(x, y, eps, backend, dtype):
    xg = x.to(dtype).requires_grad_(True)
    yg = y.to(dtype).requires_grad_(True)
    b = backend if dtype != torch.float64 else "torch"
    kw = dict(eps=eps, tol=None, n_iters=50, backend=b)
    if b == "triton":
        kw["precision"] = "ieee"
    v = fs.ot_cost(xg, yg, **kw)
    gx, gy = torch.autograd.grad(v, (xg, yg))
    return float(v), torch.cat([gx, gy]).double()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    limits.PLAN_FLOOR_ULPS = 0.0  # measure below the floor too
    worst = {r: [0.0, 0.0, 0] for r in RATIOS}
    for x, y in clouds(args.quick):
        diam2 = estimate_diameter(x[None].double(), y[None].double()) ** 2
        for r in RATIOS:
            v32, g32 = run(x, y, r * diam2, args.backend, torch.float32)
            v64, g64 = run(x, y, r * diam2, args.backend, torch.float64)
            w = worst[r]
            if not (math.isfinite(v32) and bool(torch.isfinite(g32).all())):
                w[2] += 1
                continue
            w[0] = max(w[0], abs(v32 - v64) / abs(v64))
            w[1] = max(w[1], float((g32 - g64).norm() / g64.norm()))
    print("| eps/diameter² | value | gradient | non-finite |")
    print("|---|---|---|---|")
    for r in RATIOS:
        v, g, bad = worst[r]
        print(f"| {r:.0e} | {v:.1e} | {g:.1e} | {bad} |")


if __name__ == "__main__":
    main()
