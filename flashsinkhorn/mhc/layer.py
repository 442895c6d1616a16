"""Manifold-constrained hyper-connection layer with fused Triton kernels.

Math and conventions: :class:`.reference.HyperConnectionReference` and docs/mhc.md. In short,
for each token X ∈ R^{n×C}: coefficients from x·φ and the RMS of x, branch input
u = Σ_i H_pre[i]·X[i], and X_next = H_res·X + H_postᵀ·F with X_next[i] = Σ_j H_res[i, j]·X[j]
(row i of H_res says how output stream i reads the input streams; DeepSeek's code applies the
transpose).

The Triton path is two autograd Functions. ``_HCPre`` maps (X, φ, alphas, bias) to
(u, H_post, H_res) and also returns X itself so that ``_HCPost`` (the residual update) takes
its X through ``_HCPre``: the gradient that the residual update sends to X then arrives in
``_HCPre.backward``, which folds it into the kernel that writes dX (no separate accumulation
pass over an (T, n, C) tensor). With ``TUNING.mhc_fused_dx`` (default) what travels along that
edge is dX_next itself, not H_resᵀ·dX_next: ``_HCPre.backward`` applies H_resᵀ inside the dX
kernel, so the X alias must have no other consumer (it is internal to
``HyperConnection.forward``).

Implementation switches (:mod:`flashsinkhorn.tuning`, read when a forward runs):

* ``TUNING.mhc_fused_dx``, the backward schedule. True: the residual update's backward hands
  dX_next itself on as the gradient of the X alias, and ``_hc_dx_kernel`` applies H_resᵀ while
  it writes dX (dX_res never goes through HBM); dφ = xᵀ·dh is a separate pass over X
  (``_hc_dphi_kernel``). False: the residual backward writes dX_res = H_resᵀ·dX_next and one
  K-major pass reads it back and computes dX and dφ together (``_hc_input_bwd_kernel``). The
  layer's forward reads it once for both Functions and saves it on their autograd contexts, so
  a change between forward and backward (or inside the branch) does not mix the schedules.
* ``TUNING.mhc_gemm_phi_t``: the forward GEMM reads a K-major (NP, K) copy of φ (tf32 wgmma
  takes it from shared memory without a transpose); False reads φ itself. Only for tf32: with
  the ieee (CUDA-core) dot the copy doubled the forward on the H200 (3.3 → 6.8 ms).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from .._triton_launch import FP_FUSION, cdiv, cuda_sm_count, next_pow2
from .._validation import check_choice
from ..tuning import TUNING
from .reference import (
    HyperConnectionReference,
    branch_output,
    check_layer_args,
    check_layer_input,
)
from .sinkhorn import BACKENDS, check_triton_device, sinkhorn_knopp


class _OnFirstUse:
    """A module of Triton kernels, imported when first used: the torch path of the layer (and
    a machine without Triton) never imports Triton."""

    def __init__(self, name: str):
        self._name, self._module = name, None

    def __getattr__(self, attr: str):
        if self._module is None:
            self._module = importlib.import_module(self._name, __package__)
        return getattr(self._module, attr)


K = _OnFirstUse(".layer_kernels")
_SK = _OnFirstUse(".sk_triton")


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_HAS_TRITON = _has_triton()

__all__ = ["HyperConnection"]

# (token block, channel block, warps) of _hc_dx_kernel; (token block, K block, warps, programs
# per SM) of _hc_dphi_kernel. The dX pass with the ieee dot (Triton's CUDA-core dot) wants
# larger tiles: (16, 32, 2) takes it from 8.9 to 67 ms on the H200.
DX_CFG = (16, 32, 2)
DX_CFG_IEEE = (32, 32, 4)
DPHI_CFG = (32, 128, 4, 2)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return cuda_sm_count(device)


def _meta(n: int, C: int):
    NS = max(2, next_pow2(n))
    N = n * n + 2 * n
    NP = max(16, next_pow2(N))
    return NS, N, NP


class _HCPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, phi, a_pre, a_post, a_res, bias, cfg, fused):
        n_iters, variant, eps, rms_eps, prec = cfg
        T, n, C = x.shape
        Kd = n * C
        NS, N, NP = _meta(n, C)
        dev = x.device
        BM, BK = 64, 64
        n_mb = cdiv(T, BM)
        k_tiles = cdiv(Kd, BK)
        # Split K only as much as needed to fill the GPU (about two programs per SM).
        n_split = max(1, min(k_tiles // 4, cdiv(2 * _num_sms(dev), n_mb)))
        k_split = cdiv(k_tiles, n_split) * BK
        n_split = cdiv(Kd, k_split)
        y_part = torch.empty((n_split, T, NP), device=dev, dtype=torch.float32)
        ss_part = torch.empty((n_split, T), device=dev, dtype=torch.float32)
        if TUNING.mhc_gemm_phi_t and prec != "ieee":
            w = torch.zeros((NP, Kd), device=dev, dtype=phi.dtype)
            w[:N] = phi.t()
            s_wk, s_wn = 1, Kd
        else:
            w, (s_wk, s_wn) = phi, phi.stride()
        K._hc_gemm_rms_kernel[(n_mb, n_split)](
            x,
            w,
            y_part,
            ss_part,
            T,
            Kd,
            N,
            k_split,
            s_wk,
            s_wn,
            BM=BM,
            BK=BK,
            NP=NP,
            PREC=prec,
            num_warps=4,
            **FP_FUSION,
        )
        y_raw = torch.empty((T, NP), device=dev, dtype=torch.float32)
        r = torch.empty((T,), device=dev, dtype=torch.float32)
        coef = torch.empty((T, 2 * n), device=dev, dtype=torch.float32)
        res_logits = torch.empty((T, n, n), device=dev, dtype=torch.float32)
        BMF = 32
        K._hc_finalize_kernel[(cdiv(T, BMF),)](
            y_part,
            ss_part,
            a_pre,
            a_post,
            a_res,
            bias,
            y_raw,
            r,
            coef,
            res_logits,
            T,
            Kd,
            N,
            n,
            n_split,
            rms_eps,
            BM=BMF,
            NP=NP,
            num_warps=4,
            **FP_FUSION,
        )
        h_res = _SK.sk_forward_triton(res_logits, n_iters, variant, eps)
        u = torch.empty((T, C), device=dev, dtype=x.dtype)
        BC = min(1024, next_pow2(C))
        K._hc_premix_kernel[(T, cdiv(C, BC))](x, coef, u, n, C, NS=NS, BC=BC, **FP_FUSION)
        ctx.save_for_backward(x, phi, a_pre, a_post, a_res, y_raw, r, coef, res_logits, h_res)
        ctx.cfg = cfg
        ctx.fused = fused
        h_post = coef[:, n:]
        return u, h_post, h_res, x.view_as(x)

    @staticmethod
    def backward(ctx, du, dh_post, dh_res, dx_res):
        x, phi, a_pre, a_post, a_res, y_raw, r, coef, res_logits, h_res = ctx.saved_tensors
        n_iters, variant, eps, rms_eps, prec = ctx.cfg
        T, n, C = x.shape
        Kd = n * C
        NS, N, NP = _meta(n, C)
        dev = x.device
        du = torch.zeros((T, C), device=dev, dtype=x.dtype) if du is None else du.contiguous()
        if dx_res is None:
            dx_res = torch.zeros_like(x)
        dx_res = dx_res.contiguous()
        BC = min(1024, next_pow2(C))
        d_pre = torch.empty((T, n), device=dev, dtype=torch.float32)
        K._hc_premix_bwd_kernel[(T,)](du, x, d_pre, n, C, NS=NS, BC=BC, **FP_FUSION)
        # Coefficient backward: (T, N) sized, plain torch plus the projection backward.
        h_pre, h_post = coef[:, :n], coef[:, n:]
        dz = torch.zeros((T, NP), device=dev, dtype=torch.float32)
        dz[:, :n] = d_pre * h_pre * (1.0 - h_pre)
        if dh_post is not None:
            dz[:, n : 2 * n] = dh_post.float() * h_post * (1.0 - 0.5 * h_post)
        if dh_res is not None:
            g = _SK.sk_backward_triton(
                res_logits, dh_res.float().contiguous(), n_iters, variant, eps
            )
            dz[:, 2 * n : N] = g.reshape(T, n * n)
        col = torch.arange(NP, device=dev)
        alpha = torch.where(
            col < n, a_pre.float(), torch.where(col < 2 * n, a_post.float(), a_res.float())
        )
        alpha = torch.where(col < N, alpha, torch.zeros_like(alpha))
        inv_r = 1.0 / r[:, None]
        dzy = dz * y_raw * inv_r  # ∂L/∂alpha per entry
        d_a_pre = dzy[:, :n].sum().reshape(1)
        d_a_post = dzy[:, n : 2 * n].sum().reshape(1)
        d_a_res = dzy[:, 2 * n : N].sum().reshape(1)
        d_bias = dz[:, :N].sum(0)
        dy = (dz * alpha * inv_r).contiguous()
        # z = alpha·y/r + b and r = sqrt(Σx²/K + rms_eps): ∂L/∂x += ρ·x, ρ = ∂L/∂r / (K r).
        dr = -(dz * alpha * y_raw).sum(1) * inv_r[:, 0] ** 2
        rcoef = (dr / (Kd * r)).contiguous()
        dx = torch.empty_like(x)
        if ctx.fused:
            # dx_res is dX_next here (see _HCPost.backward).
            ieee = prec == "ieee"
            BM, BCX, warps = DX_CFG_IEEE if ieee else DX_CFG
            K._hc_dx_kernel[(cdiv(C, BCX), cdiv(T, BM))](
                x,
                dx_res,
                du,
                coef,
                h_res,
                dy,
                rcoef,
                phi,
                dx,
                T,
                Kd,
                N,
                n,
                C,
                BM=BM,
                BC=BCX,
                NS=NS,
                NP=NP,
                PREC=prec,
                num_warps=warps,
                **FP_FUSION,
            )
            BMP, BKP, warps, per_sm = DPHI_CFG
            k_progs = cdiv(Kd, BKP)
            n_fill = cdiv(per_sm * _num_sms(dev), k_progs)
            n_tsplit = max(1, min(cdiv(T, BMP), n_fill))
            dphi_part = torch.empty((n_tsplit, Kd, NP), device=dev, dtype=torch.float32)
            K._hc_dphi_kernel[(k_progs, n_tsplit)](
                x,
                dy,
                dphi_part,
                T,
                Kd,
                n_tsplit,
                BM=BMP,
                BK=BKP,
                NP=NP,
                PREC=prec,
                num_warps=warps,
                **FP_FUSION,
            )
        else:
            BM, BK = 32, 64
            k_progs = cdiv(Kd, BK)
            n_tsplit = max(1, min(cdiv(T, BM), cdiv(2 * _num_sms(dev), k_progs)))
            dphi_part = torch.empty((n_tsplit, Kd, NP), device=dev, dtype=torch.float32)
            K._hc_input_bwd_kernel[(cdiv(Kd, BK), n_tsplit)](
                x,
                dx_res,
                du,
                coef,
                dy,
                rcoef,
                phi,
                dx,
                dphi_part,
                T,
                Kd,
                N,
                n,
                C,
                n_tsplit,
                BM=BM,
                BK=BK,
                NP=NP,
                PREC=prec,
                num_warps=4,
                **FP_FUSION,
            )
        dphi = dphi_part.sum(0)[:, :N].to(phi.dtype)
        return (
            dx,
            dphi,
            d_a_pre.to(a_pre.dtype),
            d_a_post.to(a_post.dtype),
            d_a_res.to(a_res.dtype),
            d_bias.to(phi.dtype),
            None,
            None,
        )


class _HCPost(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, f, h_post, h_res, fused):
        T, n, C = x.shape
        NS, _, _ = _meta(n, C)
        f = f.contiguous()
        coef = _post_coef(h_post)
        out = torch.empty_like(x)
        BC = min(512, next_pow2(C))
        K._hc_residual_kernel[(T, cdiv(C, BC))](
            x, f, coef, h_res, out, n, C, NS=NS, BC=BC, **FP_FUSION
        )
        ctx.save_for_backward(x, f, coef, h_res)
        ctx.fused = fused
        return out

    @staticmethod
    def backward(ctx, dout):
        x, f, coef, h_res = ctx.saved_tensors
        T, n, C = x.shape
        NS, _, _ = _meta(n, C)
        dout = dout.contiguous()
        # fused: X's gradient is handed on as dX_next itself; _HCPre.backward applies H_resᵀ.
        dx = dout if ctx.fused else torch.empty_like(x)
        df = torch.empty_like(f)
        dpost = torch.empty((T, n), device=x.device, dtype=torch.float32)
        dhres = torch.empty((T, n, n), device=x.device, dtype=torch.float32)
        BC = min(512, next_pow2(C))
        K._hc_residual_bwd_kernel[(T,)](
            dout,
            x,
            f,
            coef,
            h_res,
            dx,
            df,
            dpost,
            dhres,
            n,
            C,
            NS=NS,
            BC=BC,
            WRITE_DX=not ctx.fused,
            **FP_FUSION,
        )
        return dx, df, dpost, dhres, None


def _post_coef(h_post: torch.Tensor) -> torch.Tensor:
    """(T, 2n) buffer with H_post in the second half (the layout the kernels read)."""
    T, n = h_post.shape
    coef = torch.zeros((T, 2 * n), device=h_post.device, dtype=torch.float32)
    coef[:, n:] = h_post
    return coef


class HyperConnection(HyperConnectionReference):
    """Manifold-constrained hyper-connection (mHC) around one sub-layer, with fused kernels.

    Args:
        dim: channels C of each residual stream.
        n_streams: number of streams n (Triton path: any n with n² + 2n ≤ 64, i.e. n ≤ 7; the
            projection itself allows n ≤ 32).
        n_iters: Sinkhorn rounds for H_res.
        variant: projection convention, ``"log"`` or ``"deepseek"`` (see ``sinkhorn_knopp``).
        eps: the ``"deepseek"`` additive constant.
        rms_eps: added to mean(x²) before the square root.
        alpha_init: initial value of the three scalar gains.
        gemm_precision: ``"tf32"`` (default, tensor cores) or ``"ieee"`` for x·φ and its
            backward on the Triton path.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.

    Call ``layer(X, branch)`` with X of shape (..., n, C) and ``branch`` a callable
    (..., C) → (..., C); returns X_next of shape (..., n, C).
    """

    def __init__(
        self,
        dim: int,
        n_streams: int = 4,
        n_iters: int = 20,
        variant: str = "log",
        eps: float = 1e-6,
        rms_eps: float = 1e-6,
        alpha_init: float = 0.01,
        gemm_precision: str = "tf32",
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        dim, n_streams, n_iters, eps, rms_eps, alpha_init = check_layer_args(
            dim, n_streams, n_iters, variant, eps, rms_eps, alpha_init, dtype
        )
        check_choice("gemm_precision", gemm_precision, ("tf32", "ieee"))
        check_choice("backend", backend, BACKENDS)
        if backend == "triton" and n_streams * n_streams + 2 * n_streams > 64:
            raise ValueError(f"backend='triton' supports n_streams <= 7, got {n_streams}")
        super().__init__(dim, n_streams, n_iters, variant, eps, rms_eps, alpha_init, device, dtype)
        self.gemm_precision = gemm_precision
        self.backend = backend

    def _use_triton(self, x: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        if self.backend == "triton":
            return True
        n = self.n_streams
        return (
            x.is_cuda
            and _HAS_TRITON
            and n * n + 2 * n <= 64
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        )

    def forward(self, x: torch.Tensor, branch=None) -> torch.Tensor:
        """See the class docstring. x: (..., n, C); returns (..., n, C)."""
        n, C = self.n_streams, self.dim
        check_layer_input(x, n, C, self.phi)
        if self.backend == "triton":
            if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise TypeError(
                    f"backend='triton' supports x of dtype float16, bfloat16 or float32; got "
                    f"{x.dtype}. Use backend='torch' for float64."
                )
            check_triton_device("x", x)
        if not self._use_triton(x):
            return self._forward_torch(x, branch)
        lead = x.shape[:-2]
        x3 = x.reshape(-1, n, C).contiguous()
        variant, eps = self.variant, self.eps
        if variant == "deepseek" and eps == 0.0:
            variant = "log"
        cfg = (self.n_iters, variant, float(eps), float(self.rms_eps), self.gemm_precision)
        # read once: both Functions must use the same backward schedule even if the branch
        # changes the switch
        fused = bool(TUNING.mhc_fused_dx)
        u, h_post, h_res, x_alias = _HCPre.apply(
            x3, self.phi, self.alpha_pre, self.alpha_post, self.alpha_res, self.bias, cfg, fused
        )
        f = branch_output(branch, u, lead, C)
        out = _HCPost.apply(x_alias, f.to(x.dtype), h_post, h_res, fused)
        return out.view(*lead, n, C)

    def _forward_torch(self, x: torch.Tensor, branch) -> torch.Tensor:
        lead = x.shape[:-2]
        n, C = self.n_streams, self.dim
        xt = x.reshape(-1, n, C)
        flat = xt.reshape(xt.shape[0], -1).to(self.phi.dtype)
        r = torch.sqrt(flat.square().mean(-1, keepdim=True) + self.rms_eps)
        h = flat @ self.phi
        pre = torch.sigmoid(self.alpha_pre * h[:, :n] / r + self.bias[:n])
        post = 2 * torch.sigmoid(self.alpha_post * h[:, n : 2 * n] / r + self.bias[n : 2 * n])
        res = self.alpha_res * h[:, 2 * n :] / r + self.bias[2 * n :]
        # The logits come from x and the parameters: the layer never synchronises to check them.
        res = sinkhorn_knopp(
            res.view(-1, n, n), self.n_iters, variant=self.variant, eps=self.eps, backend="torch",
            check_finite=False,
        )  # fmt: skip
        u = torch.einsum("ti,tic->tc", pre.to(x.dtype), xt)
        f = branch_output(branch, u, lead, C)
        out = torch.einsum("tij,tjc->tic", res.to(x.dtype), xt)
        out = out + post.to(x.dtype)[..., None] * f[:, None, :].to(x.dtype)
        return out.view(*lead, n, C)
