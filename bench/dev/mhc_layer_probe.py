"""Kernel-level candidates for the two slow passes of the hyper-connection backward (CUDA only).

At the bench shape (T = 16·2048 tokens, n = 4, C = 4096, fp32) it times, against the kernels
the layer uses today:

* dφ = xᵀ·dh (x: (T, n·C), dh: (T, NP)): the layer kernel over launch configs; cuBLAS
  (``torch.mm(x.t(), dh)``, strict fp32 and TF32); a bf16 hi/lo split kernel (three bf16
  products, the transposed operand is legal for 16-bit wgmma); the transposed orientation
  dφᵀ = dhᵀ·x; a CUDA-core outer-product loop.
* dX (H_resᵀ·dX_next + H_pre⊗du + dh·φᵀ + ρ·x): the layer kernel over configs, and the same
  kernel reading a contiguous zero-padded φᵀ (coalesced, instead of stride-N columns of φ).

Every candidate is checked against a float64 reference (dφ) or the layer kernel (dX) before it
is timed. ``python bench/dev/mhc_layer_probe.py --out DIR`` writes ``mhc_layer_probe.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
import triton.testing

from flashsinkhorn.mhc import layer_kernels as K


@triton.jit
def _dphi_bf16x3_kernel(
    p_x, p_dyh, p_dyl, p_dphi, T, K, n_tsplit, BM: tl.constexpr, BK: tl.constexpr, NP: tl.constexpr
):
    i_k = tl.program_id(0)
    i_s = tl.program_id(1)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, NP)
    b_acc = tl.zeros((BK, NP), tl.float32)
    for tb in range(i_s, tl.cdiv(T, BM), n_tsplit):
        o_m = tb * BM + tl.arange(0, BM)
        m_m = o_m < T
        b_x = tl.load(
            p_x + o_m[:, None].to(tl.int64) * K + o_k[None, :],
            mask=m_m[:, None] & m_k[None, :],
            other=0.0,
        )
        b_xh = b_x.to(tl.bfloat16)
        b_xl = (b_x - b_xh.to(tl.float32)).to(tl.bfloat16)
        o_d = o_m[:, None].to(tl.int64) * NP + o_n[None, :]
        b_dh = tl.load(p_dyh + o_d, mask=m_m[:, None], other=0.0)
        b_dl = tl.load(p_dyl + o_d, mask=m_m[:, None], other=0.0)
        b_xht = tl.trans(b_xh)
        b_acc = tl.dot(b_xht, b_dh, b_acc)
        b_acc = tl.dot(b_xht, b_dl, b_acc)
        b_acc = tl.dot(tl.trans(b_xl), b_dh, b_acc)
    p_o = p_dphi + i_s.to(tl.int64) * K * NP + o_k[:, None].to(tl.int64) * NP + o_n[None, :]
    tl.store(p_o, b_acc, mask=m_k[:, None])


@triton.jit
def _dphi_t_kernel(
    p_x,
    p_dy,
    p_dphi,
    T,
    K,
    n_tsplit,
    BM: tl.constexpr,
    BK: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # dφᵀ = dhᵀ·x: x is the right-hand operand, untransposed.
    i_k = tl.program_id(0)
    i_s = tl.program_id(1)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, NP)
    b_acc = tl.zeros((NP, BK), tl.float32)
    for tb in range(i_s, tl.cdiv(T, BM), n_tsplit):
        o_m = tb * BM + tl.arange(0, BM)
        m_m = o_m < T
        b_x = tl.load(
            p_x + o_m[:, None].to(tl.int64) * K + o_k[None, :],
            mask=m_m[:, None] & m_k[None, :],
            other=0.0,
        )
        b_dyt = tl.load(
            p_dy + o_m[None, :].to(tl.int64) * NP + o_n[:, None], mask=m_m[None, :], other=0.0
        )
        b_acc += tl.dot(b_dyt, b_x, input_precision=PREC)
    p_o = p_dphi + i_s.to(tl.int64) * K * NP + o_k[None, :].to(tl.int64) * NP + o_n[:, None]
    tl.store(p_o, b_acc, mask=m_k[None, :])


@triton.jit
def _dphi_fma_kernel(p_x, p_dy, p_dphi, T, K, t_split, BK: tl.constexpr, NP: tl.constexpr):
    # One token at a time: acc[k, :] += x[t, k]·dh[t, :] on the CUDA cores.
    i_k = tl.program_id(0)
    i_s = tl.program_id(1)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    o_n = tl.arange(0, NP)
    b_acc = tl.zeros((BK, NP), tl.float32)
    t0 = i_s * t_split
    p_xr = p_x + t0.to(tl.int64) * K + o_k
    p_dr = p_dy + t0.to(tl.int64) * NP + o_n
    for _ in range(t0, tl.minimum(t0 + t_split, T)):
        b_xr = tl.load(p_xr, mask=m_k, other=0.0)
        b_dr = tl.load(p_dr)
        b_acc += b_xr[:, None] * b_dr[None, :]
        p_xr += K
        p_dr += NP
    p_o = p_dphi + i_s.to(tl.int64) * K * NP + o_k[:, None].to(tl.int64) * NP + o_n[None, :]
    tl.store(p_o, b_acc, mask=m_k[:, None])


@triton.jit
def _widen(b, BM: tl.constexpr, NS: tl.constexpr, BC: tl.constexpr):
    return tl.reshape(tl.broadcast_to(b[:, :, None], (BM, NS, BC)), (BM, NS * BC))


@triton.jit
def _dx_phit_kernel(
    p_x,
    p_dout,
    p_du,
    p_coef,
    p_hres,
    p_dy,
    p_rcoef,
    p_phit,
    p_dx,
    T,
    K,
    n,
    C,
    BM: tl.constexpr,
    BC: tl.constexpr,
    NS: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # _hc_dx_kernel with φᵀ given as a contiguous (NP, K) array (rows ≥ N are zero).
    i_m = tl.program_id(0)
    i_c = tl.program_id(1)
    o_kk = tl.arange(0, NS * BC)
    o_j = o_kk // BC
    o_cc = i_c * BC + o_kk % BC
    m_kk = (o_j < n) & (o_cc < C)
    o_k = o_j * C + o_cc
    o_n = tl.arange(0, NP)
    o_s = tl.arange(0, NS)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T
    m_mk = m_m[:, None] & m_kk[None, :]
    m_ms = m_m[:, None] & (o_s < n)[None, :]
    o_t = o_m[:, None].to(tl.int64)
    o_mk = o_t * K + o_k[None, :]
    b_x = tl.load(p_x + o_mk, mask=m_mk, other=0.0).to(tl.float32)
    b_du = tl.load(p_du + o_t * C + o_cc[None, :], mask=m_mk, other=0.0).to(tl.float32)
    b_hp = tl.load(p_coef + o_t * (2 * n) + o_s[None, :], mask=m_ms, other=0.0)
    b_rc = tl.load(p_rcoef + o_m, mask=m_m, other=0.0)
    b_dx = _widen(b_hp, BM, NS, BC) * b_du + b_rc[:, None] * b_x
    for i in range(n):
        b_do = tl.load(p_dout + o_t * K + i * C + o_cc[None, :], mask=m_mk, other=0.0)
        b_h = tl.load(p_hres + o_t * (n * n) + i * n + o_s[None, :], mask=m_ms, other=0.0)
        b_dx += _widen(b_h.to(tl.float32), BM, NS, BC) * b_do.to(tl.float32)
    b_wt = tl.load(
        p_phit + o_n[:, None].to(tl.int64) * K + o_k[None, :], mask=m_kk[None, :], other=0.0
    )
    b_dy = tl.load(p_dy + o_t * NP + o_n[None, :], mask=m_m[:, None], other=0.0)
    b_dx += tl.dot(b_dy, b_wt, input_precision=PREC)
    tl.store(p_dx + o_mk, b_dx.to(p_dx.dtype.element_ty), mask=m_mk)


def _ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=16 * 2048)
    ap.add_argument("--C", type=int, default=4096)
    ap.add_argument("--check-only", action="store_true", help="no timing (CPU interpreter)")
    args = ap.parse_args()
    torch.manual_seed(0)
    T, n, C = args.tokens, 4, args.C
    Kd, N, NP, NS = n * C, n * n + 2 * n, 32, 4
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    nsm = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4
    ms_of = (lambda fn: float("nan")) if args.check_only else _ms
    x = torch.randn(T, Kd, device=dev)
    dy = torch.zeros(T, NP, device=dev)
    dy[:, :N] = torch.randn(T, N, device=dev)
    xb = T * Kd * 4
    rows = []

    def row(kind, name, ms, err, floor_x):
        gbps = floor_x * xb / (ms * 1e-3) / 1e9
        rows.append(dict(kind=kind, name=name, ms=ms, err=err, gbps=gbps))
        print(f"{kind:5s} {name:40s} {ms:8.3f} ms {gbps:7.0f} GB/s  err {err:.2e}", flush=True)

    ref = (x.double().t() @ dy.double())[:, :N]
    scale = ref.abs().max().item()

    def check(out):
        return (out[:, :N].double() - ref).abs().max().item() / scale

    # --- dφ ------------------------------------------------------------------------------
    def split_launch(kernel, BM, BK, warps, per_sm, extra=(), **kw):
        k_progs = triton.cdiv(Kd, BK)
        n_ts = max(1, min(triton.cdiv(T, BM), triton.cdiv(per_sm * nsm, k_progs)))
        part = torch.empty((n_ts, Kd, NP), device=dev)

        def run():
            kernel[(k_progs, n_ts)](
                *extra, part, T, Kd, n_ts, BM=BM, BK=BK, NP=NP, num_warps=warps, **kw
            )
            return part.sum(0)

        return run

    cands = {}
    for cfg in [(64, 64, 4, 4), (32, 64, 4, 4), (64, 128, 4, 2), (64, 64, 4, 8), (128, 64, 8, 2)]:
        cands[f"layer_kernel{cfg}"] = split_launch(
            K._hc_dphi_kernel, *cfg, extra=(x, dy), PREC="tf32"
        )
    dyh = dy.to(torch.bfloat16)
    dyl = (dy - dyh.float()).to(torch.bfloat16)
    for cfg in [(64, 64, 4, 4), (64, 128, 4, 2), (128, 128, 8, 2), (64, 256, 8, 1)]:
        cands[f"bf16x3{cfg}"] = split_launch(_dphi_bf16x3_kernel, *cfg, extra=(x, dyh, dyl))
    for cfg in [(64, 64, 4, 4), (64, 128, 4, 2), (32, 128, 4, 4)]:
        run_t = split_launch(_dphi_t_kernel, *cfg, extra=(x, dy), PREC="tf32")
        cands[f"transposed{cfg}"] = run_t
    for BK, warps, per_sm in [(128, 4, 4), (256, 4, 2), (256, 8, 4)]:
        k_progs = triton.cdiv(Kd, BK)
        n_ts = max(1, triton.cdiv(per_sm * nsm, k_progs))
        t_split = triton.cdiv(T, n_ts)
        part_f = torch.empty((n_ts, Kd, NP), device=dev)

        def run_f(BK=BK, warps=warps, k_progs=k_progs, n_ts=n_ts, t_split=t_split, part=part_f):
            _dphi_fma_kernel[(k_progs, n_ts)](
                x, dy, part, T, Kd, t_split, BK=BK, NP=NP, num_warps=warps
            )
            return part.sum(0)

        cands[f"fma(BK={BK},w={warps},per_sm={per_sm})"] = run_f
    dyc = dy[:, :N].contiguous()
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for tf in (False, True):

            def run_mm(tf=tf):
                torch.backends.cuda.matmul.allow_tf32 = tf
                return torch.mm(x.t(), dyc)

            cands[f"cublas_mm(tf32={tf})"] = run_mm
        for name, fn in cands.items():
            try:
                err = check(fn())
                row("dphi", name, ms_of(fn), err, 1.0)
            except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is reported
                print(f"dphi  {name:40s} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    ref = None  # noqa: F841 - frees the float64 reference before the dX part
    torch.cuda.empty_cache()

    # --- dX ------------------------------------------------------------------------------
    dout = torch.randn(T, Kd, device=dev)
    du = torch.randn(T, C, device=dev)
    coef = torch.rand(T, 2 * n, device=dev)
    hres = torch.rand(T, n, n, device=dev)
    rcoef = 1e-3 * torch.randn(T, device=dev)
    phi = 0.01 * torch.randn(Kd, N, device=dev)
    phit = torch.zeros(NP, Kd, device=dev)
    phit[:N] = phi.t()
    dx0 = torch.empty_like(x)
    dx1 = torch.empty_like(x)

    def dx_layer(BM, BC, warps):
        def run():
            K._hc_dx_kernel[(triton.cdiv(T, BM), triton.cdiv(C, BC))](
                x,
                dout,
                du,
                coef,
                hres,
                dy,
                rcoef,
                phi,
                dx0,
                T,
                Kd,
                N,
                n,
                C,
                BM=BM,
                BC=BC,
                NS=NS,
                NP=NP,
                PREC="tf32",
                num_warps=warps,
            )
            return dx0

        return run

    def dx_phit(BM, BC, warps):
        def run():
            _dx_phit_kernel[(triton.cdiv(T, BM), triton.cdiv(C, BC))](
                x,
                dout,
                du,
                coef,
                hres,
                dy,
                rcoef,
                phit,
                dx1,
                T,
                Kd,
                n,
                C,
                BM=BM,
                BC=BC,
                NS=NS,
                NP=NP,
                PREC="tf32",
                num_warps=warps,
            )
            return dx1

        return run

    base = dx_layer(32, 32, 4)().clone()
    bscale = base.abs().max().item()
    dx_cands = {}
    for cfg in [(32, 32, 4), (64, 32, 4), (64, 32, 8), (32, 16, 4)]:
        dx_cands[f"layer_kernel{cfg}"] = dx_layer(*cfg)
    for cfg in [
        (32, 32, 4),
        (64, 32, 4),
        (64, 32, 8),
        (128, 32, 8),
        (32, 64, 4),
        (64, 64, 8),
        (128, 16, 4),
        (64, 16, 4),
    ]:
        dx_cands[f"phit{cfg}"] = dx_phit(*cfg)
    for name, fn in dx_cands.items():
        try:
            err = (fn() - base).abs().max().item() / bscale
            row("dx", name, ms_of(fn), err, 3.25)
        except Exception as e:  # noqa: BLE001
            print(f"dx    {name:40s} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mhc_layer_probe.json"), "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                    torch=torch.__version__,
                    triton=triton.__version__,
                    T=T,
                    C=C,
                    n=n,
                    rows=rows,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
