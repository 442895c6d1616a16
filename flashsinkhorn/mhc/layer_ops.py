"""Custom ops of the hyper-connection layer: the fused Triton kernels behind ``torch.library``.

Every op below is registered as ``flashsinkhorn::<name>`` with a fake (meta) implementation and
an autograd formula whose backward is itself a custom op, so ``torch.compile(fullgraph=True)``
traces a model that uses the layer without graph breaks, and AOTAutograd keeps each kernel
group one opaque node of the forward and backward graphs. Eager calls go through an
``autograd.Function`` built from the same implementation, setup and backward functions (the
custom-op dispatch costs tens of µs of host time per call; see :func:`_dual`).

Ops (T tokens, n streams, C channels; X is (T, n, C) in any of fp32/bf16/fp16, coefficients
are fp32):

* ``mhc_pre`` (dynamic coefficients + pre-mix): X, φ, α's, bias → u (T, C), H_pre (T, n),
  H_post (T, n), H_res (T, n, n), a *sink* (T, n, C), and saved intermediates. The sink holds
  no data: it is the edge along which ``mhc_post``'s backward hands dX_next (or, in the unfused
  schedule, H_resᵀ·dX_next) to ``mhc_pre``'s backward, which writes all of dX in one pass
  (layer.py explains the schedules). ``mix=False`` computes the coefficients only.
* ``mhc_post`` (residual update): X, F, H_post, H_res, sink → X_next = H_res·X + H_postᵀ·F.
* ``mhc_mix`` (stream mix with given coefficients): X, H_pre, H_res → u and either
  R = H_res·X (``write_r``) or a sink (the layer's static mode, with ``mhc_post`` after it).
* ``mhc_add_residual``: R, F, H_post → R + H_postᵀ·F.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .._triton_launch import FP_FUSION, cdiv, cuda_sm_count, next_pow2
from ..tuning import TUNING
from .sinkhorn import _OnFirstUse

K = _OnFirstUse(".layer_kernels")
_SK = _OnFirstUse(".sk_triton")

Tensor = torch.Tensor

# (token block, channel block, warps) of _hc_dx_kernel; (token block, K block, warps, programs
# per SM) of _hc_dphi_kernel. The dX pass with the ieee dot (Triton's CUDA-core dot) wants
# larger tiles: (16, 32, 2) takes it from 8.9 to 67 ms on the H200.
# CUDA's limit on grid axes 1 and 2; _hc_dx_kernel's token blocks (axis 1) go in slices of it
MAX_GRID_Y = 65_535
DX_CFG = (16, 32, 2)
DX_CFG_IEEE = (32, 32, 4)
DPHI_CFG = (32, 128, 4, 2)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return cuda_sm_count(device)


def _meta(n: int):
    NS = max(2, next_pow2(n))
    N = n * n + 2 * n
    NP = max(16, next_pow2(N))
    return NS, N, NP


def _f32(x: Tensor, shape) -> Tensor:
    return torch.empty(shape, device=x.device, dtype=torch.float32)


def _sink(x: Tensor) -> Tensor:
    """The sink output: X's shape and dtype with no storage (one zero, all strides 0). Only
    its gradient matters, and a deterministic value keeps the op's outputs comparable."""
    return x.new_zeros(()).expand(x.shape)


