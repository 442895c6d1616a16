"""Sweep of the 4×4 projection backward's generator options and launch configurations.

Each candidate is (generator options (keep_a, prefetch, pair, ckpt, ahead, rowsum[, colsum,
unrolled]), launch config (matrices per program, warps[, maxnreg[, carveout]])). For each:
registers and spills of the compiled kernel, the maximum error against float64 autograd (B = 4099, logits ×3 and ×80), and the
median time at B = 2^24 (log variant, 20 iterations, fp32).

    python bench/dev/sk_bwd_sweep.py --compile-share 0 --shares 8 &   # fill Triton's cache
    python bench/dev/sk_bwd_sweep.py --out $OUT                     # check and time
    ncu ... python bench/dev/sk_bwd_sweep.py --ncu 0,5               # launches at 2^22 only
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.testing

from flashsinkhorn.mhc import sk_torch, sk_triton

N, T = 4, 20


def _col(keep_a, ckpt=2, prefetch=True, ahead=False, unrolled=None):
    """With the column-sum identity (session 23); unrolled: rounds before the last `unrolled`
    looped over shared memory (session 24)."""
    return (keep_a, prefetch, False, ckpt, ahead, True, True, unrolled)


CANDS = [
    # Session 24 (docs/performance.md, mHC entry 13; raw bench/results/dev/s24a-f). Calls 2-4
    # timed per-lane local memory instead of recomputation (options lm_b / lm_a), the L1/shared
    # carveout and an L2 prefetch (l2_ahead): none faster; the options were removed afterwards
    # (code at 16d65ef). Call 5: the whole backward looped over shared memory (issue 0.78 but
    # +15 % instructions, or 10 warps/SM). Call 6: rounds 1..L looped, the rest unrolled
    # (L = 10: 1.806 ms). Call 7 (these candidates): around that default.
    # Session 23 (colsum, keep_a 9): bench/results/dev/s23{b..e}; sessions 15/16:
    # sk_bwd_sweep_h200_s1{5,6}*. Launch config: (matrices per program, warps[, maxnreg[,
    # carveout]]).
    (sk_triton.SMALL_BWD_OPTS, sk_triton.SMALL_CONFIG["bwd"]),  # the session-24 default
    (_col(9), (64, 2, 128)),  # the session-23 default
    (_col(20, 1, unrolled=9), (64, 2, 128)),
    (_col(20, 1, unrolled=11), (64, 2, 128)),
    (_col(20, 1, unrolled=12), (64, 2, 128)),
    (_col(20, 1, unrolled=10), (32, 1, 128)),
    (_col(20, 1, unrolled=10), (64, 2, 120)),
    (_col(20, 1, unrolled=10), (128, 4, 128)),
]


def _carveout(h, pct):
    """Sets the kernel's preferred shared-memory carveout through the driver API; returns the
    value the driver reports afterwards."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    fn = ctypes.c_void_p(h.function)
    if pct is not None:
        assert cuda.cuFuncSetAttribute(fn, 9, int(pct)) == 0
    v = ctypes.c_int()
    assert cuda.cuFuncGetAttribute(ctypes.byref(v), 9, fn) == 0
    return v.value


def _launch(opts, cfg, m, g):
    _, bwd = sk_triton._small_kernels(N, T, "log", opts, block=cfg[0])
    block, kw = sk_triton._launch_cfg(cfg[:3], m)
    out = torch.empty_like(m)
    grid = (triton.cdiv(m.shape[0], block),)
    args = (m, g, out, m.shape[0], 0.0)
    if len(cfg) > 3:
        # compile and load without launching, set the carveout, then launch
        h = bwd.warmup(*args, BLOCK=block, FAST=True, grid=grid, **kw)
        h._init_handles()
        _carveout(h, cfg[3])
    h = bwd[grid](*args, BLOCK=block, FAST=True, **kw)
    return out, h


def _reference(m, g):
    md = m.double().requires_grad_()
    sk_torch.sk_forward_torch(md, T, "log", 0.0).backward(g.double())
    return md.grad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-share", type=int)
    ap.add_argument("--shares", type=int, default=1)
    ap.add_argument("--ncu", help="comma-separated candidate indices to launch at 2^22")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.compile_share is not None:
        # both specialisations of n_mat (divisible by 16 or not) that the run below launches
        for k, (opts, cfg) in enumerate(CANDS):
            if k % args.shares == args.compile_share:
                for b in (4096, 4099):
                    small = torch.randn(b, N, N, device="cuda")
                    _launch(opts, cfg, small, small)
        torch.cuda.synchronize()
        return
    if args.ncu:
        m = 3 * torch.randn(2**22, N, N, device="cuda")
        g = torch.randn_like(m)
        for k in map(int, args.ncu.split(",")):
            _launch(*CANDS[k], m, g)
        torch.cuda.synchronize()
        return
    torch.manual_seed(0)
    checks = []
    for scale in (3.0, 80.0):
        m = scale * torch.randn(4099, N, N, device="cuda")
        g = torch.randn_like(m)
        checks.append((m, g, _reference(m, g)))
    big_m = 3 * torch.randn(2**24, N, N, device="cuda")
    big_g = torch.randn_like(big_m)
    rows = []
    for k, (opts, cfg) in enumerate(CANDS):
        err = 0.0
        for m, g, ref in checks:
            out, h = _launch(opts, cfg, m, g)
            err = max(err, (out.double() - ref).abs().max().item())
        ms = triton.testing.do_bench(
            lambda o=opts, c=cfg: _launch(o, c, big_m, big_g), warmup=25, rep=100
        )
        row = {
            "cand": k,
            "opts": list(opts),
            "cfg": list(cfg),
            "regs": h.n_regs,
            "spills": h.n_spills,
            "carveout": _carveout(h, None),
            "max_err": err,
            "ms_2e24": ms,
        }
        rows.append(row)
        print(
            f"{k:2d} opts={opts!s:58s} cfg={cfg!s:20s} regs={h.n_regs:3d} spills={h.n_spills:3d} "
            f"carve={row['carveout']:4d} err={err:.1e} {ms:.4f} ms",
            flush=True,
        )
    if args.out:
        name = os.path.join(args.out, "sk_bwd_sweep.json")
        with open(name, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
