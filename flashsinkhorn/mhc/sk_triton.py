"""Triton kernels of the mHC projection, their kernel cache and their launchers.

Two paths compute the same scaling-vector recursion as :mod:`.sk_torch` (see its docstring):

* small path, n ≤ 4: one matrix per lane, each entry a separate [BLOCK] register tensor, BLOCK
  matrices per program. The kernel source is generated for the given (n, n_iters, variant) by
  :mod:`.sk_codegen` so that the backward can keep scaling vectors in named registers (Triton
  has no register arrays) and replay the iterations in reverse without any HBM scratch. By
  default the first rounds of the log backward run as rolled loops whose scaling vectors go
  through per-lane shared memory declared in inline PTX, and the last rounds are unrolled in
  registers (see :func:`.sk_codegen.gen_small` for this and the other register/recompute
  trade-offs). Reciprocals are computed once per row/column and multiplied (``rcp.approx`` on
  the GPU). This module compiles the generated source (:func:`_small_kernels`, cached per
  source) and picks the launch configuration (``SMALL_CONFIG``).
* general path, n ≤ 32: one matrix per program as an [NP, NP] tile; the backward stores the
  states of up to HS half-steps in an on-chip [HS, NP] tile and, when there are more half-steps,
  recomputes each earlier segment from the logits (segment checkpointing, O(T²/HS) extra work).

Neither path writes anything per matrix to HBM except the result. Both forwards can check the
logits they load (compile-time ``CHECK``): they set the bytes of a small flag for NaN/+inf, a
row or a column of -inf only (:mod:`.value_check`), and write nothing for good logits.

The generator options of the small backward (``TUNING.mhc_small_bwd``) and the HS cap of the
general backward (``TUNING.mhc_gen_hs_max``) are read from :mod:`flashsinkhorn.tuning` at every
backward launch; the forward reads no switch (only the reciprocal pairing, a per-dtype
constant, shapes it).
"""

from __future__ import annotations

import linecache
import os
import threading

import torch
import triton
import triton.language as tl

from .._direct_launch import DirectLaunch
from .._triton_launch import FP_FUSION, cdiv, next_pow2
from ..tuning import TUNING, Tuning
from .sk_codegen import gen_small

__all__ = ["SMALL_CONFIG", "sk_backward_triton", "sk_forward_triton"]

# (matrices per program, warps[, maxnreg]) of the small path; bench/bench_mhc.py and
# bench/dev/sk_bwd_sweep.py sweep these. maxnreg caps the registers (ptxas spills the rest to
# L1-resident local memory) to fit more warps per SM. Defaults: the fastest of the sweeps on the
# H200 at B = 2^24 (bench/results/mhc_h200.json, bench/results/dev/sk_bwd_sweep_h200_*.json).
# The log backward with 128 registers runs 16 warps per SM (12 at its natural 168); the
# deepseek backward keeps every scaling vector (no checkpointing) and is not capped.
SMALL_CONFIG = {"fwd": (256, 8), "bwd": (64, 2, 128), "bwd_deepseek": (64, 2)}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _rcp(x, FAST: tl.constexpr):
    # rcp.approx (≤1 ulp) instead of the IEEE division sequence: the recursion needs only
    # relative accuracy, and the reciprocal is on the critical path of every half-step.
    if FAST:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


@triton.jit
def _rcp_nc(x, FAST: tl.constexpr):
    # Same as _rcp, but opaque to common-subexpression elimination: the backward recomputes
    # the row scalings from the stored column scalings and must not get the forward's values
    # back from the compiler (that would keep both vectors of every round live).
    if FAST:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=False, pack=1
        )
    else:
        return 1.0 / x


@triton.jit
def _max_nan(a, b):
    # NaN if either is NaN (tl.maximum's default returns the other operand): the value check
    # reads a NaN logit off the row maximum
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


# ---------------------------------------------------------------------------------------------
# Small path: the generated kernels, compiled once per (n, n_iters, variant, options, block).
# ---------------------------------------------------------------------------------------------

_SMALL_CACHE: dict = {}
# Concurrent first calls would each generate and compile their own kernel (check-then-set
# race); the lock makes one thread build it and the others reuse it.
_SMALL_CACHE_LOCK = threading.Lock()


