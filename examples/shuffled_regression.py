"""Shuffled regression with saddle detection and Newton (paper H.4), on synthetic data.

Data shaped like the flow-cytometry set of the paper (n = 40,000 cells, d = 5 markers; no
download): a skewed, clustered, standardised design X; a hidden map W* with entries
N(0, 1/5); responses Y = X W* + E with E ~ N(0, σ²), σ = 0.05 std(X W*); and the responses
shuffled by an unknown permutation, Ỹ = Π(Y). W is fitted by minimising

    L(W) = OT_eps( (1/n) Σ δ_{x_i W}, (1/n) Σ δ_{ỹ_j} ),   cost ‖·‖²  (not debiased),

a non-convex objective with saddles. Paper H.4 protocol: full-batch Adam (lr 0.03, betas
(0.9, 0.999)) while λmin(H_W) < 1e-3, checked every 5 steps; Newton after, with the direction
from CG on H_W (at most 100 iterations, tolerance 1e-6), initial step 10 and Armijo
backtracking (β = 0.5, c = 0.1); back to Adam when λmin falls below the threshold again;
stop when ‖∇L‖ < 5e-3 or after 3 Newton steps without improvement. The solve anneals eps
from the diameter² by a factor 0.9 per iteration, then iterates at eps.

H_W is the 25 × 25 Hessian of L in W: H_W V = Xᵀ T (X V), T the Hessian of OT_eps in the
points y = X W (paper §4.2). It is built here from 25 streaming HVPs of T at once: the
columns X E_k share one plan, so their Schur systems are solved as one batched CG whose
matvecs are transports of 25 columns (about the cost of one HVP), and the Hadamard term uses
the row moments Σ_j P_ij ỹ_j ỹ_jᵀ (one transport of d² columns). The first check compares
a column with the library's double-backward HVP (``torch.autograd.grad`` through
``flashsinkhorn.ot_cost``). λmin is ``eigsh(H_W, k=1, which="SA")``.

Usage:
    python examples/shuffled_regression.py --n 40000 --out OUT     # CUDA, a few minutes
    python examples/shuffled_regression.py --quick --out OUT       # CPU, float64, n = 500

``--quick`` (CPU, float64, n = 500, eps = 0.5, one torch thread) anneals by 0.7 per step and
runs 30 iterations at eps (0.9 and 60 otherwise), and caps the reference minimiser at 10 s:
Adam switches to Newton at step 125 and ‖∇L‖ < 5e-3 holds after 129 steps. Measured on a
shared 2-core CPU (load average about 4 from other jobs): 27 s for the whole command (the
optimisation 20 s). With the former quick settings (0.9, 60 iterations) the first 30 steps
took 10.5 s with one torch thread and 159 s with two at load 6: oversubscribed threads, more
than the work, made those quick runs take many minutes.

Writes OUT/shuffled_regression.png (loss, gradient norm, λmin) and
OUT/shuffled_regression.json (settings, outcome, λmin trajectory, Newton switches,
parameter error against W*). Progress is printed as it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

#: Quick runs use one torch thread: on a 2-core machine busy with other jobs, torch's two
#: threads per process oversubscribe the cores (shuffled_regression.py --quick, 30 steps:
#: 10.5 s with one thread, 159 s with two, at a load average of 6).
THREADS_HELP = "torch CPU threads (default: 1 with --quick, else torch's default)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_pos", nargs="?", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="output folder (default out/shuffled_regression)")
    ap.add_argument("--n", type=int, default=None, help="points (default 40000; 500 with --quick)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="CPU, float64, n = 500, eps = 0.5, eps x 0.7 per annealing step, 30 iterations "
        "at eps, the reference minimiser capped at 10 s",
    )
    ap.add_argument("--eps", type=float, default=None, help="paper: 0.1 (default), 0.25, 0.5")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--max-seconds", type=float, default=None, help="wall-clock budget")
    ap.add_argument("--check-every", type=int, default=5, help="Adam steps per λmin check")
    ap.add_argument("--lr", type=float, default=0.03)
    ap.add_argument("--lam-switch", type=float, default=1e-3)
    ap.add_argument("--newton-t0", type=float, default=10.0, help="initial Armijo step")
    ap.add_argument("--gtol", type=float, default=5e-3)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--adam-only", action="store_true", help="never switch (baseline)")
    ap.add_argument(
        "--anneal", type=float, default=None, help="eps factor per annealing step (0.9; 0.7 quick)"
    )
    ap.add_argument(
        "--tol", type=float, default=0.0, help="Sinkhorn marginal tolerance (0: fixed count)"
    )
    ap.add_argument(
        "--sinkhorn-iters",
        type=int,
        default=None,
        help="iterations at eps, the cap with --tol (60; 30 with --quick)",
    )
    ap.add_argument(
        "--precision",
        default=None,
        help='kernel precision (default "tf32x3" on CUDA: fp32-accurate on the tensor cores)',
    )
    ap.add_argument("--tau", type=float, default=1e-5, help="relative Schur damping")
    ap.add_argument("--cg-tol", type=float, default=1e-6, help="Schur CG tolerance")
    ap.add_argument("--cg-max-iter", type=int, default=500, help="Schur CG cap")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--no-verify", action="store_true", help="skip the double-backward check")
    ap.add_argument("--no-reference", action="store_true", help="skip the minimiser near W*")
    ap.add_argument("--replot", default=None, help="only redraw the PNG of a summary JSON")
    ap.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    return ap.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # --help returns here, before the heavy imports

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.sparse.linalg import eigsh  # noqa: E402

import flashsinkhorn as fs  # noqa: E402
from flashsinkhorn.hessian import TransportHessian, cg_solve  # noqa: E402


def set_threads(threads: int | None, quick: bool) -> None:
    if threads is None and quick:
        threads = 1
    if threads:
        torch.set_num_threads(threads)


def cytometry_like(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """Skewed, clustered, correlated positive measurements, log-transformed and standardised."""
    k = 4
    centres = torch.randn(k, d, generator=gen, dtype=torch.float64) * 1.2
    labels = torch.randint(0, k, (n,), generator=gen)
    mix = torch.randn(d, d, generator=gen, dtype=torch.float64) * 0.3 + torch.eye(d)
    noise = torch.randn(n, d, generator=gen, dtype=torch.float64)
    z = torch.log1p(torch.exp(0.6 * (centres[labels] + noise @ mix)))
    return (z - z.mean(0)) / z.std(0)


def make_data(n: int, d: int, seed: int):
    """(X, Ỹ, W*, W0) in float64 on the CPU (paper H.4 data model)."""
    gen = torch.Generator().manual_seed(seed)
    X = cytometry_like(n, d, gen)
    W_true = torch.randn(d, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    Y = X @ W_true
    Y = Y + 0.05 * Y.std() * torch.randn(n, d, generator=gen, dtype=torch.float64)
    Y = Y[torch.randperm(n, generator=gen)]  # the unknown permutation
    W0 = torch.randn(d, d, generator=gen, dtype=torch.float64) / math.sqrt(d)
    return X, Y, W_true, W0


class Objective:
    """L(W), ∇L and the 25 × 25 Hessian from one Sinkhorn solve at W."""

    def __init__(self, X, Y, solve_opts, hvp_opts):
        self.X, self.Y = X, Y
        self.solve_opts, self.hvp_opts = solve_opts, hvp_opts
        self.n_solves = 0
        self.solve_iters = []

    def solve(self, W):
        res = fs.sinkhorn(self.X @ W, self.Y, **self.solve_opts)
        self.n_solves += 1
        self.solve_iters.append(int(res.n_iters))
        return res

    def value(self, W) -> float:
        return float(self.solve(W).value)

    def evaluate(self, W):
        """(loss, gradient (d, d), cached plan): ∇L = Xᵀ 2 (diag(â) y − P ỹ)."""
        res = self.solve(W)
        th = TransportHessian(res)
        y = th.x[0]
        G = 2.0 * (th.am[0, :, None] * y - th.Py[0])
        return float(res.value), self.X.T @ G, th

    def hessian(self, th):
        """H_W (d², d²) float64 NumPy from 25 HVPs of T at once (module docstring)."""
        X = self.X
        n, d = X.shape
        K = d * d
        x, z = th.x[0], th.y[0]
        am, bm, Py = th.am[0], th.bm[0], th.Py[0]
        eps = th.eps
        tau, cg_tol, cg_max_iter = (self.hvp_opts[k] for k in ("tau", "cg_tol", "cg_max_iter"))
        # Directions A_k = X E_k, E_k the k-th unit matrix (row-major over W).
        A = torch.zeros(K, n, d, dtype=x.dtype, device=x.device)
        for k in range(K):
            A[k, :, k % d] = X[:, k // d]
        p = torch.einsum("nd,knd->kn", x, A)
        half_r1 = am * p - torch.einsum("nd,knd->kn", Py, A)
        r1 = 2.0 * half_r1
        inv_am = torch.where(am > 0, 1.0 / am, torch.zeros_like(am))
        cols = torch.cat(
            [A.permute(1, 0, 2).reshape(n, K * d), p.T, (r1 * inv_am).T], dim=1
        )  # (n, K d + 2K)
        out = th.Pt(cols[None])[0]
        PtA = out[:, : K * d].reshape(-1, K, d).permute(1, 0, 2)
        Ptp, Pt_r1 = out[:, K * d : K * d + K].T, out[:, K * d + K :].T
        rhs = 2.0 * (Ptp - torch.einsum("md,kmd->km", z, PtA)) - Pt_r1

        def schur(V):  # (K, m) -> (S + tau diag b̂) V, all K systems in two transports
            PV = th.P(V.T.contiguous()[None])[0]
            return (1.0 + tau) * bm * V - th.Pt((PV * inv_am[:, None])[None])[0].T

        precond = (1.0 / ((1.0 + tau) * bm)).expand(K, -1).contiguous()
        v, info = cg_solve(
            schur, rhs, precond, tol=cg_tol, max_iter=cg_max_iter, project=(tau == 0)
        )
        out = th.P(
            torch.cat([v.T, (v[:, :, None] * z).permute(1, 0, 2).reshape(-1, K * d)], 1)[None]
        )[0]
        Pv, Pvz = out[:, :K].T, out[:, K:].reshape(n, K, d).permute(1, 0, 2)
        u = (r1 - Pv) * inv_am
        # Σ_j P_ij (A_i·ỹ_j) ỹ_j = M_i A_i with the row moments M_i = Σ_j P_ij ỹ_j ỹ_jᵀ.
        M = th.P((z[:, :, None] * z[:, None, :]).reshape(1, -1, d * d))[0].reshape(n, d, d)
        Had = torch.einsum("nab,knb->kna", M, A)
        T1 = u[..., None] * (am[:, None] * x - Py) + x * Pv[..., None] - Pvz
        T2 = x * half_r1[..., None] - p[..., None] * Py + Had
        Hy = (2.0 / eps) * (T1 - 2.0 * T2) + 2.0 * am[:, None] * A
        H = torch.einsum("na,knb->kab", X, Hy).reshape(K, K).T  # column k = vec(Xᵀ T A_k)
        H = H.double().cpu().numpy()
        return 0.5 * (H + H.T), info

    def hvp_double_backward(self, W, k: int):
        """Column k of H_W by the library's double backward (independent check)."""
        d = W.shape[0]
        Wr = W.detach().clone().requires_grad_()
        opts = {**self.solve_opts, "hvp_options": dict(self.hvp_opts)}
        L = fs.ot_cost(self.X @ Wr, self.Y, **opts)
        (g,) = torch.autograd.grad(L, Wr, create_graph=True)
        E = torch.zeros(d * d, dtype=W.dtype, device=W.device)
        E[k] = 1
        (Hv,) = torch.autograd.grad(g, Wr, E.reshape(d, d))
        return Hv.detach().double().cpu().numpy().reshape(-1)


