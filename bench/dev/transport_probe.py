"""Probe: the streaming transport pass for the HVP (10k x 10k, d = 64), per precision.

Times, for precisions "tf32", "tf32x3" and "ieee": a width-1 P v, a width-66 P V, the fused
gradient pass (transport_grad) and one full HVP (50 CG iterations, ~105 width-1 passes), each
for a few variants of the launch, without changing the library (module attributes are swapped
in place for the run):

* ``rule``       - the library as shipped (split column sweep, float16 grid operands at "tf32",
                   the soft-min tile shape for one value column; docs/performance.md entry 8);
* ``nosplit``    - the same with the column sweep never split (transport.FORCE_SPLIT = 1);
* ``tiles64``    - the pre-entry-8 tile rule (64 x 64, 8 warps, 2 stages) for every width;
* ``fp32ops``    - "tf32" only: the fp32 points for the score dot instead of the float16 copies;
* ``vec256w8``, ``vec128w4`` - one value column with 256 x 64 tiles / 8 warps or 128 x 64 /
                   4 warps (32 rows per warp, the soft-min's best in entry 12).

    python bench/dev/transport_probe.py --out DIR
"""

import argparse, json, os, time
from dataclasses import replace

import torch

import flashsinkhorn as fs
from flashsinkhorn.backends.triton import transport as T
from flashsinkhorn.hessian.joint import TransportHessian

ORIG_CONFIG = T.transport_config


def _tiles64(d, p, r):
    return replace(ORIG_CONFIG(d, p, r), block_m=64, block_n=64, num_warps=8, num_stages=2)


def _vec_tiles(block_m, warps):
    def cfg(d, p, r):
        c = ORIG_CONFIG(d, p, r)
        if p == 1 and r == 0 and d <= 128:
            return replace(c, block_m=block_m, block_n=64, num_warps=warps, num_stages=3)
        return c

    return cfg


def _fp32_ops(rows, cols, precision):
    return rows.x, cols.x, 1.0, precision


VARIANTS = {  # name -> (transport_config, FORCE_SPLIT, operands or None for the library's)
    "rule": (ORIG_CONFIG, None, None),
    "nosplit": (ORIG_CONFIG, 1, None),
    "tiles64": (_tiles64, None, None),
    "fp32ops": (ORIG_CONFIG, None, _fp32_ops),
    "vec256w8": (_vec_tiles(256, 8), None, None),
    "vec128w4": (_vec_tiles(128, 4), None, None),
}


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
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--precisions", default="tf32,tf32x3,ieee")
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
    v1 = torch.randn(1, n, 1, device="cuda", generator=g)
    V66 = torch.randn(1, n, 66, device="cuda", generator=g)
    orig_ops = T.operands
    rows = []
    for precision in args.precisions.split(","):
        res = fs.sinkhorn(x, y, a, b, eps=0.1, n_iters=200, tol=1e-4, precision=precision)
        pr = res._problem
        ref = {}
        for name in args.variants.split(","):
            cfg, split, ops = VARIANTS[name]
            if ops is not None and precision != "tf32":
                continue
            T.transport_config, T.FORCE_SPLIT, T.operands = cfg, split, ops or orig_ops
            row = {"precision": precision, "variant": name, "n": n, "d": d}
            try:
                H = TransportHessian(res)
                t0 = time.perf_counter()
                out1 = H.P(v1)
                torch.cuda.synchronize()
                row["first_s"] = time.perf_counter() - t0
                grad = lambda: res._backend.transport_grad(  # noqa: E731
                    pr.X, pr.Y, res._f, res._g, float(res.eps), pr.precision
                )
                outs = {"Pv1": out1, "PV66": H.P(V66), "grad": grad()[0]}
                row["Pv1_ms"] = timed(lambda: H.P(v1))
                row["PV66_ms"] = timed(lambda: H.P(V66))
                row["grad_ms"] = timed(grad)
                kw = dict(tau=1e-5, cg_tol=1e-30, cg_max_iter=50)
                row["hvp50_ms"] = timed(lambda: H.apply(A[None], None, want_y=False, **kw), reps=5)
                # Agreement with the shipped variant (same precision): max rel. difference.
                for k, o in outs.items():
                    if name == "rule":
                        ref[k] = o
                    else:
                        row[f"{k}_reldiff"] = float((o - ref[k]).abs().max() / ref[k].abs().max())
            except Exception as exc:  # record and go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(row, flush=True)
    T.transport_config, T.FORCE_SPLIT, T.operands = ORIG_CONFIG, None, orig_ops
    with open(os.path.join(args.out, "transport_probe.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)
    print(f"{'precision':8s} {'variant':8s} {'P v1 ms':>8s} {'P V66 ms':>9s} {'grad ms':>8s}"
          f" {'HVP50 ms':>9s}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['precision']:8s} {r['variant']:8s} error {r['error'][:80]}")
        else:
            print(
                f"{r['precision']:8s} {r['variant']:8s} {r['Pv1_ms']:8.3f} {r['PV66_ms']:9.3f}"
                f" {r['grad_ms']:8.3f} {r['hvp50_ms']:9.2f}"
            )


if __name__ == "__main__":
    main()
