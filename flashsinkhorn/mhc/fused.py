"""The hyper-connection's three steps as public functions, on the layer's kernels.

``fused_dynamic_weights`` (coefficients from the streams), ``fused_stream_mix`` (branch input
and mixed residual from one read of the streams) and ``fused_add_residual`` (the branch output
added back) compose to the same result as :class:`.HyperConnection`; the layer itself fuses
the mix into the residual update instead (no (..., n, C) temporary), so use it when the three
steps need not be separate. Each function runs the Triton kernels (through the custom ops of
:mod:`.layer_ops`) for CUDA tensors of dtype float32/bfloat16/float16, and plain PyTorch
otherwise (``backend="torch"`` forces it, ``backend="triton"`` requires the kernels).
"""

from __future__ import annotations

import math

import torch

from .. import _validation as V
from . import layer_ops as L
from .layer import _HAS_TRITON, _KERNEL_DTYPES
from .reference import PRE_ACTIVATIONS, check_layer_args
from .sinkhorn import BACKENDS, check_triton_device, sinkhorn_knopp

__all__ = ["fused_add_residual", "fused_dynamic_weights", "fused_stream_mix"]

#: Most streams of the mixing kernels (they hold an (n, n, channel block) product in registers).
MAX_MIX_STREAMS = 8


def _tensor(name: str, v: object, dims: str) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or not v.is_floating_point():
        raise TypeError(
            f"{name} must be a floating torch.Tensor of shape {dims}, got {V.describe(v)}"
        )
    return v


def _streams(name: str, v: object) -> torch.Tensor:
    v = _tensor(name, v, "(..., n, C)")
    if v.dim() < 2:
        raise ValueError(f"{name} must have shape (..., n, C), got {tuple(v.shape)}")
    return v