def _dual(name: str, impl, fake, setup_context, backward, non_differentiable=()):
    """Registers ``impl`` as the custom op ``flashsinkhorn::name`` (fake and autograd included)
    and returns ``(op, call)``: ``call`` runs the op while ``torch.compile`` traces, and
    otherwise an ``autograd.Function`` with the same forward, saved state and backward (the
    custom op's Python dispatch costs ≈ 30 µs of host time per call, the Function ≈ 7). The
    Function marks its context ``eager``: its backward then runs the backward implementation
    directly, while the op's backward (traced by AOTAutograd) calls the backward op.
    ``non_differentiable``: indices of outputs that never carry a gradient (the saved
    intermediates), marked as such on the eager path."""
    op = torch.library.custom_op(f"flashsinkhorn::{name}", mutates_args=())(impl)
    op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup_context)

    class _Eager(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            return impl(*args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs, output)
            ctx.eager = True
            if non_differentiable:
                ctx.mark_non_differentiable(*(output[i] for i in non_differentiable))

        @staticmethod
        @once_differentiable
        def backward(ctx, *grads):
            # the kernels' gradients carry no graph: a double backward must raise (as the
            # custom op's backward op, which has no autograd formula), not differentiate the
            # few torch ops between them
            return backward(ctx, *grads)

    _Eager.__name__ = _Eager.__qualname__ = f"_{name}_function"

    def call(*args):
        if torch.compiler.is_compiling():
            return op(*args)
        return _Eager.apply(*args)

    return op, call


def _backward_op(name: str, impl, fake):
    """Registers a backward implementation as the custom op ``flashsinkhorn::name`` and
    returns ``(op, call)``: ``call(ctx, *args)`` runs ``impl`` directly under the eager
    Function of :func:`_dual` (no custom-op dispatch), and the op where AOTAutograd traces."""
    op = torch.library.custom_op(f"flashsinkhorn::{name}", mutates_args=())(impl)
    op.register_fake(fake)

    def call(ctx, *args):
        return impl(*args) if getattr(ctx, "eager", False) else op(*args)

    return op, call


# ---------------------------------------------------------------------------------------------
# mhc_pre: dynamic coefficients (+ pre-mix)
# ---------------------------------------------------------------------------------------------


def _pre_impl(
    x: Tensor,
    phi: Tensor,
    a_pre: Tensor,
    a_post: Tensor,
    a_res: Tensor,
    bias: Tensor,
    n_iters: int,
    variant: str,
    eps: float,
    rms_eps: float,
    prec: str,
    softmax_pre: bool,
    mix: bool,
    fused: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    T, n, C = x.shape
    Kd = n * C
    NS, N, NP = _meta(n)
    dev = x.device
    BM, BK = 64, 64
    n_mb = cdiv(T, BM)
    k_tiles = cdiv(Kd, BK)
    # Split K only as much as needed to fill the GPU (about two programs per SM).
    n_split = max(1, min(k_tiles // 4, cdiv(2 * _num_sms(dev), n_mb)))
    k_split = cdiv(k_tiles, n_split) * BK
    n_split = cdiv(Kd, k_split)
    y_part = _f32(x, (n_split, T, NP))
    ss_part = _f32(x, (n_split, T))
    if TUNING.mhc_gemm_phi_t and prec != "ieee":
        w = torch.zeros((NP, Kd), device=dev, dtype=phi.dtype)
        w[:N] = phi.t()
        s_wk, s_wn = 1, Kd
    else:
        w, (s_wk, s_wn) = phi, phi.stride()
    K._hc_gemm_rms_kernel[(n_mb, n_split)](
        x, w, y_part, ss_part, T, Kd, N, k_split, s_wk, s_wn,
        BM=BM, BK=BK, NP=NP, PREC=prec, num_warps=4, **FP_FUSION,
    )  # fmt: skip
    y_raw = _f32(x, (T, N))
    r = _f32(x, (T,))
    coef = _f32(x, (T, 2 * n))
    res_logits = _f32(x, (T, n, n))
    BMF = 32
    K._hc_finalize_kernel[(cdiv(T, BMF),)](
        y_part, ss_part, a_pre, a_post, a_res, bias, y_raw, r, coef, res_logits,
        T, Kd, N, n, n_split, rms_eps, BM=BMF, NP=NP, SOFTMAX=softmax_pre, num_warps=4,
        **FP_FUSION,
    )  # fmt: skip
    h_res = _SK.sk_forward_triton(res_logits, n_iters, variant, eps)
    if mix:
        u = torch.empty((T, C), device=dev, dtype=x.dtype)
        BC = min(1024, next_pow2(C))
        K._hc_premix_kernel[(T, cdiv(C, BC))](x, coef, u, n, C, NS=NS, BC=BC, **FP_FUSION)
        sink = _sink(x)
    else:
        u = x.new_empty((T, 0))
        sink = x.new_empty((0, n, C))
    return u, coef[:, :n].contiguous(), coef[:, n:].contiguous(), h_res, sink, y_raw, r


def _pre_fake(x, phi, a_pre, a_post, a_res, bias, n_iters, variant, eps, rms_eps, prec,
              softmax_pre, mix, fused):  # fmt: skip
    T, n, C = x.shape
    _, N, _ = _meta(n)
    u = x.new_empty((T, C) if mix else (T, 0))
    sink = _sink(x) if mix else x.new_empty((0, n, C))
    return (
        u, _f32(x, (T, n)), _f32(x, (T, n)), _f32(x, (T, n, n)), sink, _f32(x, (T, N)),
        _f32(x, (T,)),
    )  # fmt: skip


def _pre_setup(ctx, inputs, output):
    x, phi, a_pre, a_post, a_res, bias, n_iters, variant, eps, rms_eps, prec, sm, mix, fused = (
        inputs
    )
    y_raw, r = output[5:]
    # Only (y, r) per token: the coefficients, the projection's logits and H_res are recomputed
    # from them in the backward (a few elementwise ops and one projection over T matrices).
    # Keeping them made the op hold 73 fp32 values per token until the backward instead of 25.
    ctx.save_for_backward(x, phi, a_pre, a_post, a_res, bias, y_raw, r)
    ctx.cfg = (n_iters, variant, eps, prec, sm, mix, fused)


def _pre_backward(ctx, du, dh_pre, dh_post, dh_res, dsink, *_):
    grads = _pre_bwd(ctx, du, dh_pre, dh_post, dh_res, dsink, *ctx.saved_tensors, *ctx.cfg)
    return (*grads, None, None, None, None, None, None, None, None)


def _pre_bwd_impl(
    du: Tensor,
    dh_pre: Tensor,
    dh_post: Tensor,
    dh_res: Tensor,
    dsink: Tensor,
    x: Tensor,
    phi: Tensor,
    a_pre: Tensor,
    a_post: Tensor,
    a_res: Tensor,
    bias: Tensor,
    y_raw: Tensor,
    r: Tensor,
    n_iters: int,
    variant: str,
    eps: float,
    prec: str,
    softmax_pre: bool,
    mix: bool,
    fused: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    T, n, C = x.shape
    Kd = n * C
    NS, N, NP = _meta(n)
    dev = x.device
    # the dX kernels read φ with row stride N (the forward GEMM takes any strides)
    phi = phi.contiguous()
    col = torch.arange(N, device=dev)
    alpha = torch.where(
        col < n, a_pre.float(), torch.where(col < 2 * n, a_post.float(), a_res.float())
    )
    inv_r = 1.0 / r[:, None]
    # the forward's pre-activations z = alpha·y/r + b, in its order of operations
    z = alpha * y_raw / r[:, None] + bias.float()
    z_pre = z[:, :n]
    h_pre = torch.softmax(z_pre, 1) if softmax_pre else torch.sigmoid(z_pre)
    h_post = 2.0 * torch.sigmoid(z[:, n : 2 * n])
    res_logits = z[:, 2 * n :].reshape(T, n, n).contiguous()
    coef = torch.cat([h_pre, h_post], 1)
    d_pre = dh_pre.float()
    if mix:
        du = du.contiguous()
        dsink = dsink.contiguous()
        BC = min(1024, next_pow2(C))
        d_mix = _f32(x, (T, n))
        K._hc_premix_bwd_kernel[(T,)](du, x, d_mix, n, C, NS=NS, BC=BC, **FP_FUSION)
        d_pre = d_pre + d_mix
    # Coefficient backward: (T, N) sized, plain torch plus the projection backward.
    dz = torch.zeros((T, NP), device=dev, dtype=torch.float32)
    if softmax_pre:
        dz[:, :n] = h_pre * (d_pre - (d_pre * h_pre).sum(1, keepdim=True))
    else:
        dz[:, :n] = d_pre * h_pre * (1.0 - h_pre)
    dz[:, n : 2 * n] = dh_post.float() * h_post * (1.0 - 0.5 * h_post)
    g = _SK.sk_backward_triton(res_logits, dh_res.float().contiguous(), n_iters, variant, eps)
    dz[:, 2 * n : N] = g.reshape(T, n * n)
    dzn = dz[:, :N]
    dzy = dzn * y_raw * inv_r  # ∂L/∂alpha per entry
    d_a_pre = dzy[:, :n].sum().reshape(1)
    d_a_post = dzy[:, n : 2 * n].sum().reshape(1)
    d_a_res = dzy[:, 2 * n : N].sum().reshape(1)
    d_bias = dzn.sum(0)
    # the dX and dφ kernels read dy with row stride NP (zero beyond N)
    dy = torch.zeros((T, NP), device=dev, dtype=torch.float32)
    dy[:, :N] = dzn * alpha * inv_r
    # z = alpha·y/r + b and r = sqrt(Σx²/K + rms_eps): ∂L/∂x += ρ·x, ρ = ∂L/∂r / (K r).
    dr = -(dzn * alpha * y_raw).sum(1) * inv_r[:, 0] ** 2
    rcoef = (dr / (Kd * r)).contiguous()
    dx = torch.empty_like(x)
    if fused or not mix:
        # dsink is dX_next here (see _post_backward); H_resᵀ is applied in the dX pass.
        h_res = _SK.sk_forward_triton(res_logits, n_iters, variant, eps)
        ieee = prec == "ieee"
        BM, BCX, warps = DX_CFG_IEEE if ieee else DX_CFG
        n_mb = cdiv(T, BM)
        for m_base in range(0, n_mb, MAX_GRID_Y):
            K._hc_dx_kernel[(cdiv(C, BCX), min(MAX_GRID_Y, n_mb - m_base))](
                x, dsink, du, coef, h_res, dy, rcoef, phi, dx, T, Kd, N, n, C, m_base,
                BM=BM, BC=BCX, NS=NS, NP=NP, PREC=prec, HAS_DOUT=mix, HAS_DU=mix,
                num_warps=warps, **FP_FUSION,
            )  # fmt: skip
        BMP, BKP, warps, per_sm = DPHI_CFG
        k_progs = cdiv(Kd, BKP)
        n_fill = cdiv(per_sm * _num_sms(dev), k_progs)
        n_tsplit = max(1, min(cdiv(T, BMP), n_fill))
        dphi_part = _f32(x, (n_tsplit, Kd, NP))
        K._hc_dphi_kernel[(k_progs, n_tsplit)](
            x, dy, dphi_part, T, Kd, n_tsplit, BM=BMP, BK=BKP, NP=NP, PREC=prec,
            num_warps=warps, **FP_FUSION,
        )  # fmt: skip
    else:
        # unfused schedule: dsink is dX_res = H_resᵀ·dX_next, written by the residual backward
        BM, BK = 32, 64
        k_progs = cdiv(Kd, BK)
        n_tsplit = max(1, min(cdiv(T, BM), cdiv(2 * _num_sms(dev), k_progs)))
        dphi_part = _f32(x, (n_tsplit, Kd, NP))
        K._hc_input_bwd_kernel[(cdiv(Kd, BK), n_tsplit)](
            x, dsink, du, coef, dy, rcoef, phi, dx, dphi_part, T, Kd, N, n, C, n_tsplit,
            BM=BM, BK=BK, NP=NP, PREC=prec, num_warps=4, **FP_FUSION,
        )  # fmt: skip
    # contiguous: the fake (and the autograd contract) promise φ's layout, not a column slice
    dphi = dphi_part.sum(0)[:, :N].to(phi.dtype).contiguous()
    return (
        dx,
        dphi,
        d_a_pre.to(a_pre.dtype),
        d_a_post.to(a_post.dtype),
        d_a_res.to(a_res.dtype),
        d_bias.to(phi.dtype),
    )


def _pre_bwd_fake(du, dh_pre, dh_post, dh_res, dsink, x, phi, a_pre, a_post, a_res, *_):
    return (
        torch.empty_like(x), phi.new_empty(phi.shape), torch.empty_like(a_pre),
        torch.empty_like(a_post), torch.empty_like(a_res), phi.new_empty((phi.shape[1],)),
    )  # fmt: skip


_pre_bwd_op, _pre_bwd = _backward_op("mhc_pre_backward", _pre_bwd_impl, _pre_bwd_fake)


pre_op, pre = _dual("mhc_pre", _pre_impl, _pre_fake, _pre_setup, _pre_backward, (5, 6))


# ---------------------------------------------------------------------------------------------
# mhc_post: residual update X_next = H_res·X + H_postᵀ·F
# ---------------------------------------------------------------------------------------------


def _post_coef(h_post: Tensor) -> Tensor:
    """(T, 2n) buffer with H_post in the second half (the layout the kernels read)."""
    T, n = h_post.shape
    coef = torch.zeros((T, 2 * n), device=h_post.device, dtype=torch.float32)
    coef[:, n:] = h_post
    return coef


def _post_impl(
    x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, sink: Tensor, fused: bool
) -> Tensor:
    T, n, C = x.shape
    NS, _, _ = _meta(n)
    f = f.contiguous()
    out = torch.empty_like(x)
    BC = min(512, next_pow2(C))
    K._hc_residual_kernel[(T, cdiv(C, BC))](
        x, f, _post_coef(h_post), h_res.contiguous(), out, n, C, NS=NS, BC=BC, **FP_FUSION
    )
    return out


def _post_fake(x, f, h_post, h_res, sink, fused):
    return torch.empty_like(x)


def _post_setup(ctx, inputs, output):
    x, f, h_post, h_res, sink, fused = inputs
    # The fused schedule applies H_resᵀ in the sink producer's dX pass (mhc_pre recomputes
    # H_res there, mhc_mix keeps it): this op's backward then needs no H_res.
    ctx.save_for_backward(x, f, h_post, *(() if fused else (h_res,)))
    ctx.fused = fused


def _post_backward(ctx, dout):
    x, f, h_post, *h_res = ctx.saved_tensors
    # with the fused schedule the kernel does not read H_res: any valid pointer will do
    h_res = h_res[0] if h_res else h_post
    dx_res, df, dpost, dhres = _post_bwd(ctx, dout, x, f, h_post, h_res, ctx.fused, True)
    # The gradient of X goes to the sink: dX_next itself (the sink's producer applies H_resᵀ
    # in its dX pass) or dX_res = H_resᵀ·dX_next (unfused schedule); X gets none from here.
    return None, df, dpost, dhres, dout if ctx.fused else dx_res, None


def _post_bwd_impl(
    dout: Tensor, x: Tensor, f: Tensor, h_post: Tensor, h_res: Tensor, fused: bool, mix: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    T, n, C = dout.shape
    NS, _, _ = _meta(n)
    dout = dout.contiguous()
    # the saved F is the op's input as given; the kernel reads it (and writes dF) row-major
    f = f.contiguous()
    write_dx = mix and not fused
    dx = torch.empty_like(dout) if write_dx else dout.new_empty((0, n, C))
    df = torch.empty_like(f)
    dpost = _f32(dout, (T, n))
    dhres = _f32(dout, (T, n, n) if mix else (0, n, n))
    BC = min(512, next_pow2(C))
    K._hc_residual_bwd_kernel[(T,)](
        dout, x, f, _post_coef(h_post), h_res.contiguous(), dx if write_dx else dout, df,
        dpost, dhres, n, C, NS=NS, BC=BC, WRITE_DX=write_dx, MIX=mix, **FP_FUSION,
    )  # fmt: skip
    return dx, df, dpost, dhres


def _post_bwd_fake(dout, x, f, h_post, h_res, fused, mix):
    T, n, C = dout.shape
    dx = torch.empty_like(dout) if mix and not fused else dout.new_empty((0, n, C))
    return dx, f.new_empty(f.shape), _f32(dout, (T, n)), _f32(dout, (T, n, n) if mix else (0, n, n))


_post_bwd_op, _post_bwd = _backward_op("mhc_post_backward", _post_bwd_impl, _post_bwd_fake)


post_op, post = _dual("mhc_post", _post_impl, _post_fake, _post_setup, _post_backward)


# ---------------------------------------------------------------------------------------------
# mhc_add_residual: R + H_postᵀ·F (R already mixed)
# ---------------------------------------------------------------------------------------------


def _add_impl(r: Tensor, f: Tensor, h_post: Tensor) -> Tensor:
    T, n, C = r.shape
    NS, _, _ = _meta(n)
    out = torch.empty_like(r)
    BC = min(512, next_pow2(C))
    K._hc_residual_kernel[(T, cdiv(C, BC))](
        r, f.contiguous(), _post_coef(h_post), r, out, n, C, NS=NS, BC=BC, MIX=False, **FP_FUSION
    )
    return out


def _add_fake(r, f, h_post):
    return torch.empty_like(r)


def _add_setup(ctx, inputs, output):
    r, f, h_post = inputs
    ctx.save_for_backward(f, h_post)


def _add_backward(ctx, dout):
    f, h_post = ctx.saved_tensors
    # dR = dX_next as it is; x and h_res of the kernel are unused without the mix
    _, df, dpost, _ = _post_bwd(ctx, dout, dout, f, h_post, h_post, True, False)
    return dout, df, dpost.to(h_post.dtype)


add_op, add_residual = _dual("mhc_add_residual", _add_impl, _add_fake, _add_setup, _add_backward)


# ---------------------------------------------------------------------------------------------
# mhc_mix: u = Σ_i H_pre[i]·X[i] and R = H_res·X (or a sink for mhc_post)
# ---------------------------------------------------------------------------------------------


def _mix_impl(x: Tensor, h_pre: Tensor, h_res: Tensor, write_r: bool) -> tuple[Tensor, Tensor]:
    T, n, C = x.shape
    NS, _, _ = _meta(n)
    h_pre = h_pre.contiguous()
    h_res = h_res.contiguous()
    u = torch.empty((T, C), device=x.device, dtype=x.dtype)
    r = torch.empty_like(x) if write_r else _sink(x)
    BC = min(512, next_pow2(C))
    K._hc_stream_mix_kernel[(T, cdiv(C, BC))](
        x, h_pre, n, h_res, u, r, n, C, NS=NS, BC=BC, WRITE_R=write_r, **FP_FUSION
    )
    return u, r


def _mix_fake(x, h_pre, h_res, write_r):
    T, n, C = x.shape
    return x.new_empty((T, C)), torch.empty_like(x) if write_r else _sink(x)


def _mix_setup(ctx, inputs, output):
    x, h_pre, h_res, write_r = inputs
    ctx.save_for_backward(x, h_pre, h_res)
    ctx.write_r = write_r


def _mix_backward(ctx, du, dr):
    x, h_pre, h_res = ctx.saved_tensors
    dx, dpre, dhres = _mix_bwd(ctx, du, dr, x, h_pre, h_res, ctx.write_r)
    # without write_r the second output is the sink of mhc_post, whose backward computes dH_res
    return dx, dpre, dhres if ctx.write_r else None, None


def _mix_bwd_impl(
    du: Tensor, dr: Tensor, x: Tensor, h_pre: Tensor, h_res: Tensor, write_r: bool
) -> tuple[Tensor, Tensor, Tensor]:
    T, n, C = x.shape
    NS, _, _ = _meta(n)
    dx = torch.empty_like(x)
    dpre = _f32(x, (T, n))
    dhres = _f32(x, (T, n, n) if write_r else (0, n, n))
    BC = min(512, next_pow2(C))
    K._hc_stream_mix_bwd_kernel[(T,)](
        du.contiguous(), dr.contiguous(), x, h_pre.contiguous(), n, h_res.contiguous(), dx, dpre,
        dhres, n, C, NS=NS, BC=BC, HAS_DU=True, HAS_DR=True, DHRES=write_r, **FP_FUSION,
    )  # fmt: skip
    return dx, dpre.to(h_pre.dtype), dhres.to(h_res.dtype)


def _mix_bwd_fake(du, dr, x, h_pre, h_res, write_r):
    T, n, C = x.shape
    return (
        torch.empty_like(x),
        torch.empty_like(h_pre),
        h_res.new_empty((T, n, n) if write_r else (0, n, n)),
    )


_mix_bwd_op, _mix_bwd = _backward_op("mhc_mix_backward", _mix_bwd_impl, _mix_bwd_fake)


mix_op, mix = _dual("mhc_mix", _mix_impl, _mix_fake, _mix_setup, _mix_backward)