def lambda_min(H: np.ndarray) -> float:
    """Smallest eigenvalue by Lanczos (``eigsh``, which="SA"), as in the paper."""
    return float(eigsh(H, k=1, which="SA", tol=1e-10, return_eigenvectors=False)[0])


def newton_direction(H: np.ndarray, g: np.ndarray, max_iter=100, tol=1e-6):
    """CG on H p = −g (paper: at most 100 iterations, tolerance 1e-6); None on negative
    curvature."""
    p = np.zeros_like(g)
    r = -g.copy()
    q = r.copy()
    rr = r @ r
    gn = np.linalg.norm(g)
    for _ in range(max_iter):
        Hq = H @ q
        curv = q @ Hq
        if curv <= 0:
            return None
        alpha = rr / curv
        p += alpha * q
        r -= alpha * Hq
        rr_new = r @ r
        if math.sqrt(rr_new) <= tol * gn:
            break
        q = r + (rr_new / rr) * q
        rr = rr_new
    return p


def local_minimum_near(obj: Objective, W, gtol: float, max_steps=30, max_seconds=math.inf):
    """Newton with Armijo backtracking from ``W`` (the reference minimiser near W*: because
    of the entropic bias W* itself is not a critical point of L). Returns (W, loss, ‖∇L‖)."""
    W = W.clone()
    t0 = time.perf_counter()
    for _ in range(max_steps):
        if time.perf_counter() - t0 > max_seconds:
            break
        L, g, th = obj.evaluate(W)
        if float(g.norm()) < gtol:
            break
        H, _ = obj.hessian(th)
        gv = g.double().cpu().numpy().reshape(-1)
        p = newton_direction(H, gv)
        if p is None:
            p = -gv
        P = torch.as_tensor(p.reshape(W.shape), dtype=W.dtype, device=W.device)
        t = 1.0
        while t >= 1e-6 and obj.value(W + t * P) > L + 0.1 * t * float(gv @ p):
            t *= 0.5
        if t < 1e-6:
            break
        W = W + t * P
    L, g, _ = obj.evaluate(W)
    return W, L, float(g.norm())


