"""mHC benchmarks: the batched 4×4 projection over a sweep of B, and the hyper-connection layer.

Protocol (docs/mhc.md): n = 4, 20 iterations. Each call is timed on its own (CUDA events around
the call, L2 flushed before it, host work included: a call pays its own launch), and a row
reports the median and the 1 % / 99 % quantiles over the calls (≥ 5, about 0.5 s of work).
GB/s counts the minimum traffic (projection: read the logits and write the result, 128 B per
fp32 matrix forward; backward 192 B). Every projection size also times a device-to-device copy
of the same number of bytes in the same run, and each row reports its share of that copy
bandwidth and of the largest copy bandwidth of the run (the peak). Baselines in the same run:
the PyTorch loop (eager and torch.compile'd) and the earlier kernel designs still in the
library (the general path: one matrix per program; the forward without paired reciprocals).
Layer: T = 16 × 2048 tokens, C = 4096, n = 4; our layer eager and compiled, the PyTorch
reference module eager and compiled; forward and forward+backward; fp32 and bf16 (X and F in
bf16, parameters fp32); peak memory of the forward+backward. Compilation and first calls are
excluded from the timed region (first-call time reported separately).

    python bench/bench_mhc.py --out out               # H100: ≈ 6 min (about half compiling)
    python bench/bench_mhc.py --only projection       # the B sweep only (≈ 2 min)
    python bench/bench_mhc.py --only layer            # the layer only (≈ 4 min)
    python bench/bench_mhc.py --quick --out /tmp/q    # small sizes; also on a CPU (< 60 s)

Output: ``mhc_<gpu>[_quick].json`` in ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import time

import mhc_results
import torch

from flashsinkhorn.mhc import HyperConnection, HyperConnectionReference, sinkhorn_knopp
from flashsinkhorn.mhc import sinkhorn as S
from flashsinkhorn.mhc.reference import sinkhorn_knopp_reference

ROWS: list[dict] = []
N, ITERS = 4, 20


class Timer:
    """Per-call times in ms: CUDA events around each call after an L2 flush, or wall time on
    the CPU. ``budget_s`` bounds the timed work of one row."""

    def __init__(self, device: str, budget_s: float = 0.5, max_reps: int = 200):
        self.cuda = device == "cuda"
        self.budget_s, self.max_reps = budget_s, max_reps
        if self.cuda:
            self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn) -> float:
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t

    def times(self, fn, warmup: int = 3) -> list[float]:
        for _ in range(warmup):
            fn()
        est = max(self.once(fn), 1e-6)
        reps = int(min(self.max_reps, max(5, self.budget_s / est)))
        out = []
        for _ in range(reps):
            if self.cuda:
                self.flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                out.append((start, end))
            else:
                t = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t) * 1e3)
        if self.cuda:
            torch.cuda.synchronize()
            out = [s.elapsed_time(e) for s, e in out]
        return out


def _quantile(xs: list[float], q: float) -> float:
    return float(torch.tensor(xs, dtype=torch.float64).quantile(q))


def _row(case, method, times, nbytes=None, copy_gbps=None, peak_gbps=None, **extra):
    med = _quantile(times, 0.5)
    row = {
        "case": case,
        "method": method,
        "ms": med,
        "q01": _quantile(times, 0.01),
        "q99": _quantile(times, 0.99),
        "reps": len(times),
    }
    if nbytes is not None:
        row["gbps"] = nbytes / (med * 1e-3) / 1e9
        if copy_gbps:
            row["pct_copy_same_bytes"] = 100 * row["gbps"] / copy_gbps
        if peak_gbps:
            row["pct_copy_peak"] = 100 * row["gbps"] / peak_gbps
    row.update(extra)
    ROWS.append(row)
    bw = f"{row['gbps']:8.1f} GB/s" if "gbps" in row else ""
    pct = f"{row['pct_copy_same_bytes']:5.1f}% copy" if "pct_copy_same_bytes" in row else ""
    more = " ".join(f"{k}={v}" for k, v in extra.items())
    print(
        f"{case:14s} {method:36s} {med:10.4f} ms [{row['q01']:.4f}, {row['q99']:.4f}] "
        f"{bw} {pct} {more}",
        flush=True,
    )
    return row


def _error(case, method, e):
    ROWS.append({"case": case, "method": method, "error": f"{type(e).__name__}: {e}"[:2000]})
    print(f"{case:14s} {method:36s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


# ---------------------------------------------------------------------------------------------
# Projection sweep
# ---------------------------------------------------------------------------------------------


def _copy_gbps(timer, nbytes, device):
    src = torch.empty(max(1, nbytes // 8), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = timer.times(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (_quantile(t, 0.5) * 1e-3) / 1e9


def _projection_methods(device, use_triton, compile_backend, eager_max):
    """(name, kind, dtype, fn(m, g) -> callable, max B). kind: fwd, bwd (gradient alone) or
    fwd+bwd."""
    plain = lambda t: sinkhorn_knopp_reference(t, ITERS, "log")  # noqa: E731
    compiled = torch.compile(plain, backend=compile_backend, dynamic=True)
    out = []
    if use_triton:
        from flashsinkhorn.mhc import sk_triton as SKT

        def call(m, g):
            return lambda: sinkhorn_knopp(m, ITERS, check_finite=False)

        def checked(m, g):
            # the default: the value check in the kernel, one synchronisation per call
            return lambda: sinkhorn_knopp(m, ITERS)

        def kernel(m, g):
            return lambda: SKT.sk_forward_triton(m, ITERS, "log", 0.0)

        def previous_call(m, g):
            # the per-call path before the validation cache: validate, then the custom op
            def run():
                S._validate(m, ITERS, "log", 1e-6, "auto", False)
                S._sk_op(m, ITERS, "log", 0.0, "triton")

            return run

        def general(m, g):
            return lambda: SKT.sk_forward_triton(m, ITERS, "log", 0.0, "general")

        def pairing(flag):
            # the forward with the other reciprocal scheme than the default for this dtype
            def make(m, g):
                def run():
                    old = dict(SKT.SMALL_FWD_PAIR)
                    SKT.SMALL_FWD_PAIR[m.dtype] = flag
                    try:
                        SKT.sk_forward_triton(m, ITERS, "log", 0.0)
                    finally:
                        SKT.SMALL_FWD_PAIR.update(old)

                return run

            return make

        def bwd_kernel(m, g):
            return lambda: SKT.sk_backward_triton(m, g, ITERS, "log", 0.0)

        def call_fb(m, g):
            x = m.clone().requires_grad_(True)
            return lambda: torch.autograd.grad(sinkhorn_knopp(x, ITERS, check_finite=False), x, g)

        out += [
            ("ours: sinkhorn_knopp call", "fwd", torch.float32, call, None),
            ("ours: call, check_finite=True (default)", "fwd", torch.float32, checked, None),
            ("ours: kernel launch only", "fwd", torch.float32, kernel, None),
            ("ours: validate + custom op (previous)", "fwd", torch.float32, previous_call, None),
            ("ours: sinkhorn_knopp call", "fwd", torch.bfloat16, call, None),
            ("ours: call, check_finite=True (default)", "fwd", torch.bfloat16, checked, None),
            ("ours: kernel, unpaired rcp", "fwd", torch.bfloat16, pairing(False), None),
            ("ours: kernel, paired rcp", "fwd", torch.float32, pairing(True), None),
            ("ours: general path (1 matrix/program)", "fwd", torch.float32, general, 2**24),
            ("ours: backward kernel", "bwd", torch.float32, bwd_kernel, None),
            ("ours: sinkhorn_knopp call", "fwd+bwd", torch.float32, call_fb, None),
        ]
    else:

        def torch_call(m, g):
            return lambda: sinkhorn_knopp(m, ITERS, backend="torch", check_finite=False)

        out.append(("ours: torch backend call", "fwd", torch.float32, torch_call, None))

    def eager(m, g):
        return torch.inference_mode()(lambda: plain(m))

    def comp(m, g):
        return torch.inference_mode()(lambda: compiled(m))

    def comp_fb(m, g):
        x = m.clone().requires_grad_(True)
        return lambda: torch.autograd.grad(compiled(x), x, g)

    out += [
        ("torch loop, eager", "fwd", torch.float32, eager, eager_max),
        (f"torch loop, torch.compile ({compile_backend})", "fwd", torch.float32, comp, None),
        (
            f"torch loop, torch.compile ({compile_backend})",
            "fwd+bwd",
            torch.float32,
            comp_fb,
            2**22,
        ),
    ]
    return out


def bench_projection(sizes, device, timer, compile_backend):
    # the interpreter would take minutes at these sizes: Triton rows on the GPU only
    use_triton = device == "cuda"
    eager_max = 2**22 if device == "cuda" else max(sizes)
    methods = _projection_methods(device, use_triton, compile_backend, eager_max)
    copies = {}
    for B in sizes:
        copies[B] = _copy_gbps(timer, 128 * B, device)
    peak = max(copies.values())
    for B in sizes:
        _row(
            f"copy B={B}",
            "device copy, same bytes as fwd",
            [128 * B / copies[B] / 1e6],
            128 * B,
            copies[B],
            peak,
            B=B,
        )
        gen = torch.Generator(device=device).manual_seed(B % 1000)
        m32 = torch.randn(B, N, N, device=device, generator=gen) * 3
        g = torch.randn(B, N, N, device=device, generator=gen)
        for name, kind, dt, make, bmax in methods:
            if bmax is not None and B > bmax:
                continue
            m = m32.to(dt)
            try:
                fn = make(m, g)
                first = timer.once(fn)
                times = timer.times(fn)
            except Exception as e:  # noqa: BLE001 - one failing method must not end the run
                _error(f"proj_{kind} B={B}", f"{name} [{str(dt)[6:]}]", e)
                continue
            esize = 2 if dt == torch.bfloat16 else 4
            per = {"fwd": 32, "bwd": 48, "fwd+bwd": 80}[kind] * esize
            _row(
                f"proj_{kind} B={B}",
                f"{name} [{str(dt)[6:]}]",
                times,
                per * B,
                copies[B],
                peak,
                B=B,
                dtype=str(dt)[6:],
                kind=kind,
                first_call_s=round(first, 3),
            )
            del fn
        if device == "cuda":
            torch.cuda.empty_cache()


def bench_host(device, timer):
    """Host time per call at B = 1: back-to-back calls without synchronisation; the GPU runs
    each tiny kernel faster than the host issues the next, so wall time / calls is the host
    cost of a call (validation cached, launch included)."""
    m = torch.randn(1, N, N, device=device)
    x = m.clone().requires_grad_(True)
    calls = [
        ("sinkhorn_knopp, fp32", lambda: sinkhorn_knopp(m, ITERS, check_finite=False)),
        ("sinkhorn_knopp, bf16", lambda: sinkhorn_knopp(m16, ITERS, check_finite=False)),
        ("sinkhorn_knopp, fp32, autograd", lambda: sinkhorn_knopp(x, ITERS, check_finite=False)),
        ("sinkhorn_knopp, check_finite=True", lambda: sinkhorn_knopp(m, ITERS)),
    ]
    m16 = m.to(torch.bfloat16)
    if device == "cuda":
        from flashsinkhorn.mhc import sk_triton as SKT

        calls.append(
            ("sk_forward_triton (launch only)", lambda: SKT.sk_forward_triton(m, ITERS, "log", 0.0))
        )

        def previous():
            S._validate(m, ITERS, "log", 1e-6, "auto", False)
            S._sk_op(m, ITERS, "log", 0.0, "triton")

        calls.append(("validate + custom op (previous path)", previous))
    k = 2000 if device == "cuda" else 200
    for name, fn in calls:
        for _ in range(50):
            fn()
        timer.sync()
        best = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(k):
                fn()
            best.append((time.perf_counter() - t) / k * 1e3)
            timer.sync()
        _row("host B=1", name, best, us_per_call=round(min(best) * 1e3, 2))


# ---------------------------------------------------------------------------------------------
# Layer
# ---------------------------------------------------------------------------------------------


def bench_layer(tokens, C, device, timer, compile_backend, dtypes, use_triton):
    torch.manual_seed(0)
    backend = "auto" if use_triton else "torch"
    ours = HyperConnection(C, N, n_iters=ITERS, backend=backend).to(device)
    ref = HyperConnectionReference(C, N, n_iters=ITERS).to(device)
    ref.load_state_dict(ours.state_dict())
    cb = compile_backend
    mods = [
        ("reference, eager", ref),
        (f"reference, torch.compile ({compile_backend})", torch.compile(ref, backend=cb)),
        ("ours, eager", ours),
        (
            f"ours, torch.compile ({compile_backend})",
            torch.compile(ours, backend=cb, fullgraph=True),
        ),
    ]
    for dt in dtypes:
        x = torch.randn(tokens, N, C, device=device).to(dt)
        gout = torch.randn(tokens, N, C, device=device).to(dt)
        xb = tokens * N * C * x.element_size()
        by = {}
        for name, mod in mods:
            xr = x.clone().requires_grad_(True)
            params = list(ours.parameters() if "ours" in name else ref.parameters())

            def fwd(mod=mod, x=x):
                with torch.no_grad():
                    mod(x)

            def fwd_bwd(mod=mod, xr=xr, params=params, gout=gout):
                torch.autograd.grad(mod(xr), [xr, *params], gout)

            tag = str(dt)[6:]
            try:
                first = timer.once(fwd_bwd)
                timer.once(fwd)
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t_fb = timer.times(fwd_bwd)
                peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
                t_f = timer.times(fwd)
            except Exception as e:  # noqa: BLE001 - one failing method must not end the run
                _error(f"layer_fwd+bwd {tag}", name, e)
                continue
            _row(f"layer_fwd {tag}", name, t_f, int(4.5 * xb), T=tokens, C=C)
            row = _row(
                f"layer_fwd+bwd {tag}",
                name,
                t_fb,
                int(12.5 * xb),
                T=tokens,
                C=C,
                peak_gib=None if peak is None else round(peak, 2),
                first_call_s=round(first, 2),
            )
            by[name] = row["ms"]
            del xr
            if device == "cuda":
                torch.cuda.empty_cache()
        base = by.get("reference, eager")
        for name, ms in by.items() if base else ():
            print(f"layer fwd+bwd {str(dt)[6:]}: {name}: {base / ms:.2f}x the eager reference")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke test)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    ap.add_argument("--only", choices=("projection", "layer"), default=None)
    ap.add_argument("--max-log2", type=int, default=24, help="largest B of the sweep, log2")
    ap.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (inductor; aot_eager on a CPU)",
    )
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = args.compile_backend or ("inductor" if device == "cuda" else "aot_eager")
    if device == "cpu":
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = True
    timer = Timer(device, budget_s=0.1 if args.quick else 0.5)
    if args.quick:
        sizes = [1, 64, 1024]
        tokens, C = 2 * 64, 64
    else:
        sizes = [4**k for k in range(args.max_log2 // 2 + 1)]
        if sizes[-1] != 2**args.max_log2:
            sizes.append(2**args.max_log2)
        tokens, C = 16 * 2048, 4096
    if args.only != "layer":
        bench_host(device, timer)
        bench_projection(sizes, device, timer, backend)
    if args.only != "projection":
        dts = [torch.float32, torch.bfloat16]
        bench_layer(tokens, C, device, timer, backend, dts, device == "cuda")
    name, gpu = mhc_results.device_name(device)
    import triton

    res = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "compile_backend": backend,
        "rows": ROWS,
    }
    suffix = ("_quick" if args.quick else "") + (f"_{args.only}" if args.only else "")
    mhc_results.write(res, args.out, f"mhc_{gpu}{suffix}")


if __name__ == "__main__":
    main()
