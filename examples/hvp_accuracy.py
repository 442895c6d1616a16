"""Accuracy of the streaming HVP against a dense pseudo-inverse reference (paper H.2.3).

Setup of the paper's Table 13: n = m = 512, d = 4, X, Y ~ N(0, I), random simplex weights,
eps in {0.1, 0.25, 0.5}. The reference is the implicit-function Hessian of the dual objective
D(x, f, g) at converged float64 potentials, G* = D_xx A − D_xz D_zz⁺ D_zx A, with every
derivative of D taken by autograd and D_zz⁺ from an eigendecomposition (threshold 1e-10 of
the largest eigenvalue). Reported: ‖G − G*‖_F / ‖G*‖_F, CG iterations, true residual.

    python examples/hvp_accuracy.py [--n 512] [--seed 0] [--quick]

Runs on the CPU (float64 reference, torch backend). Measured on a shared 2-core CPU (load
average 3–6 from other jobs), whole command: ``--quick`` (n = 128, one torch thread) 6.6 s;
n = 512: 15 s with ``--threads 1``, 148 s with torch's default two threads.
"""

from __future__ import annotations

import argparse
import time

#: Quick runs use one torch thread: on a 2-core machine busy with other jobs, torch's two
#: threads per process oversubscribe the cores (shuffled_regression.py --quick, 30 steps:
#: 10.5 s with one thread, 159 s with two, at a load average of 6).
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=None, help="points per cloud (512; 128 with --quick)")
    ap.add_argument("--d", type=int, default=4, help="dimension")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="n = 128: a few seconds on a CPU")
    ap.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    return ap.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help returns here, before the heavy imports

import torch  # noqa: E402

import flashsinkhorn as fs  # noqa: E402


def set_threads(threads: int | None, quick: bool) -> None:
    if threads is None and quick:
        threads = 1
    if threads:
        torch.set_num_threads(threads)


def reference_hvp(x, y, a, b, f, g, eps, A):
    """G* = D_xx A − D_xz D_zz⁺ D_zx A at potentials (f, g), float64, dense n × m."""
    x = x.clone().requires_grad_()
    z = torch.cat([f, g]).clone().requires_grad_()
    n = x.shape[0]

    def D(x, z):
        C = ((x[:, None] - y[None]) ** 2).sum(-1)
        K = a[:, None] * b[None] * torch.exp((z[:n, None] + z[None, n:] - C) / eps)
        return (a * z[:n]).sum() + (b * z[n:]).sum() - eps * K.sum()

    gx, gz = torch.autograd.grad(D(x, z), (x, z), create_graph=True)
    Dxx_A, Dzx_A = torch.autograd.grad((gx * A).sum(), (x, z), retain_graph=True)
    # D_zz = −(1/eps) [[diag P1, P], [Pᵀ, diag Pᵀ1]]: dense, by autograd row by row is slow,
    # so take it from the Jacobian of gz (one backward per coordinate would be (n+m) passes).
    Dzz = torch.autograd.functional.jacobian(
        lambda zz: torch.autograd.grad(D(x.detach(), zz), zz, create_graph=True)[0], z.detach()
    )
    evals, evecs = torch.linalg.eigh(Dzz)
    keep = evals.abs() > 1e-10 * evals.abs().max()
    pinv = (evecs[:, keep] / evals[keep]) @ evecs[:, keep].T
    w = pinv @ Dzx_A
    (Dxz_w,) = torch.autograd.grad((gz * w).sum(), x)
    return (Dxx_A - Dxz_w).detach()


def main(args: argparse.Namespace) -> None:
    set_threads(args.threads, args.quick)
    args.n = args.n or (128 if args.quick else 512)
    gen = torch.Generator().manual_seed(args.seed)
    n, d = args.n, args.d
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = torch.randn(n, d, generator=gen, dtype=torch.float64)
    a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.05
    b = torch.rand(n, generator=gen, dtype=torch.float64) + 0.05
    a, b = a / a.sum(), b / b.sum()
    A = torch.randn(n, d, generator=gen, dtype=torch.float64)
    tight = dict(tol=1e-12, n_iters=200000)  # solve converged: isolates the HVP's own error
    settings = [
        ("f64 solve tol 1e-12, tau=0, cg_tol=1e-10", torch.float64,
         dict(tau=0.0, cg_tol=1e-10, **tight)),
        ("f64 solve tol 1e-12, tau=0, cg_tol=1e-7", torch.float64,
         dict(tau=0.0, cg_tol=1e-7, **tight)),
        ("f64 solve tol 1e-12, defaults", torch.float64, tight),
        ("f64 all defaults", torch.float64, {}),
        ("f32 all defaults", torch.float32, {}),
    ]  # fmt: skip
    print(f"n = m = {n}, d = {d}, seed {args.seed}; relative error vs dense pseudo-inverse")
    for eps in (0.1, 0.25, 0.5):
        res = fs.sinkhorn(x, y, a, b, eps=eps, tol=1e-12, n_iters=200000)
        G_ref = reference_hvp(x, y, a, b, res.f, res.g, eps, A)
        for label, dtype, opts in settings:
            t0 = time.perf_counter()
            out = fs.hvp(
                x.to(dtype), y.to(dtype), A.to(dtype), a.to(dtype), b.to(dtype), eps=eps, **opts
            )
            ms = 1e3 * (time.perf_counter() - t0)
            err = float((out.hvp.double() - G_ref).norm() / G_ref.norm())
            print(
                f"eps={eps:<5} {label:<41} rel.err {err:.2e}  CG its {out.cg_iters:4d}  "
                f"true residual {out.residual:.1e}  ({ms:.0f} ms incl. solve, CPU)"
            )


if __name__ == "__main__":
    main(ARGS)