def _shape(name: str, v: torch.Tensor, want: tuple, dims: str) -> None:
    if tuple(v.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {dims} = {tuple(want)}, got {tuple(v.shape)}")


def _same_device(ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.device != ref.device:
            raise ValueError(
                f"{name} must be on the device of the streams ({ref.device}), got {t.device}"
            )


def _use_triton(backend: str, name: str, x: torch.Tensor, n: int, max_n: int) -> bool:
    """Whether the kernels run on the streams ``x`` (the argument ``name``); ``max_n``: the
    most streams they take (the stream axis is a register tile dimension)."""
    V.check_choice("backend", backend, BACKENDS)
    if backend == "torch" or x.numel() == 0:
        return False
    if backend == "triton":
        if x.dtype not in _KERNEL_DTYPES:
            raise TypeError(
                f"backend='triton' supports streams of dtype float16, bfloat16 or float32; got "
                f"{x.dtype}. Use backend='torch' for float64."
            )
        if n > max_n:
            raise ValueError(
                f"backend='triton' supports at most {max_n} streams here, got n = {n}; use "
                "backend='auto' or 'torch'"
            )
        check_triton_device(name, x)
        return True
    return x.is_cuda and _HAS_TRITON and x.dtype in _KERNEL_DTYPES and n <= max_n


def fused_stream_mix(
    H: torch.Tensor, H_pre: torch.Tensor, H_res: torch.Tensor, *, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Branch input and mixed residual streams, from one read of the streams.

    Args:
        H: (..., n, C) residual streams.
        H_pre: (..., n) weights of the streams in the branch input.
        H_res: (..., n, n) mixing matrices (row i: how output stream i reads the inputs).
        backend: ``"auto"`` (default), ``"triton"`` or ``"torch"``.

    Returns:
        ``(branch_input, H_residual)``: u = Σ_i H_pre[i]·H[i] of shape (..., C) and
        H_residual = H_res·H of shape (..., n, C), both in H's dtype (float32 accumulation on
        the Triton path; under autocast the torch path returns the autocast dtype).
        Differentiable in all three inputs.

    Raises:
        TypeError: a non-floating or non-tensor argument; ``backend="triton"`` with float64.
        ValueError: mismatched shapes or devices; unknown backend; with ``backend="triton"``,
            more than 8 streams, or CPU tensors without the interpreter.
    """
    H = _streams("H", H)
    lead, (n, C) = H.shape[:-2], H.shape[-2:]
    H_pre = _tensor("H_pre", H_pre, "(..., n)")
    H_res = _tensor("H_res", H_res, "(..., n, n)")
    _shape("H_pre", H_pre, (*lead, n), "(..., n)")
    _shape("H_res", H_res, (*lead, n, n), "(..., n, n)")
    _same_device(H, H_pre=H_pre, H_res=H_res)
    if not _use_triton(backend, "H", H, n, MAX_MIX_STREAMS):
        u = torch.einsum("...i,...ic->...c", H_pre.to(H.dtype), H)
        return u, torch.einsum("...ij,...jc->...ic", H_res.to(H.dtype), H)
    x3 = H.reshape(-1, n, C).contiguous()
    u, r = L.mix(x3, H_pre.reshape(-1, n), H_res.reshape(-1, n, n), True)
    return u.view(*lead, C), r.view(*lead, n, C)


def fused_add_residual(
    H_residual: torch.Tensor,
    branch_output: torch.Tensor,
    H_post: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """H_new[i] = H_residual[i] + H_post[i]·F, one pass over the streams.

    Args:
        H_residual: (..., n, C) mixed residual streams (``fused_stream_mix``'s second output).
        branch_output: (..., C) the sub-layer's output F (any floating dtype; read as is).
        H_post: (..., n) weights with which F is added to each stream.
        backend: ``"auto"`` (default), ``"triton"`` or ``"torch"``.

    Returns:
        (..., n, C) next residual streams in H_residual's dtype (under autocast the torch
        path returns the autocast dtype). Differentiable in all inputs.

    Raises:
        TypeError / ValueError: as :func:`fused_stream_mix`.
    """
    R = _streams("H_residual", H_residual)
    lead, (n, C) = R.shape[:-2], R.shape[-2:]
    F = _tensor("branch_output", branch_output, "(..., C)")
    H_post = _tensor("H_post", H_post, "(..., n)")
    _shape("branch_output", F, (*lead, C), "(..., C)")
    _shape("H_post", H_post, (*lead, n), "(..., n)")
    _same_device(R, branch_output=F, H_post=H_post)
    if not _use_triton(backend, "H_residual", R, n, MAX_MIX_STREAMS):
        return R + H_post.to(R.dtype)[..., None] * F.to(R.dtype)[..., None, :]
    out = L.add_residual(R.reshape(-1, n, C).contiguous(), F.reshape(-1, C), H_post.reshape(-1, n))
    return out.view(*lead, n, C)


def fused_dynamic_weights(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha_pre: torch.Tensor,
    alpha_post: torch.Tensor,
    alpha_res: torch.Tensor,
    *,
    n_iters: int = 20,
    variant: str = "log",
    eps: float = 1e-6,
    rms_eps: float = 1e-6,
    pre_activation: str = "sigmoid",
    gemm_precision: str = "tf32",
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dynamic coefficients of every token: RMS-normalised x·φ, gains, bias, activations and
    the Sinkhorn–Knopp projection, fused (one pass over x on the Triton path).

    With h = x·φ and r = sqrt(mean(x²) + rms_eps) per token (x the token's n·C values):
    H_pre = σ(α_pre·h[:n]/r + b[:n]) (or softmax), H_post = 2σ(α_post·h[n:2n]/r + b[n:2n]),
    H_res = sinkhorn_knopp(α_res·h[2n:]/r + b[2n:]) as n×n matrices (the parameters of
    :class:`.HyperConnection`, which computes exactly these).

    Args:
        x: (..., n, C) residual streams.
        phi: (n·C, n² + 2n) projection (n is read from its width).
        bias: (n² + 2n,) bias.
        alpha_pre: gain of H_pre, a tensor of one element.
        alpha_post: gain of H_post, a tensor of one element.
        alpha_res: gain of H_res, a tensor of one element.
        n_iters: Sinkhorn rounds of the projection (default 20).
        variant: the projection's convention (default ``"log"``).
        eps: the ``"deepseek"`` variant's additive constant (default 1e-6).
        rms_eps: added to mean(x²) (default 1e-6).
        pre_activation: ``"sigmoid"`` (default) or ``"softmax"``.
        gemm_precision: ``"tf32"`` (default) or ``"ieee"`` on the Triton path.
        backend: ``"auto"`` (default), ``"triton"`` or ``"torch"``.

    Returns:
        ``(H_pre (..., n), H_post (..., n), H_res (..., n, n))``, float32 on the Triton path
        (the parameters' dtype on the torch path). Differentiable in x and every parameter.

    Raises:
        TypeError / ValueError: non-tensor or mismatched arguments (the message names the
            argument and the expected shape); the scalar arguments as in ``HyperConnection``;
            with ``backend="triton"``, more than 7 streams (``"auto"`` takes the torch path).
    """
    phi = _tensor("phi", phi, "(n·C, n² + 2n)")
    if phi.dim() != 2:
        raise ValueError(f"phi must have shape (n·C, n² + 2n), got {tuple(phi.shape)}")
    width = phi.shape[1]
    n = math.isqrt(width + 1) - 1
    if n < 1 or n * n + 2 * n != width or phi.shape[0] % n:
        raise ValueError(
            f"phi must have shape (n·C, n² + 2n) for some n >= 1 (width 3, 8, 15, 24, …); got "
            f"{tuple(phi.shape)}"
        )
    C = phi.shape[0] // n
    x = _tensor("x", x, f"(..., {n}, {C})")
    if x.dim() < 2 or tuple(x.shape[-2:]) != (n, C):
        raise ValueError(f"x must have shape (..., {n}, {C}) (from phi), got {tuple(x.shape)}")
    bias = _tensor("bias", bias, "(n² + 2n,)")
    _shape("bias", bias, (width,), "(n² + 2n,)")
    gains = {"alpha_pre": alpha_pre, "alpha_post": alpha_post, "alpha_res": alpha_res}
    for name, a in gains.items():
        if _tensor(name, a, "(1,)").numel() != 1:
            raise ValueError(f"{name} must have one element, got shape {tuple(a.shape)}")
    _same_device(x, phi=phi, bias=bias, **gains)
    _, _, n_iters, eps, rms_eps, _ = check_layer_args(
        C, n, n_iters, variant, eps, rms_eps, 0.0, None
    )
    V.check_choice("pre_activation", pre_activation, PRE_ACTIVATIONS)
    V.check_choice("gemm_precision", gemm_precision, ("tf32", "ieee"))
    lead = x.shape[:-2]
    a_pre, a_post, a_res = (a.reshape(1) for a in gains.values())
    if not _use_triton(backend, "x", x, n, 7):  # n² + 2n coefficients in a 64-wide tile
        flat = x.reshape(-1, n * C).to(phi.dtype)
        r = torch.sqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
        h = flat @ phi
        z_pre = a_pre * h[:, :n] / r + bias[:n]
        pre = torch.softmax(z_pre, -1) if pre_activation == "softmax" else torch.sigmoid(z_pre)
        post = 2 * torch.sigmoid(a_post * h[:, n : 2 * n] / r + bias[n : 2 * n])
        z_res = (a_res * h[:, 2 * n :] / r + bias[2 * n :]).view(-1, n, n)
        res = sinkhorn_knopp(z_res, n_iters, variant=variant, eps=eps, check_finite=False)
    else:
        if variant == "deepseek" and eps == 0.0:
            variant = "log"
        _, pre, post, res, *_ = L.pre(
            x.reshape(-1, n, C).contiguous(), phi, a_pre, a_post, a_res, bias, n_iters, variant,
            eps, rms_eps, gemm_precision, pre_activation == "softmax", False, True,
        )  # fmt: skip
    return pre.view(*lead, n), post.view(*lead, n), res.view(*lead, n, n)
