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


# the layer's own helper ([BM, NS] → [BM, NS·BC]), shared by the candidate kernels below
_widen = K._widen


@triton.jit
def _dx_static_kernel(
    p_x,
    p_dout,
    p_du,
    p_coef,
    p_hres,
    p_dy,
    p_rcoef,
    p_phi,
    p_dx,
    T,
    K,
    N,
    n,
    C,
    BM: tl.constexpr,
    BC: tl.constexpr,
    NS: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # _hc_dx_kernel with the stream loop unrolled (NS constexpr): every load is issued up front.
    i_m = tl.program_id(0)
    i_c = tl.program_id(1)
    o_kk = tl.arange(0, NS * BC)
    o_j = o_kk // BC
    o_cc = i_c * BC + o_kk % BC
    m_kk = (o_j < n) & (o_cc < C)
    o_k = o_j * C + o_cc
    o_n = tl.arange(0, NP)
    m_n = o_n < N
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
    for i in tl.static_range(NS):
        b_do = tl.load(
            p_dout + o_t * K + i * C + o_cc[None, :],
            mask=m_mk & (o_kk * 0 + i < n)[None, :],
            other=0.0,
        )
        b_h = tl.load(
            p_hres + o_t * (n * n) + i * n + o_s[None, :],
            mask=m_ms & (o_s * 0 + i < n)[None, :],
            other=0.0,
        )
        b_dx += _widen(b_h.to(tl.float32), BM, NS, BC) * b_do.to(tl.float32)
    b_wt = tl.load(
        p_phi + o_k[None, :].to(tl.int64) * N + o_n[:, None],
        mask=m_kk[None, :] & m_n[:, None],
        other=0.0,
    ).to(tl.float32)
    b_dy = tl.load(p_dy + o_t * NP + o_n[None, :], mask=m_m[:, None], other=0.0)
    b_dx += tl.dot(b_dy, b_wt, input_precision=PREC)
    tl.store(p_dx + o_mk, b_dx.to(p_dx.dtype.element_ty), mask=m_mk)


@triton.jit
def _dx_loop_kernel(
    p_x,
    p_dout,
    p_du,
    p_coef,
    p_hres,
    p_dy,
    p_rcoef,
    p_phi,
    p_dx,
    p_dphi,
    T,
    K,
    N,
    n,
    C,
    n_tsplit,
    BM: tl.constexpr,
    BC: tl.constexpr,
    NS: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
    DPHI: tl.constexpr,
):
    # Channel block [c0, c0 + BC) of every stream, looping over token blocks (loads pipelined
    # across iterations, the φ tile loaded once); DPHI: also the partial dφᵀ = dhᵀ·x.
    i_c = tl.program_id(0)
    i_s = tl.program_id(1)
    o_kk = tl.arange(0, NS * BC)
    o_j = o_kk // BC
    o_cc = i_c * BC + o_kk % BC
    m_kk = (o_j < n) & (o_cc < C)
    o_k = o_j * C + o_cc
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    o_s = tl.arange(0, NS)
    b_wt = tl.load(
        p_phi + o_k[None, :].to(tl.int64) * N + o_n[:, None],
        mask=m_kk[None, :] & m_n[:, None],
        other=0.0,
    ).to(tl.float32)
    b_acc = tl.zeros((NP, NS * BC), tl.float32)
    for tb in range(i_s, tl.cdiv(T, BM), n_tsplit):
        o_m = tb * BM + tl.arange(0, BM)
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
        for i in tl.static_range(NS):
            b_do = tl.load(
                p_dout + o_t * K + i * C + o_cc[None, :],
                mask=m_mk & (o_kk * 0 + i < n)[None, :],
                other=0.0,
            )
            b_h = tl.load(
                p_hres + o_t * (n * n) + i * n + o_s[None, :],
                mask=m_ms & (o_s * 0 + i < n)[None, :],
                other=0.0,
            )
            b_dx += _widen(b_h.to(tl.float32), BM, NS, BC) * b_do.to(tl.float32)
        b_dy = tl.load(p_dy + o_t * NP + o_n[None, :], mask=m_m[:, None], other=0.0)
        b_dx += tl.dot(b_dy, b_wt, input_precision=PREC)
        tl.store(p_dx + o_mk, b_dx.to(p_dx.dtype.element_ty), mask=m_mk)
        if DPHI:
            b_dyt = tl.load(
                p_dy + o_m[None, :].to(tl.int64) * NP + o_n[:, None], mask=m_m[None, :], other=0.0
            )
            b_acc += tl.dot(b_dyt, b_x, input_precision=PREC)
    if DPHI:
        p_o = p_dphi + i_s.to(tl.int64) * K * NP + o_k[None, :].to(tl.int64) * NP + o_n[:, None]
        tl.store(p_o, b_acc, mask=m_kk[None, :])


@triton.jit
def _dx_gather_kernel(
    p_x,
    p_dout,
    p_du,
    p_coef,
    p_hres,
    p_dy,
    p_rcoef,
    p_phi,
    p_dx,
    T,
    K,
    N,
    n,
    C,
    BM: tl.constexpr,
    BC: tl.constexpr,
    NS: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # _hc_dx_kernel with the per-stream coefficients loaded straight into the [BM, NS·BC] tile
    # layout (a pointer per column, constant along each BC run) instead of widened in registers.
    i_m = tl.program_id(0)
    i_c = tl.program_id(1)
    o_kk = tl.arange(0, NS * BC)
    o_j = o_kk // BC
    o_cc = i_c * BC + o_kk % BC
    m_kk = (o_j < n) & (o_cc < C)
    o_k = o_j * C + o_cc
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T
    m_mk = m_m[:, None] & m_kk[None, :]
    o_t = o_m[:, None].to(tl.int64)
    o_mk = o_t * K + o_k[None, :]
    b_x = tl.load(p_x + o_mk, mask=m_mk, other=0.0).to(tl.float32)
    b_du = tl.load(p_du + o_t * C + o_cc[None, :], mask=m_mk, other=0.0).to(tl.float32)
    b_hp = tl.load(p_coef + o_t * (2 * n) + o_j[None, :], mask=m_mk, other=0.0)
    b_rc = tl.load(p_rcoef + o_m, mask=m_m, other=0.0)
    b_dx = b_hp * b_du + b_rc[:, None] * b_x
    for i in range(n):
        b_do = tl.load(p_dout + o_t * K + i * C + o_cc[None, :], mask=m_mk, other=0.0)
        b_h = tl.load(p_hres + o_t * (n * n) + i * n + o_j[None, :], mask=m_mk, other=0.0)
        b_dx += b_h.to(tl.float32) * b_do.to(tl.float32)
    b_wt = tl.load(
        p_phi + o_k[None, :].to(tl.int64) * N + o_n[:, None],
        mask=m_kk[None, :] & m_n[:, None],
        other=0.0,
    ).to(tl.float32)
    b_dy = tl.load(p_dy + o_t * NP + o_n[None, :], mask=m_m[:, None], other=0.0)
    b_dx += tl.dot(b_dy, b_wt, input_precision=PREC)
    tl.store(p_dx + o_mk, b_dx.to(p_dx.dtype.element_ty), mask=m_mk)


@triton.jit
def _dx_fma_kernel(
    p_x,
    p_dout,
    p_du,
    p_coef,
    p_hres,
    p_dy,
    p_rcoef,
    p_phi,
    p_dx,
    T,
    K,
    N,
    n,
    C,
    BM: tl.constexpr,
    BC: tl.constexpr,
    NS: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # _dx_gather_kernel with dh·φᵀ on the CUDA cores (N rank-1 updates): no shared memory, no
    # barrier.
    i_m = tl.program_id(0)
    i_c = tl.program_id(1)
    o_kk = tl.arange(0, NS * BC)
    o_j = o_kk // BC
    o_cc = i_c * BC + o_kk % BC
    m_kk = (o_j < n) & (o_cc < C)
    o_k = o_j * C + o_cc
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T
    m_mk = m_m[:, None] & m_kk[None, :]
    o_t = o_m[:, None].to(tl.int64)
    o_mk = o_t * K + o_k[None, :]
    b_x = tl.load(p_x + o_mk, mask=m_mk, other=0.0).to(tl.float32)
    b_du = tl.load(p_du + o_t * C + o_cc[None, :], mask=m_mk, other=0.0).to(tl.float32)
    b_hp = tl.load(p_coef + o_t * (2 * n) + o_j[None, :], mask=m_mk, other=0.0)
    b_rc = tl.load(p_rcoef + o_m, mask=m_m, other=0.0)
    b_dx = b_hp * b_du + b_rc[:, None] * b_x
    for i in range(n):
        b_do = tl.load(p_dout + o_t * K + i * C + o_cc[None, :], mask=m_mk, other=0.0)
        b_h = tl.load(p_hres + o_t * (n * n) + i * n + o_j[None, :], mask=m_mk, other=0.0)
        b_dx += b_h.to(tl.float32) * b_do.to(tl.float32)
    for c in range(N):
        b_w = tl.load(p_phi + o_k.to(tl.int64) * N + c, mask=m_kk, other=0.0).to(tl.float32)
        b_d = tl.load(p_dy + o_m.to(tl.int64) * NP + c, mask=m_m, other=0.0)
        b_dx += b_d[:, None] * b_w[None, :]
    tl.store(p_dx + o_mk, b_dx.to(p_dx.dtype.element_ty), mask=m_mk)


@triton.jit
def _dx4_stream(
    j: tl.constexpr,
    p_x,
    p_coef,
    p_hres,
    p_phi,
    p_dx,
    b_d0,
    b_d1,
    b_d2,
    b_d3,
    b_du,
    b_rc,
    b_dy,
    o_t,
    o_c,
    o_m,
    o_n,
    m_m,
    m_c,
    m_n,
    K,
    N,
    n,
    C,
    PREC: tl.constexpr,
):
    # dX of stream j: Σ_i H_res[i, j]·dX_next[i] + H_pre[j]·du + ρ·x[j] + dh·φ[j·C + c, :]ᵀ
    m_j = (o_c * 0 + j) < n
    m_tj = m_m[:, None] & (m_c & m_j)[None, :]
    p_h = p_hres + o_t * (n * n) + j
    m_h = m_m & ((o_m * 0 + j) < n)
    b_acc = tl.load(p_coef + o_t * (2 * n) + j, mask=m_h, other=0.0)[:, None] * b_du
    o_row = o_t[:, None] * K + (j * C + o_c)[None, :]
    b_acc += b_rc[:, None] * tl.load(p_x + o_row, mask=m_tj, other=0.0).to(tl.float32)
    b_acc += tl.load(p_h, mask=m_h, other=0.0)[:, None] * b_d0
    b_acc += tl.load(p_h + n, mask=m_h & ((o_m * 0 + 1) < n), other=0.0)[:, None] * b_d1
    b_acc += tl.load(p_h + 2 * n, mask=m_h & ((o_m * 0 + 2) < n), other=0.0)[:, None] * b_d2
    b_acc += tl.load(p_h + 3 * n, mask=m_h & ((o_m * 0 + 3) < n), other=0.0)[:, None] * b_d3
    b_w = tl.load(
        p_phi + (j * C + o_c)[None, :].to(tl.int64) * N + o_n[:, None],
        mask=(m_c & m_j)[None, :] & m_n[:, None],
        other=0.0,
    ).to(tl.float32)
    b_acc += tl.dot(b_dy, b_w, input_precision=PREC)
    tl.store(p_dx + o_row, b_acc.to(p_dx.dtype.element_ty), mask=m_tj)


@triton.jit
def _dx4_kernel(
    p_x,
    p_dout,
    p_du,
    p_coef,
    p_hres,
    p_dy,
    p_rcoef,
    p_phi,
    p_dx,
    T,
    K,
    N,
    n,
    C,
    BM: tl.constexpr,
    BC: tl.constexpr,
    NS: tl.constexpr,
    NP: tl.constexpr,
    PREC: tl.constexpr,
):
    # n ≤ 4: the four dX_next stream tiles [BM, BC] are loaded once each (no replicated loads)
    # and mixed in registers; each output stream is its own tile.
    i_c = tl.program_id(0)
    i_m = tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < T
    o_n = tl.arange(0, NP)
    m_n = o_n < N
    o_t = o_m.to(tl.int64)
    m_mc = m_m[:, None] & m_c[None, :]
    o_row = o_t[:, None] * K + o_c[None, :]
    b_d0 = tl.load(p_dout + o_row, mask=m_mc, other=0.0).to(tl.float32)
    b_d1 = tl.load(p_dout + o_row + C, mask=m_mc & ((o_c * 0 + 1) < n)[None, :], other=0.0).to(
        tl.float32
    )
    b_d2 = tl.load(p_dout + o_row + 2 * C, mask=m_mc & ((o_c * 0 + 2) < n)[None, :], other=0.0).to(
        tl.float32
    )
    b_d3 = tl.load(p_dout + o_row + 3 * C, mask=m_mc & ((o_c * 0 + 3) < n)[None, :], other=0.0).to(
        tl.float32
    )
    b_du = tl.load(p_du + o_t[:, None] * C + o_c[None, :], mask=m_mc, other=0.0).to(tl.float32)
    b_rc = tl.load(p_rcoef + o_m, mask=m_m, other=0.0)
    b_dy = tl.load(p_dy + o_t[:, None] * NP + o_n[None, :], mask=m_m[:, None], other=0.0)
    for j in tl.static_range(4):
        _dx4_stream(
            j,
            p_x,
            p_coef,
            p_hres,
            p_phi,
            p_dx,
            b_d0,
            b_d1,
            b_d2,
            b_d3,
            b_du,
            b_rc,
            b_dy,
            o_t,
            o_c,
            o_m,
            o_n,
            m_m,
            m_c,
            m_n,
            K,
            N,
            n,
            C,
            PREC,
        )


def _ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=16 * 2048)
    ap.add_argument("--C", type=int, default=4096)
    ap.add_argument("--check-only", action="store_true", help="no timing (CPU interpreter)")
    ap.add_argument("--all", action="store_true", help="also the dX candidates of run 2")
    ap.add_argument("--skip-dphi", action="store_true")
    ap.add_argument("--prec", default="tf32", choices=["tf32", "ieee"])
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
    cands["layer_kernel(64, 64, 4, 4)"] = split_launch(
        K._hc_dphi_kernel, 64, 64, 4, 4, extra=(x, dy), PREC="tf32"
    )
    for cfg in [
        (32, 128, 4, 4),
        (32, 64, 4, 4),
        (32, 128, 4, 2),
        (16, 128, 4, 4),
        (32, 256, 8, 2),
        (64, 128, 8, 4),
    ]:
        cands[f"transposed{cfg}"] = split_launch(_dphi_t_kernel, *cfg, extra=(x, dy), PREC="tf32")
    if args.prec == "ieee":
        cands = {
            f"layer_kernel{cfg}": split_launch(K._hc_dphi_kernel, *cfg, extra=(x, dy), PREC="ieee")
            for cfg in [(64, 64, 4, 4), (32, 128, 4, 2)]
        }
    dyc = dy[:, :N].contiguous()
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for tf in (False, True):

            def run_mm(tf=tf):
                torch.backends.cuda.matmul.allow_tf32 = tf
                return torch.mm(x.t(), dyc)

            cands[f"cublas_mm(tf32={tf})"] = run_mm
        for name, fn in ({} if args.skip_dphi else cands).items():
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
    dx0 = torch.empty_like(x)
    dx1 = torch.empty_like(x)

    def dx_tile(kernel, BM, BC, warps, out, prec="tf32", channels_fastest=True):
        # one [BM tokens × n·BC channels] tile per program; the library's _hc_dx_kernel and
        # _dx4_kernel take channel blocks on grid axis 0, the older candidates token blocks
        grid = (triton.cdiv(C, BC), triton.cdiv(T, BM))
        grid = grid if channels_fastest else grid[::-1]

        def run():
            kernel[grid](x, dout, du, coef, hres, dy, rcoef, phi, out, T, Kd, N, n, C, BM=BM,
                         BC=BC, NS=NS, NP=NP, PREC=prec, num_warps=warps)  # fmt: skip
            return out

        return run

    def dx_layer(BM, BC, warps):
        return dx_tile(K._hc_dx_kernel, BM, BC, warps, dx0, args.prec)

    def dx_token_fastest(kernel, BM, BC, warps):
        return dx_tile(kernel, BM, BC, warps, dx1, channels_fastest=False)

    def dx_loop(BM, BC, warps, per_sm, stages, dphi):
        c_progs = triton.cdiv(C, BC)
        n_ts = max(1, min(triton.cdiv(T, BM), triton.cdiv(per_sm * nsm, c_progs)))
        part = torch.empty((n_ts, Kd, NP), device=dev) if dphi else dx1

        def run():
            _dx_loop_kernel[(c_progs, n_ts)](
                x,
                dout,
                du,
                coef,
                hres,
                dy,
                rcoef,
                phi,
                dx1,
                part,
                T,
                Kd,
                N,
                n,
                C,
                n_ts,
                BM=BM,
                BC=BC,
                NS=NS,
                NP=NP,
                PREC="tf32",
                DPHI=dphi,
                num_warps=warps,
                num_stages=stages,
            )
            if dphi:
                return dx1, part.sum(0)
            return dx1

        return run

    base = dx_layer(32, 32, 4)().clone()
    bscale = base.abs().max().item()
    ref_dphi = (x.double().t() @ dy.double())[:, :N]
    dscale = ref_dphi.abs().max().item()
    # the library kernel (channel blocks fastest since run 5, "swap" in the run-5/6 results)
    dx_cands = {f"layer_kernel{c}": dx_layer(*c) for c in [(32, 32, 4), (16, 32, 2), (16, 32, 4)]}
    for cfg in [(16, 32, 2), (16, 64, 2), (32, 32, 2), (16, 32, 1), (32, 64, 4), (16, 128, 4),
                (32, 128, 4), (64, 64, 4), (16, 64, 4)]:  # fmt: skip
        dx_cands[f"n4{cfg}"] = dx_tile(_dx4_kernel, *cfg, dx1)
    if args.all:
        for cfg in [(32, 32, 4), (16, 32, 4), (16, 32, 2), (32, 32, 2), (16, 64, 4), (32, 16, 2)]:
            dx_cands[f"gather{cfg}"] = dx_token_fastest(_dx_gather_kernel, *cfg)
        for cfg in [(32, 32, 4), (16, 32, 2), (16, 64, 4), (32, 16, 2)]:
            dx_cands[f"fma{cfg}"] = dx_token_fastest(_dx_fma_kernel, *cfg)
        for cfg in [(32, 32, 4), (32, 64, 4), (64, 32, 8), (16, 64, 4)]:
            dx_cands[f"static{cfg}"] = dx_token_fastest(_dx_static_kernel, *cfg)
        for cfg in [
            (32, 32, 4, 2, 3),
            (32, 32, 8, 2, 3),
            (16, 32, 4, 4, 3),
            (32, 16, 4, 4, 3),
            (64, 32, 8, 2, 2),
            (32, 32, 4, 4, 2),
        ]:
            dx_cands[f"loop{cfg}"] = dx_loop(*cfg, False)
            dx_cands[f"loop+dphi{cfg}"] = dx_loop(*cfg, True)
    if args.prec == "ieee":
        dx_cands = {
            f"layer_kernel{c}": dx_layer(*c) for c in [(32, 32, 4), (16, 32, 2), (32, 32, 2)]
        }
    for name, fn in dx_cands.items():
        try:
            out = fn()
            err = (out[0] if isinstance(out, tuple) else out) - base
            err = err.abs().max().item() / bscale
            if isinstance(out, tuple):
                derr = (out[1][:, :N].double() - ref_dphi).abs().max().item() / dscale
                err = max(err, derr)
            row("dx", name, ms_of(fn), err, 4.25 if "dphi" in name else 3.25)
        except Exception as e:  # noqa: BLE001
            print(f"dx    {name:40s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"mhc_layer_probe_{args.prec}.json"), "w") as f:
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
