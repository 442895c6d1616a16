"""mHC benchmarks: the batched 4×4 projection (forward, backward) and the hyper-connection layer.

Protocol (docs/mhc.md): fp32, 20 iterations, median of triton.testing.do_bench after warm-up,
compilation excluded from the timed region (first-call time reported separately), baselines
measured in the same run. Writes bench/results/mhc_<gpu>.json (and into --out if given).

    python bench/bench_mhc.py            # full run (H200: ~2 minutes once the kernels are compiled)
    python bench/bench_mhc.py --quick    # small sizes, for a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch
import triton
import triton.testing

from flashsinkhorn import tuning
from flashsinkhorn.mhc import HyperConnection, HyperConnectionReference, sk_triton
from flashsinkhorn.mhc.reference import sinkhorn_knopp_reference
from flashsinkhorn.tuning import TUNING

ROWS: list[dict] = []


def _bench(fn, warmup=25, rep=100):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _row(case, B, n, iters, method, ms, nbytes=None, **extra):
    gbps = None if nbytes is None else nbytes / (ms * 1e-3) / 1e9
    row = {"case": case, "B": B, "n": n, "iters": iters, "method": method, "ms": ms, "gbps": gbps}
    row.update(extra)
    ROWS.append(row)
    bw = "" if gbps is None else f"{gbps:8.0f} GB/s"
    more = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{case:10s} B={B:<9d} n={n} it={iters:<3d} {method:34s} {ms:10.4f} ms {bw} {more}")


def _first_call(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_projection(sizes, sweep, baselines):
    for B in sizes:
        _bench_projection_size(B, sweep, baselines)
        torch.cuda.empty_cache()


# Candidates of the small path: (generator options (keep_a, prefetch, pair[, ckpt, ahead,
# rowsum, colsum, unrolled]), launch config (matrices per program, warps[, maxnreg])). The
# first of each list is the library default.
FWD_CANDS = [
    ((8, True, False), (256, 8)),
    ((8, True, False), (128, 4)),
    ((8, True, True), (256, 8)),
    ((8, True, True), (128, 4)),
]
BWD_CANDS = [
    (TUNING.mhc_small_bwd, sk_triton.SMALL_CONFIG["bwd"]),
    ((9, True, False, 2, False, True, True), (64, 2, 128)),  # fully unrolled, colsum, keep_a 9
    ((8, True, False, 2, False, True), (64, 2, 128)),  # no colsum, keep_a 8, ckpt 2
    ((8, True, False), (64, 2)),
]
DEEPSEEK_BWD = ((8, True, False, 2, False, True), (64, 2))


def _cand_name(variant, opts, cfg):
    keep_a, _, pair, *more = opts
    dflt = [1, False, False, False, None]
    ckpt, ahead, rowsum, colsum, unrolled = (more + dflt[len(more) :])[:5]
    if variant != "log":  # the checkpointing options apply to the log variant only
        ckpt, ahead, rowsum, colsum, unrolled = dflt
    extra = f"|keep{keep_a}" + ("|pair" if pair else "")
    extra += (f"|ckpt{ckpt}" if ckpt > 1 else "") + ("|ahead" if ahead else "")
    extra += ("|rowsum" if rowsum else "") + ("|colsum" if colsum else "")
    extra += f"|unrolled{unrolled}" if unrolled is not None else ""
    return f"triton_{variant}[{'x'.join(map(str, cfg))}{extra}]"


def _with(opts, cfg_key, cfg, fn):
    old_cfg = sk_triton.SMALL_CONFIG[cfg_key]
    sk_triton.SMALL_CONFIG[cfg_key] = cfg
    try:
        with tuning.override(mhc_small_bwd=tuple(opts)):
            return fn()
    finally:
        sk_triton.SMALL_CONFIG[cfg_key] = old_cfg


def precompile(share, n_shares):
    """Compiles this share of the candidate kernels (fills Triton's cache; run several at once
    while the tests run: the unrolled backward takes ~20 s of CPU to compile)."""
    jobs = [("fwd", v, o, c) for v in ("log",) for o, c in FWD_CANDS]
    jobs += [("bwd", "log", o, c) for o, c in BWD_CANDS]
    jobs += [("fwd", "deepseek", *FWD_CANDS[0]), ("bwd", "deepseek", *DEEPSEEK_BWD)]
    m = torch.randn(4096, 4, 4, device="cuda")
    for k, (kind, variant, opts, cfg) in enumerate(jobs):
        if k % n_shares != share:
            continue
        if kind == "fwd":
            _with(opts, "fwd", cfg, lambda v=variant: sk_triton.sk_forward_triton(m, 20, v, 1e-6))
        else:
            _with(
                opts,
                "bwd" if variant == "log" else "bwd_deepseek",
                cfg,
                lambda v=variant: sk_triton.sk_backward_triton(m, m, 20, v, 1e-6),
            )
    torch.cuda.synchronize()


def _bench_projection_size(B, sweep, baselines):
    n, iters = 4, 20
    m = torch.randn(B, n, n, device="cuda") * 3
    g = torch.randn(B, n, n, device="cuda")
    # our kernels: generator options and launch configurations (FWD_CANDS, BWD_CANDS)
    for variant in ("log", "deepseek"):
        fwd_c = FWD_CANDS if sweep and variant == "log" else FWD_CANDS[:1]
        bwd_c = BWD_CANDS if sweep else BWD_CANDS[:1]
        bwd_c = bwd_c if variant == "log" else [DEEPSEEK_BWD]
        bwd_key = "bwd" if variant == "log" else "bwd_deepseek"
        for opts, cfg in fwd_c:
            fn = lambda v=variant: sk_triton.sk_forward_triton(m, iters, v, 1e-6)  # noqa: E731
            first = _with(opts, "fwd", cfg, lambda fn=fn: _first_call(fn))
            ms = _with(opts, "fwd", cfg, lambda fn=fn: _bench(fn))
            name = _cand_name(variant, opts, cfg)
            _row("mhc_fwd", B, n, iters, name, ms, 128 * B, first_call_s=round(first, 2))
        for opts, cfg in bwd_c:
            fn = lambda v=variant: sk_triton.sk_backward_triton(m, g, iters, v, 1e-6)  # noqa: E731
            first = _with(opts, bwd_key, cfg, lambda fn=fn: _first_call(fn))
            ms = _with(opts, bwd_key, cfg, lambda fn=fn: _bench(fn))
            name = _cand_name(variant, opts, cfg)
            _row("mhc_bwd", B, n, iters, name, ms, 192 * B, first_call_s=round(first, 2))
    # general path at n = 4 for comparison (one matrix per program)
    fn = lambda: sk_triton.sk_forward_triton(m, iters, "log", 1e-6, "general")  # noqa: E731
    _first_call(fn)
    _row("mhc_fwd", B, n, iters, "triton_log_general_path", _bench(fn), 128 * B)
    fn = lambda: sk_triton.sk_backward_triton(m, g, iters, "log", 1e-6, "general")  # noqa: E731
    _first_call(fn)
    _row("mhc_bwd", B, n, iters, "triton_log_general_path", _bench(fn), 192 * B)
    if not baselines:
        return
    # PyTorch baselines: the plain loop, eager and torch.compile'd (no autograd graph).
    plain = lambda t: sinkhorn_knopp_reference(t, iters, "log")  # noqa: E731
    with torch.inference_mode():
        _row("mhc_fwd", B, n, iters, "torch_eager_loop", _bench(lambda: plain(m), 5, 20), 128 * B)
        compiled = torch.compile(plain)
        first = _first_call(lambda: compiled(m))
        _row(
            "mhc_fwd",
            B,
            n,
            iters,
            "torch_compile_loop",
            _bench(lambda: compiled(m), 5, 20),
            128 * B,
            first_call_s=round(first, 1),
        )
    if B <= 2**22:
        mg = m.clone().requires_grad_(True)

        def eager_fb():
            p = plain(mg)
            torch.autograd.grad(p, mg, g)

        _row("mhc_bwd", B, n, iters, "torch_eager_loop_fwd+bwd", _bench(eager_fb, 5, 20), 192 * B)
        cf = torch.compile(plain)

        def compiled_fb():
            p = cf(mg)
            torch.autograd.grad(p, mg, g)

        first = _first_call(compiled_fb)
        _row(
            "mhc_bwd",
            B,
            n,
            iters,
            "torch_compile_loop_fwd+bwd",
            _bench(compiled_fb, 5, 20),
            192 * B,
            first_call_s=round(first, 1),
        )


LAYER_VARIANTS = {
    # name: overrides of the layer's switches (TUNING fields or flashsinkhorn.mhc.layer's
    # tile configurations); None = library default
    "triton_tf32": None,
    "triton_tf32[gemm reads phi]": {"mhc_gemm_phi_t": False},
    "triton_tf32[dx 32x32x4w]": {"DX_CFG": (32, 32, 4)},
    "triton_tf32[dphi 16x128x4w]": {"DPHI_CFG": (16, 128, 4, 4)},
    "triton_tf32[unfused schedule]": {"mhc_fused_dx": False},
}
_LAYER_CFGS = ("DX_CFG", "DPHI_CFG")
_LAYER_SWITCHES = ("mhc_fused_dx", "mhc_gemm_phi_t")


def _layer_setup(spec):
    from flashsinkhorn.mhc import layer as L

    saved = {k: getattr(L, k) for k in _LAYER_CFGS}
    saved.update({k: getattr(TUNING, k) for k in _LAYER_SWITCHES})
    for k, v in (spec or {}).items():
        setattr(L if k in _LAYER_CFGS else TUNING, k, v)
    return saved


def _layer_restore(saved):
    from flashsinkhorn.mhc import layer as L

    for k, v in saved.items():
        setattr(L if k in _LAYER_CFGS else TUNING, k, v)


def bench_layer(tokens, C, n=4, iters=20, out=None, sweep=True):
    torch.manual_seed(0)
    x = torch.randn(tokens, n, C, device="cuda")
    gout = torch.randn(tokens, n, C, device="cuda")
    tf32 = HyperConnection(C, n, n_iters=iters, gemm_precision="tf32").cuda()
    ieee = HyperConnection(C, n, n_iters=iters, gemm_precision="ieee").cuda()
    ieee.load_state_dict(tf32.state_dict())
    ref = HyperConnectionReference(C, n, n_iters=iters).cuda()
    ref.load_state_dict(tf32.state_dict())
    runs = [("torch_reference", ref, None)]
    for name, spec in LAYER_VARIANTS.items():
        if sweep or spec is None:
            runs.append((name, tf32, spec))
    runs.append(("triton_ieee", ieee, None))
    # Traffic of both backward schedules (docs/performance.md, mHC): fwd 4.5 passes over X-sized
    # data, bwd 8 (X-sized = T·n·C·4 bytes).
    xb = tokens * n * C * 4
    for name, mod, spec in runs:
        saved = _layer_setup(spec)
        xr = x.clone().requires_grad_(True)
        params = list(mod.parameters())

        def fwd(mod=mod, xr=xr):
            with torch.no_grad():
                mod(xr)

        def fwd_bwd(mod=mod, xr=xr, params=params):
            o = mod(xr)
            torch.autograd.grad(o, [xr, *params], gout)

        try:
            first = _first_call(fwd_bwd)
            torch.cuda.reset_peak_memory_stats()
            ms_fb = _bench(fwd_bwd, 20, 150)
            peak = torch.cuda.max_memory_allocated() / 2**30
            ms_f = _bench(fwd, 10, 60)
        finally:
            _layer_restore(saved)
        passes = 12.5
        _row("mhc_layer", tokens, n, iters, f"{name}_fwd", ms_f, int(4.5 * xb), C=C)
        _row(
            "mhc_layer",
            tokens,
            n,
            iters,
            f"{name}_fwd+bwd",
            ms_fb,
            int(passes * xb),
            C=C,
            peak_gib=round(peak, 2),
            first_call_s=round(first, 2),
        )
    by = {r["method"]: r["ms"] for r in ROWS if r["case"] == "mhc_layer"}
    for name, _, _ in runs[1:]:
        ratio = by["torch_reference_fwd+bwd"] / by[f"{name}_fwd+bwd"]
        print(f"layer fwd+bwd speed-up vs the PyTorch reference ({name}): {ratio:.2f}x")
    # where the time goes: per-kernel CUDA time of the default tf32 layer, 3 fwd+bwd
    try:
        _layer_profile(tf32, x, gout, out)
    except Exception as e:  # noqa: BLE001 - the profile is a diagnostic, never fatal
        print("layer profile failed:", e)


def _layer_profile(mod, x, gout, out):
    from torch.profiler import ProfilerActivity, profile

    xr = x.clone().requires_grad_(True)
    params = list(mod.parameters())
    o = mod(xr)
    torch.autograd.grad(o, [xr, *params], gout)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            o = mod(xr)
            torch.autograd.grad(o, [xr, *params], gout)
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=14, max_name_column_width=40
    )
    print(table)
    if out:
        with open(os.path.join(out, "mhc_layer_profile.txt"), "w") as fh:
            fh.write(table)


def _summary():
    """Short table, printed last: fastest rows of each (case, B) and the layer rows."""
    print("\n==== summary (ms; GB/s at the counted bytes) ====")
    groups = {}
    for r in ROWS:
        groups.setdefault((r["case"], r["B"]), []).append(r)
    for (case, B), rows in groups.items():
        keep = rows if case == "mhc_layer" else sorted(rows, key=lambda r: r["ms"])[:4]
        for r in keep:
            bw = "" if r["gbps"] is None else f"{r['gbps']:7.0f}"
            print(f"{case:9s} B={B:<9d} {r['method']:44s} {r['ms']:9.4f} {bw}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--layer-only", action="store_true", help="skip the projection benchmark")
    ap.add_argument("--precompile", default=None, help="I/N: compile share I of N candidates")
    args = ap.parse_args()
    if args.precompile:
        i, k = map(int, args.precompile.split("/"))
        precompile(i, k)
        return
    name = torch.cuda.get_device_name()
    m = re.search(r"(H100|H200|A100|L40S|B200|GH200)", name)
    gpu = m.group(1).lower() if m else re.sub(r"\W+", "_", name).lower()
    if args.quick:
        bench_projection([2**14], sweep=False, baselines=True)
        if not args.skip_layer:
            bench_layer(512, 256, out=args.out, sweep=False)
    else:
        if not args.layer_only:
            bench_projection([2**20, 2**24], sweep=True, baselines=True)
        if not args.skip_layer:
            bench_layer(16 * 2048, 4096, out=args.out)
    _summary()
    res = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "rows": ROWS}
    outs = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")]
    if args.out:
        outs.append(args.out)
    for d in outs:
        os.makedirs(d, exist_ok=True)
        suffix = "_quick" if args.quick else ""
        with open(os.path.join(d, f"mhc_{gpu}{suffix}.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