def _small_kernels(n: int, n_iters: int, variant: str, opts: tuple | None = None, block: int = 64):
    """(forward, backward) kernels; opts as in :func:`.sk_codegen.gen_small` (default: the
    ``TUNING.mhc_small_bwd`` in force, which is part of the cache key); block: the backward's
    matrices per program (sizes its shared memory)."""
    opts = tuple(TUNING.mhc_small_bwd if opts is None else opts)
    key = (n, n_iters, variant, opts, block)
    hit = _SMALL_CACHE.get(key)
    if hit is not None:
        return hit
    with _SMALL_CACHE_LOCK:
        return _build_small_kernels(key, n, n_iters, variant, opts, block)


def _build_small_kernels(key, n, n_iters, variant, opts, block):
    if key not in _SMALL_CACHE:
        src = gen_small(n, n_iters, variant, *opts, block=block)
        fname = f"<flashsinkhorn.mhc generated sk n={n} T={n_iters} {variant} {opts} {block}>"
        # triton.jit reads the source through inspect/linecache; mtime None keeps the entry
        # from being evicted by linecache.checkcache().
        linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
        ns = {
            "triton": triton,
            "tl": tl,
            "_rcp": _rcp,
            "_rcp_nc": _rcp_nc,
            "_max_nan": _max_nan,
            "__name__": "flashsinkhorn.mhc._gen",
        }
        exec(compile(src, fname, "exec"), ns)  # noqa: S102 - generated from our own template
        _SMALL_CACHE[key] = (ns["_sk_small_fwd_kernel"], ns["_sk_small_bwd_kernel"])
    return _SMALL_CACHE[key]


# ---------------------------------------------------------------------------------------------
# General path: one matrix per program, [NP, NP] tile.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gen_setup(p_x, i_m, n, eps, NP: tl.constexpr, LOG: tl.constexpr):
    o_r = tl.arange(0, NP)
    o_c = tl.arange(0, NP)
    m_r = o_r < n
    m_c = o_c < n
    m_rc = m_r[:, None] & m_c[None, :]
    p = p_x + i_m * n * n + o_r[:, None].to(tl.int64) * n + o_c[None, :]
    b_m = tl.load(p, mask=m_rc, other=-float("inf")).to(tl.float32)
    # padded rows would give −inf − (−inf): pin their max to 0
    b_f = tl.where(m_r, tl.max(b_m, 1), 0.0)
    b_l = tl.where(m_rc, b_m - b_f[:, None], -float("inf"))
    if LOG:
        b_g = tl.max(b_l, 0)
        b_g = tl.where(m_c, b_g, 0.0)
        b_a = tl.where(m_rc, tl.exp2((b_l - b_g[None, :]) * 1.4426950408889634), 0.0)
        v_b = tl.where(m_c, tl.exp2(b_g * 1.4426950408889634), 0.0)
    else:
        b_e = tl.where(m_rc, tl.exp2(b_l * 1.4426950408889634), 0.0)
        b_s = tl.sum(b_e, 1)
        b_s = tl.where(m_r, b_s, 1.0)
        b_a = tl.where(m_rc, b_e / b_s[:, None] + eps, 0.0)
        v_b = tl.where(m_c, 1.0, 0.0)
    v_a = tl.where(m_r, 1.0, 0.0)
    return b_a, v_a, v_b, m_r, m_c, m_rc, b_m


@triton.jit
def _gen_check(p_flag, b_m, m_r, m_c):
    """Sets the value-check bytes of one matrix in p_flag, as the small path does
    (sk_codegen._emit_check); padded entries of b_m are -inf."""
    r_max = tl.where(m_r, tl.reduce(b_m, 1, _max_nan), 0.0)
    c_max = tl.where(m_c, tl.reduce(b_m, 0, _max_nan), 0.0)
    hi = tl.reduce(r_max, 0, _max_nan)
    # stores masked by the scalar condition: the same bytes as branching on it, which
    # Triton 3.6 miscompiled for sm_90 here (the "deepseek" projection's output changed
    # with the check on); Triton 3.2's interpreter ignores such a mask (tests skip there)
    bad = (hi != hi) | (hi == float("inf"))
    tl.store(p_flag, bad.to(tl.int8), mask=bad)
    bad = tl.min(r_max, 0) == -float("inf")
    tl.store(p_flag + 1, bad.to(tl.int8), mask=bad)
    bad = tl.min(c_max, 0) == -float("inf")
    tl.store(p_flag + 2, bad.to(tl.int8), mask=bad)


