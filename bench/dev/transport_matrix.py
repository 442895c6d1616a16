"""Compiled-kernel matrix of the transport launch kinds (development check, not a test).

Each (precision, d) pair runs in its own process with CUDA_LAUNCH_BLOCKING=1, every launch kind
in turn (width 1, width 5, width 40, Hadamard of rank 2, 17, 40 and 64, gradient, both orientations),
printing one line per kind before and after it: a fault names its launch and cannot poison the
other pairs. Errors are relative to the torch backend at "ieee".

    python bench/dev/transport_matrix.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PRECISIONS = ("ieee", "tf32", "tf32x3")
DIMS = (17, 70, 130)


def _child(precision: str, d: int) -> None:
    import torch

    from flashsinkhorn.backends import TorchBackend, resolve_backend
    from flashsinkhorn.problem import prepare

    g = torch.Generator().manual_seed(d)
    B, n, m, eps = 2, 213, 338, 0.4
    x = torch.rand(B, n, d, generator=g).cuda()
    y = (torch.rand(B, m, d, generator=g) * 1.3 + 0.2).cuda()
    p = prepare(x, y, None, None, rho_x=None, rho_y=None, precision=precision)
    tb, tri = TorchBackend(), resolve_backend("triton", p.device, torch.float32)
    zx = torch.zeros_like(p.X.sq)
    gp, _ = tb.softmin(p.Y, p.X, zx, eps, torch.zeros_like(p.Y.sq), 0.0, 1.0, False, "ieee")
    fp, _ = tb.softmin(p.X, p.Y, gp, eps, zx, 0.0, 1.0, False, "ieee")

    def rel(u, v):
        return float((u - v).abs().max() / v.abs().max())

    kinds = []
    for w in (1, 5, 40):
        kinds.append((f"width{w}", torch.randn(B, m, w, generator=g).cuda(), None, None))
    for r in (2, 17, 40, 64):
        A = torch.randn(B, n, r, generator=g).cuda()
        Bw = torch.randn(B, m, r, generator=g).cuda()
        kinds.append((f"hadamard{r}", torch.randn(B, m, 3, generator=g).cuda(), A, Bw))
    for name, V, A, Bw in kinds:
        print(f"RUN {precision} d={d} {name}", flush=True)
        out, _ = tri.transport(p.X, p.Y, fp, gp, eps, V, A, Bw, precision)
        torch.cuda.synchronize()
        ref, _ = tb.transport(p.X, p.Y, fp, gp, eps, V, A, Bw, "ieee")
        print(f"OK  {precision} d={d} {name} rel={rel(out, ref):.2e}", flush=True)
    print(f"RUN {precision} d={d} grad", flush=True)
    gr, _ = tri.transport_grad(p.X, p.Y, fp, gp, eps, precision)
    torch.cuda.synchronize()
    gref, _ = tb.transport_grad(p.X, p.Y, fp, gp, eps, "ieee")
    print(f"OK  {precision} d={d} grad rel={rel(gr, gref):.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=2, default=None)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    lines, results = [], []
    for precision in PRECISIONS:
        for d in DIMS:
            cmd = [sys.executable, __file__, "--child", precision, str(d)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            out = proc.stdout.strip().splitlines()
            last = out[-1] if out else ""
            status = "ok" if proc.returncode == 0 else f"rc={proc.returncode} after: {last}"
            print(f"{precision:7s} d={d:4d}: {status}", flush=True)
            for line in out:
                if line.startswith("OK"):
                    print("   ", line)
            if proc.returncode != 0:
                print("   ", proc.stderr.strip().splitlines()[-1:] if proc.stderr else "")
            lines += out
            results.append({"precision": precision, "d": d, "rc": proc.returncode,
                            "stdout": out, "stderr_tail": proc.stderr[-2000:]})  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "transport_matrix.json"), "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