def plot(summary: dict, path: pathlib.Path) -> bool:
    """Loss, gradient norm and λmin from a summary dict; False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (replot later with --replot JSON)", flush=True)
        return False
    lam_thr = summary["settings"]["lam_switch"]
    lam = summary["lambda_min_trajectory"]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.8))
    steps = np.arange(len(summary["loss"]))
    ax[0].plot(steps, summary["loss"])
    ax[0].axhline(summary["loss_at_W_true"], color="k", ls=":", lw=1, label="at W*")
    ax[0].set(title="loss OT_eps(XW, Ỹ)", xlabel="step")
    ax[0].legend(loc="upper right", fontsize=8)
    ax[1].semilogy(steps, summary["grad_norm"])
    ax[1].set(title="‖∇L(W)‖", xlabel="step")
    ax[2].plot([c["step"] for c in lam], [c["lambda_min"] for c in lam], "o-", ms=3)
    ax[2].axhline(lam_thr, color="g", ls="--", lw=1, label=f"switch at {lam_thr:g}")
    ax[2].axhline(0.0, color="k", lw=0.5)
    ax[2].set_yscale("symlog", linthresh=1e-3)
    ax[2].set(title="λmin(H_W) (eigsh on streaming HVPs)", xlabel="step")
    ax[2].legend(loc="lower right", fontsize=8)
    newton = np.flatnonzero(np.array([ph == "newton" for ph in summary["phase"]]))
    for a_ in ax:
        for st in newton:
            a_.axvspan(st - 0.5, st + 0.5, color="orange", alpha=0.25, lw=0)
    fig.suptitle(
        f"shuffled regression n={summary['n']} eps={summary['eps']} seed={summary['seed']} "
        f"({summary['device']})   orange: Newton steps",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(args: argparse.Namespace) -> None:
    set_threads(args.threads, args.quick)
    # The quick run takes a shorter ladder and fewer iterations per solve (about 48 instead of
    # 120 on average); on the default data it still switches to Newton after ~125 Adam steps.
    if args.anneal is None:
        args.anneal = 0.7 if args.quick else 0.9
    if args.sinkhorn_iters is None:
        args.sinkhorn_iters = 30 if args.quick else 60
    if args.replot:
        src = pathlib.Path(args.replot)
        png = src.with_suffix(".png")
        if plot(json.loads(src.read_text()), png):
            print(f"wrote {png}")
        return

    device = torch.device(
        args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    )
    cuda = device.type == "cuda"
    n = args.n or (500 if args.quick or not cuda else 40_000)
    # At small n the points are sparser: eps = 0.5 at n = 500 gives plans about as sharp
    # (eps / nearest-neighbour distance²) as eps = 0.1 at n = 40,000.
    args.eps = args.eps or (0.5 if args.quick or not cuda else 0.1)
    dtype = torch.float32 if cuda else torch.float64
    out = pathlib.Path(args.out or args.out_pos or "out/shuffled_regression")
    out.mkdir(parents=True, exist_ok=True)
    d = 5
    X, Y, W_true, W0 = make_data(n, d, args.seed)
    X, Y = X.to(device, dtype), Y.to(device, dtype)
    W_true_dev = W_true.to(device, dtype)

    solve_opts = dict(
        eps=args.eps,
        scaling=math.sqrt(args.anneal) if args.anneal else None,  # eps × anneal per step
        tol=args.tol or None,  # paper: a fixed 60 iterations after the annealing
        n_iters=args.sinkhorn_iters,
        schedule="alternating",
        backend="triton" if cuda else "torch",
        precision=args.precision or ("tf32x3" if cuda else "ieee"),
    )
    hvp_opts = dict(tau=args.tau, cg_tol=args.cg_tol, cg_max_iter=args.cg_max_iter)
    obj = Objective(X, Y, solve_opts, hvp_opts)

    W = W0.to(device, dtype).clone().requires_grad_()
    adam = torch.optim.Adam([W], lr=args.lr, betas=(0.9, 0.999))
    hist = {"loss": [], "gnorm": [], "phase": [], "time": [], "lam": []}
    events, checks = [], []
    phase, lam, best, bad = "adam", float("nan"), math.inf, 0
    stop_reason = "max steps"
    t0 = time.perf_counter()
    dev_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(
        f"shuffled regression: n={n} d={d} eps={args.eps} seed={args.seed} on {dev_name} "
        f"({dtype}); loss at W*: {obj.value(W_true_dev):.5f}",
        flush=True,
    )
    verify = None
    for step in range(args.max_steps):
        if args.max_seconds and time.perf_counter() - t0 > args.max_seconds:
            stop_reason = f"time budget {args.max_seconds:g} s"
            break
        Wd = W.detach()
        L, g, th = obj.evaluate(Wd)
        gnorm = float(g.norm())
        hist["loss"].append(L)
        hist["gnorm"].append(gnorm)
        hist["phase"].append(phase)
        hist["time"].append(time.perf_counter() - t0)
        if not math.isfinite(L):
            stop_reason = "non-finite loss"
            break
        if gnorm < args.gtol:
            stop_reason = f"gradient norm {gnorm:.2e} < {args.gtol:g}"
            print(f"step {step}: {stop_reason}", flush=True)
            break
        H = None
        if phase == "newton" or step % args.check_every == 0:
            th_ = time.perf_counter()
            H, info = obj.hessian(th)
            lam = lambda_min(H)
            ht = time.perf_counter() - th_
            hist["lam"].append(lam)
            checks.append({"step": step, "lambda_min": lam, "loss": L, "grad_norm": gnorm,
                           "schur_cg_iters": int(info.iters),
                           "schur_residual": float(info.residual.max()),
                           "hessian_s": ht})  # fmt: skip
            if verify is None and not args.no_verify:
                k = int(np.argmax(np.abs(np.diag(H))))
                col = obj.hvp_double_backward(Wd, k)
                verify = float(np.linalg.norm(H[:, k] - col) / np.linalg.norm(col))
                print(f"check: H_W column {k} vs double backward: rel. diff {verify:.1e}")
            new_phase = "newton" if lam >= args.lam_switch and not args.adam_only else "adam"
            if new_phase != phase:
                events.append({"step": step, "to": new_phase, "lambda_min": lam, "loss": L})
                print(f"step {step}: λmin = {lam:+.3e} -> {new_phase}", flush=True)
            phase = new_phase
        line = (
            f"step {step:4d} [{phase:6s}] loss {L:.6f}  |grad| {gnorm:.2e}  λmin {lam:+.2e}  "
            f"‖W−W*‖/‖W*‖ {float((Wd - W_true_dev).norm() / W_true_dev.norm()):.3f}  "
            f"({time.perf_counter() - t0:.1f} s)"
        )
        if phase == "newton":
            gv = g.double().cpu().numpy().reshape(-1)
            p = newton_direction(H, gv)
            if p is None:  # cannot happen with λmin >= threshold, but be safe
                phase = "adam"
            else:
                P = torch.as_tensor(p.reshape(d, d), dtype=dtype, device=device)
                t, slope, accepted = args.newton_t0, float(gv @ p), None
                while t >= 1e-6:  # Armijo backtracking (beta 0.5, c 0.1)
                    L_new = obj.value(Wd + t * P)
                    if L_new <= L + 0.1 * t * slope:
                        accepted = L_new
                        break
                    t *= 0.5
                if accepted is not None:
                    with torch.no_grad():
                        W += t * P
                improved = accepted is not None and accepted < best - 1e-12 * abs(best)
                bad = 0 if improved else bad + 1
                best = min(best, accepted if accepted is not None else best)
                print(f"{line}  step t={t:.3g}", flush=True)
                if bad >= args.patience:
                    stop_reason = f"{args.patience} Newton steps without improvement"
                    print(f"step {step}: {stop_reason}", flush=True)
                    break
                continue
        best = min(best, L)
        adam.zero_grad()
        W.grad = g.clone()
        adam.step()
        if step % args.check_every == 0:
            print(line, flush=True)

    Wf = W.detach()
    L_final = obj.value(Wf)
    err = float((Wf - W_true_dev).norm() / W_true_dev.norm())
    wall = time.perf_counter() - t0
    newton_steps = sum(ph == "newton" for ph in hist["phase"])
    print(
        f"done ({stop_reason}): {len(hist['loss'])} steps, {newton_steps} Newton, {wall:.1f} s; "
        f"final loss {L_final:.6f} (at W*: {obj.value(W_true_dev):.6f}); "
        f"‖W − W*‖/‖W*‖ = {err:.3f}",
        flush=True,
    )
    summary = {
        "n": n,
        "d": d,
        "eps": args.eps,
        "seed": args.seed,
        "device": dev_name,
        "dtype": str(dtype),
        "settings": {k: v for k, v in vars(args).items() if k != "out_pos"},
        "solve_options": {k: v for k, v in solve_opts.items()},
        "stop_reason": stop_reason,
        "steps": len(hist["loss"]),
        "newton_steps": newton_steps,
        "newton_started_at": next((e["step"] for e in events if e["to"] == "newton"), None),
        "switches": events,
        "initial_loss": hist["loss"][0] if hist["loss"] else None,
        "final_loss": L_final,
        "loss_at_W_true": obj.value(W_true_dev),
        "final_grad_norm": hist["gnorm"][-1] if hist["gnorm"] else None,
        "final_lambda_min": hist["lam"][-1] if hist["lam"] else None,
        "param_rel_error": err,
        "reference_minimum_near_W_true": None,
        "W_final": Wf.double().cpu().tolist(),
        "W_true": W_true.tolist(),
        "lambda_min_trajectory": checks,
        "double_backward_check_rel_diff": verify,
        "loss": hist["loss"],
        "grad_norm": hist["gnorm"],
        "phase": hist["phase"],
        "n_solves": obj.n_solves,
        "mean_solve_iters": float(np.mean(obj.solve_iters)) if obj.solve_iters else None,
        "wall_s": wall,
    }
    path = out / "shuffled_regression.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
    png = out / "shuffled_regression.png"
    if plot(summary, png):
        print(f"wrote {png}", flush=True)
    # Then, for the record, the minimiser nearest W* (time-capped; the JSON is rewritten).
    if not args.no_reference:
        cap = math.inf if args.max_seconds is None else max(10.0, 0.15 * args.max_seconds)
        if args.quick:
            cap = min(cap, 10.0)
        W_ref, L_ref, g_ref = local_minimum_near(obj, W_true_dev, args.gtol, max_seconds=cap)
        ref = {
            "loss": L_ref,
            "grad_norm": g_ref,
            "rel_error_to_W_true": float((W_ref - W_true_dev).norm() / W_true_dev.norm()),
            "final_rel_distance": float((Wf - W_ref).norm() / W_ref.norm()),
        }
        print(
            f"reference minimiser near W* (Newton from W*): loss {L_ref:.6f}, |grad| "
            f"{g_ref:.1e}, ‖W_ref − W*‖/‖W*‖ = {ref['rel_error_to_W_true']:.3f} (entropic "
            f"bias); ‖W − W_ref‖/‖W_ref‖ = {ref['final_rel_distance']:.3f}",
            flush=True,
        )
        summary["reference_minimum_near_W_true"] = ref
        path.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main(ARGS)