@triton.jit
def _gen_row(b_a, v_a, v_b, m_r, eps, LOG: tl.constexpr):
    r = tl.sum(b_a * v_b[None, :], 1)
    if LOG:
        out = 1.0 / tl.where(m_r, r, 1.0)
    else:
        out = v_a / (v_a * r + eps)
    return tl.where(m_r, out, 0.0)


@triton.jit
def _gen_col(b_a, v_a, v_b, m_c, eps, LOG: tl.constexpr):
    c = tl.sum(b_a * v_a[:, None], 0)
    if LOG:
        out = 1.0 / tl.where(m_c, c, 1.0)
    else:
        out = v_b / (v_b * c + eps)
    return tl.where(m_c, out, 0.0)


@triton.jit
def _sk_gen_fwd_kernel(
    p_x,
    p_out,
    p_flag,
    n,
    n_half,
    eps,
    FIRST: tl.constexpr,
    NP: tl.constexpr,
    LOG: tl.constexpr,
    CHECK: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64)
    b_a, v_a, v_b, m_r, m_c, m_rc, b_m = _gen_setup(p_x, i_m, n, eps, NP, LOG)
    if CHECK:
        _gen_check(p_flag, b_m, m_r, m_c)
    for h in range(n_half):
        if (h + FIRST) % 2 == 0:
            v_a = _gen_row(b_a, v_a, v_b, m_r, eps, LOG)
        else:
            v_b = _gen_col(b_a, v_a, v_b, m_c, eps, LOG)
    b_p = v_a[:, None] * b_a * v_b[None, :]
    o_r = tl.arange(0, NP)
    p = p_out + i_m * n * n + o_r[:, None].to(tl.int64) * n + o_r[None, :]
    tl.store(p, b_p.to(p_out.dtype.element_ty), mask=m_rc)


@triton.jit
def _sk_gen_bwd_kernel(
    p_x,
    p_g,
    p_out,
    n,
    n_half,
    eps,
    FIRST: tl.constexpr,
    NP: tl.constexpr,
    HS: tl.constexpr,
    LOG: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64)
    b_a, v_a0, v_b0, m_r, m_c, m_rc, _ = _gen_setup(p_x, i_m, n, eps, NP, LOG)
    o_r = tl.arange(0, NP)
    o_h = tl.arange(0, HS)
    p_off = i_m * n * n + o_r[:, None].to(tl.int64) * n + o_r[None, :]
    b_dp = tl.load(p_g + p_off, mask=m_rc, other=0.0).to(tl.float32)
    b_da = tl.zeros((NP, NP), tl.float32)
    d_a = tl.zeros((NP,), tl.float32)
    d_b = tl.zeros((NP,), tl.float32)
    n_seg = tl.cdiv(n_half, HS)
    for s_rev in range(n_seg):
        seg = n_seg - 1 - s_rev
        h0 = seg * HS
        h1 = tl.minimum(h0 + HS, n_half)
        # Recompute the states up to the segment (no storage), then through it (stored).
        v_a = v_a0
        v_b = v_b0
        for h in range(h0):
            if (h + FIRST) % 2 == 0:
                v_a = _gen_row(b_a, v_a, v_b, m_r, eps, LOG)
            else:
                v_b = _gen_col(b_a, v_a, v_b, m_c, eps, LOG)
        hist_a = tl.zeros((HS, NP), tl.float32)
        hist_b = tl.zeros((HS, NP), tl.float32)
        for h in range(h0, h1):
            sel = (o_h == h - h0)[:, None]
            hist_a = tl.where(sel, v_a[None, :], hist_a)
            hist_b = tl.where(sel, v_b[None, :], hist_b)
            if (h + FIRST) % 2 == 0:
                v_a = _gen_row(b_a, v_a, v_b, m_r, eps, LOG)
            else:
                v_b = _gen_col(b_a, v_a, v_b, m_c, eps, LOG)
        if seg == n_seg - 1:
            # output P = diag(a) A diag(b)
            b_da = b_dp * v_a[:, None] * v_b[None, :]
            d_a = tl.sum(b_dp * b_a * v_b[None, :], 1)
            d_b = tl.sum(b_dp * b_a * v_a[:, None], 0)
        for hh in range(h1 - h0):
            h = h1 - 1 - hh
            sel = (o_h == h - h0)[:, None]
            a_p = tl.sum(tl.where(sel, hist_a, 0.0), 0)
            b_p = tl.sum(tl.where(sel, hist_b, 0.0), 0)
            if (h + FIRST) % 2 == 0:
                a_n = _gen_row(b_a, a_p, b_p, m_r, eps, LOG)
                d_r = -d_a * a_n * a_n
                if LOG:
                    d_a = tl.zeros((NP,), tl.float32)
                else:
                    q = a_n / tl.where(m_r, a_p, 1.0)
                    d_a = d_a * eps * q * q
                b_da += d_r[:, None] * b_p[None, :]
                d_b += tl.sum(b_a * d_r[:, None], 0)
            else:
                b_n = _gen_col(b_a, a_p, b_p, m_c, eps, LOG)
                d_c = -d_b * b_n * b_n
                if LOG:
                    d_b = tl.zeros((NP,), tl.float32)
                else:
                    q = b_n / tl.where(m_c, b_p, 1.0)
                    d_b = d_b * eps * q * q
                b_da += a_p[:, None] * d_c[None, :]
                d_a += tl.sum(b_a * d_c[None, :], 1)
    if LOG:
        b_dm = b_da * b_a
    else:
        b_s = tl.where(m_rc, b_a - eps, 0.0)
        b_w = tl.sum(b_da * b_s, 1)
        b_dm = b_s * (b_da - b_w[:, None])
    tl.store(p_out + p_off, b_dm.to(p_out.dtype.element_ty), mask=m_rc)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _gen_meta(n: int, n_iters: int, variant: str):
    first = 0 if variant == "log" else 1
    np_ = max(2, next_pow2(n))
    warps = 1 if np_ <= 8 else (2 if np_ <= 16 else 4)
    return first, 2 * n_iters - first, np_, warps


