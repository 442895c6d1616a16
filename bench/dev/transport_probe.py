"""Probe: transport-kernel tile shapes for the HVP (10k x 10k, d = 64), per precision.

The HVP's CG iterations are two width-1 transports each. The rule-based transport config
(64 x 64 tiles, 8 warps) gives 157 programs at n = 10k: 1.2 waves on 132 SMs with one
program per SM. This times P v (width 1), P V (width 66) and one full HVP (50 CG
iterations) for a few shapes, without changing the library: the config function is
swapped in place for the run.

    python bench/dev/transport_probe.py --out DIR
"""

import argparse, json, os, time
from dataclasses import replace

import torch

import flashsinkhorn as fs
from flashsinkhorn.backends.triton import transport as T
from flashsinkhorn.hessian.joint import TransportHessian

SHAPES = [  # (block_m, block_n, num_warps, num_stages); None = the library's rule
    None,
    (32, 64, 4, 2),
    (32, 64, 4, 3),
    (64, 64, 4, 3),
    (32, 128, 4, 3),
    (128, 64, 8, 3),
]


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in ev)
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d = args.n, args.d
    x = torch.rand(n, d, device="cuda", generator=g)
    y = torch.rand(n, d, device="cuda", generator=g)
    a = torch.rand(n, device="cuda", generator=g) + 0.1
    b = torch.rand(n, device="cuda", generator=g) + 0.1
    a, b = a / a.sum(), b / b.sum()
    A = torch.randn(n, d, device="cuda", generator=g)
    orig = T.transport_config
    rows = []
    for precision in ("ieee", "tf32x3", "tf32"):
        res = fs.sinkhorn(x, y, a, b, eps=0.1, n_iters=200, tol=1e-4, precision=precision)
        for shape in SHAPES:
            if shape is None:
                T.transport_config = orig
            else:
                bm, bn, w, st = shape
                T.transport_config = lambda d_, p_, r_, _s=shape: replace(
                    orig(d_, p_, r_),
                    block_m=_s[0],
                    block_n=_s[1],
                    num_warps=_s[2],
                    num_stages=_s[3],
                )
            H = TransportHessian(res)
            v1 = torch.randn(1, n, 1, device="cuda", generator=g)
            V66 = torch.randn(1, n, 66, device="cuda", generator=g)
            row = {"precision": precision, "shape": shape or "rule", "n": n, "d": d}
            try:
                t0 = time.perf_counter()
                H.P(v1)
                torch.cuda.synchronize()
                row["first_s"] = time.perf_counter() - t0
                row["Pv1_ms"] = timed(lambda: H.P(v1))
                row["PV66_ms"] = timed(lambda: H.P(V66))
                Ab = A[None]
                kw = dict(tau=1e-5, cg_tol=1e-30, cg_max_iter=50)
                row["hvp50_ms"] = timed(lambda: H.apply(Ab, None, want_y=False, **kw), reps=5)
            except Exception as exc:  # record and go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(row, flush=True)
    T.transport_config = orig
    with open(os.path.join(args.out, "transport_probe.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)
    print(f"{'precision':8s} {'shape':18s} {'P v1 ms':>8s} {'P V66 ms':>9s} {'HVP50 ms':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['precision']:8s} {str(r['shape']):18s} error {r['error'][:80]}")
        else:
            print(
                f"{r['precision']:8s} {str(r['shape']):18s} {r['Pv1_ms']:8.3f} {r['PV66_ms']:9.3f} {r['hvp50_ms']:9.2f}"
            )


if __name__ == "__main__":
    main()