def _launch_cfg(cfg: tuple, m: torch.Tensor):
    """(BLOCK, launch kwargs) from a SMALL_CONFIG entry (BLOCK, warps[, maxnreg])."""
    kw = {"num_warps": cfg[1]}
    if len(cfg) > 2 and cfg[2] and m.is_cuda and not _interpreting():
        kw["maxnreg"] = cfg[2]
    return cfg[0], kw


# Paired reciprocals in the forward (one rcp.approx for two row or column sums, see
# sk_codegen._emit_rcps) per logits dtype. With 16-bit logits the forward moves half the bytes
# and is bound by the MUFU unit (176 reciprocals and exponentials per matrix at n = 4, 20
# iterations), which pairing halves; in fp32 the memory time dominates and pairing was slower.
SMALL_FWD_PAIR = {torch.float32: False, torch.float16: True, torch.bfloat16: True}

# Launchers of the small path, built once per compile-time configuration. A small batch costs
# the GPU a few microseconds, Triton's argument binding several times that: DirectLaunch skips
# the binding once a specialisation is compiled.
# Forward: per (n, n_iters, variant, dtype, on the GPU, launch configuration, pairing, value
# check): (launcher, matrices per program).
_FWD_LAUNCH: dict = {}
# Of the generator options only the pairing shapes the forward (the others are the backward's):
# the forward is generated from the defaults with the pairing set, so that a launch reads no
# tuning switch (a context-variable read per call).
_FWD_OPTS = {
    pair: (*Tuning.mhc_small_bwd[:2], pair, *Tuning.mhc_small_bwd[3:]) for pair in (False, True)
}


def _small_fwd_launch(n: int, n_iters: int, variant: str, m: torch.Tensor, check: bool = False):
    cfg = SMALL_CONFIG["fwd"]
    dtype = m.dtype
    pair = SMALL_FWD_PAIR.get(dtype, False)
    key = (n, n_iters, variant, dtype, m.is_cuda, cfg, pair, check)
    hit = _FWD_LAUNCH.get(key)
    if hit is None:
        fwd, _ = _small_kernels(n, n_iters, variant, _FWD_OPTS[bool(pair)])
        block, kw = _launch_cfg(cfg, m)
        fast = m.is_cuda and not _interpreting()
        launcher = DirectLaunch(fwd, **kw, **FP_FUSION, BLOCK=block, FAST=fast, CHECK=check)
        hit = _FWD_LAUNCH[key] = (launcher, block)
    return hit


# Backward: per (n, n_iters, variant, on the GPU, generator options, launch configuration):
# (launcher, matrices per program). Fast reciprocals follow from the device (the interpreter
# is chosen before the kernels are defined), so the key leaves out the environment read.
_BWD_LAUNCH: dict = {}


def _small_bwd_launch(n: int, n_iters: int, variant: str, m: torch.Tensor):
    cfg = SMALL_CONFIG["bwd" if variant == "log" else "bwd_deepseek"]
    opts = TUNING.mhc_small_bwd  # the one switch a backward call reads
    if type(opts) is not tuple:
        opts = tuple(opts)
    key = (n, n_iters, variant, m.is_cuda, opts, cfg)
    hit = _BWD_LAUNCH.get(key)
    if hit is None:
        fast = m.is_cuda and not _interpreting()
        block, kw = _launch_cfg(cfg, m)
        looped = (opts[7:8] or (None,))[0] is not None
        if fast and variant == "log" and looped and block != 32 * kw["num_warps"]:
            # the shared-memory asm addresses one slot set per lane (sk_codegen._emit_sh_decl)
            raise RuntimeError(f"SMALL_CONFIG['bwd'] = {cfg} needs BLOCK = 32 * num_warps")
        _, bwd = _small_kernels(n, n_iters, variant, opts, block=block)
        launcher = DirectLaunch(bwd, **kw, **FP_FUSION, BLOCK=block, FAST=fast)
        hit = _BWD_LAUNCH[key] = (launcher, block)
    return hit


def sk_forward_triton(
    m: torch.Tensor,
    n_iters: int,
    variant: str,
    eps: float,
    path: str = "auto",
    flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward projection on (B, n, n) contiguous logits; returns the input dtype.

    flag: int8 tensor of 4 zeros (:func:`.value_check.take_flag`) whose bytes the kernel sets
    for logits without a projection (:mod:`.value_check`); None: no value check.
    """
    bsz, n, _ = m.shape
    out = torch.empty_like(m)
    if bsz == 0:
        return out
    eps = 0.0 if variant == "log" else float(eps)
    check = flag is not None
    if path == "small" or (path == "auto" and n <= 4):
        fwd, block = _small_fwd_launch(n, n_iters, variant, m, check)
        # without a check the kernel never touches p_flag: the output stands in for it
        fwd((cdiv(bsz, block),), m, out, flag if check else out, bsz, eps)
        return out
    first, n_half, np_, warps = _gen_meta(n, n_iters, variant)
    _sk_gen_fwd_kernel[(bsz,)](
        m,
        out,
        flag if check else out,
        n,
        n_half,
        eps,
        FIRST=first,
        NP=np_,
        LOG=variant == "log",
        CHECK=check,
        num_warps=warps,
        **FP_FUSION,
    )
    return out


def sk_backward_triton(
    m: torch.Tensor,
    grad: torch.Tensor,
    n_iters: int,
    variant: str,
    eps: float,
    path: str = "auto",
) -> torch.Tensor:
    """dL/dM for (B, n, n) contiguous logits and upstream gradient, recomputing on chip."""
    bsz, n, _ = m.shape
    out = torch.empty_like(m)
    if bsz == 0:
        return out
    eps = 0.0 if variant == "log" else float(eps)
    if path == "small" or (path == "auto" and n <= 4):
        bwd, block = _small_bwd_launch(n, n_iters, variant, m)
        bwd((cdiv(bsz, block),), m, grad, out, bsz, eps)
        return out
    first, n_half, np_, warps = _gen_meta(n, n_iters, variant)
    hs = min(TUNING.mhc_gen_hs_max, max(2, next_pow2(n_half)))
    _sk_gen_bwd_kernel[(bsz,)](
        m,
        grad,
        out,
        n,
        n_half,
        eps,
        FIRST=first,
        NP=np_,
        HS=hs,
        LOG=variant == "log",
        num_warps=warps,
        **FP_FUSION,
    )
    return out
