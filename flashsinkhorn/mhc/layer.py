"""Manifold-constrained hyper-connection layer with fused Triton kernels.

Math and conventions: :class:`.reference.HyperConnectionReference` and docs/mhc.md. In short,
for each token X ∈ R^{n×C}: coefficients from x·φ and the RMS of x, branch input
u = Σ_i H_pre[i]·X[i], and X_next = H_res·X + H_postᵀ·F with X_next[i] = Σ_j H_res[i, j]·X[j]
(row i of H_res says how output stream i reads the input streams; DeepSeek's code applies the
transpose).

The Triton path is two custom ops (:mod:`.layer_ops`) around the caller's branch:
``mhc_pre`` maps (X, φ, alphas, bias) to (u, H_pre, H_post, H_res) and a *sink*, and
``mhc_post`` (the residual update) takes the sink as an input. The sink carries no data; its
gradient is how the residual update's backward hands dX_next on to ``mhc_pre``'s backward, which
folds it into the one kernel that writes dX (no separate accumulation pass over a (T, n, C)
tensor). The static mode (``dynamic=False``) uses ``mhc_mix`` instead of ``mhc_pre`` in the same
way. The ops are what ``torch.compile`` sees: each is one opaque node with a fake
implementation, and its backward another.

Implementation switches (:mod:`flashsinkhorn.tuning`, read when a forward runs):

* ``TUNING.mhc_fused_dx``, the backward schedule. True: the residual update's backward hands
  dX_next itself to the sink, and ``_hc_dx_kernel`` applies H_resᵀ while it writes dX
  (dX_res never goes through HBM); dφ = xᵀ·dh is a separate pass over X (``_hc_dphi_kernel``).
  False: the residual backward writes dX_res = H_resᵀ·dX_next and one K-major pass reads it
  back and computes dX and dφ together (``_hc_input_bwd_kernel``). The layer reads the switch
  once per forward and passes it to both ops, so a change between forward and backward (or
  inside the branch) does not mix the schedules.
* ``TUNING.mhc_gemm_phi_t``: the forward GEMM reads a K-major (NP, K) copy of φ (tf32 wgmma
  takes it from shared memory without a transpose); False reads φ itself. Only for tf32: with
  the ieee (CUDA-core) dot the copy doubled the forward on the H200 (3.3 → 6.8 ms).

Autocast: with autocast on for X's device, a float32 X is cast to the autocast dtype (the layer
is matmul-like, as autocast would treat it); u and X_next come out in that dtype, the kernels
read 16-bit X and F as they are and accumulate in float32, and the coefficients, the projection
and the parameters stay in float32.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from .._validation import check_choice
from ..tuning import TUNING
from . import layer_ops as L
from .reference import (
    HyperConnectionReference,
    autocast_input,
    check_branch_output,
    check_layer_args,
    check_layer_input,
)
from .sinkhorn import BACKENDS, check_triton_device, sinkhorn_knopp

__all__ = ["HyperConnection", "SplitHyperConnection"]


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_HAS_TRITON = _has_triton()
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class HyperConnection(HyperConnectionReference):
    """Manifold-constrained hyper-connection (mHC) around one sub-layer, with fused kernels.

    Args:
        dim: channels C of each residual stream.
        n_streams: number of streams n (Triton path: any n with n² + 2n ≤ 64, i.e. n ≤ 7; the
            projection itself allows n ≤ 32). Default 4.
        n_iters: Sinkhorn rounds for H_res (default 20).
        variant: projection convention, ``"log"`` (default) or ``"deepseek"`` (see
            ``sinkhorn_knopp``).
        eps: the ``"deepseek"`` additive constant (default 1e-6).
        rms_eps: added to mean(x²) before the square root (default 1e-6).
        alpha_init: initial value of the three scalar gains (default 0.01).
        gemm_precision: ``"tf32"`` (default, tensor cores) or ``"ieee"`` for x·φ and its
            backward on the Triton path.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.
        device: of the parameters (default: torch's default device).
        dtype: of the parameters (default float32).
        dynamic: True (default): coefficients computed from each token (x·φ). False: static
            coefficients, learned per layer from the bias alone (no φ, no α parameters).
        pre_activation: ``"sigmoid"`` (default) or ``"softmax"`` (H_pre sums to 1 over the
            streams).
        layer_idx: None (default: H_pre starts at ½ on every stream, a uniform softmax) or the
            layer's index, in which case H_pre starts out favouring stream layer_idx mod n
            (see ``reset_parameters``).

    Call ``layer(X, branch)`` with X of shape (..., n, C) and ``branch`` a callable
    (..., C) → (..., C); returns X_next of shape (..., n, C). ``layer.split(X)`` returns the
    two halves instead (see :meth:`split`).
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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        dynamic: bool = True,
        pre_activation: str = "sigmoid",
        layer_idx: int | None = None,
    ) -> None:
        dim, n_streams, n_iters, eps, rms_eps, alpha_init = check_layer_args(
            dim, n_streams, n_iters, variant, eps, rms_eps, alpha_init, dtype, self._count_names
        )
        check_choice("gemm_precision", gemm_precision, ("tf32", "ieee"))
        check_choice("backend", backend, BACKENDS)
        if backend == "triton" and n_streams * n_streams + 2 * n_streams > 64:
            name = self._count_names[0]
            raise ValueError(f"backend='triton' supports {name} <= 7, got {n_streams}")
        super().__init__(
            dim, n_streams, n_iters, variant, eps, rms_eps, alpha_init, device, dtype,
            dynamic=dynamic, pre_activation=pre_activation, layer_idx=layer_idx,
        )  # fmt: skip
        self.gemm_precision = gemm_precision
        self.backend = backend

    def _use_triton(self, x: torch.Tensor) -> bool:
        if self.backend == "torch" or x.numel() == 0:
            return False
        if self.backend == "triton":
            return True
        n = self.n_streams
        return x.is_cuda and _HAS_TRITON and n * n + 2 * n <= 64 and x.dtype in _KERNEL_DTYPES

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, Callable, torch.Tensor]:
        """The layer in two halves, around a sub-layer that the caller runs.

        ``u, add_residual, h_res = layer.split(X)``, then ``X_next = add_residual(F)`` with
        F = sub_layer(u), is the same computation as ``layer(X, sub_layer)``.

        Args:
            x: (..., n, C) residual streams H.

        Returns:
            tuple: ``(branch_input, add_residual, h_res)``: the branch input u (..., C) in
                X's dtype (the autocast dtype under autocast); a function
                ``add_residual(branch_output)`` that takes F (..., C) and returns the next
                residual streams (..., n, C) (it may be called more than once); and the mixing
                matrices H_res (..., n, n) (float32 on the Triton path, differentiable).

        Raises:
            TypeError: X not a floating tensor; with ``backend="triton"``, X of another dtype
                than float32/bfloat16/float16; F not a floating tensor.
            ValueError: X not (..., n, C) or not on the parameters' device; Triton on CPU
                tensors without the interpreter; F not of u's shape.
        """
        n, C = self.n_streams, self.dim
        check_layer_input(x, n, C, self.bias)
        if self.backend == "triton":
            if x.dtype not in _KERNEL_DTYPES:
                raise TypeError(
                    f"backend='triton' supports x of dtype float16, bfloat16 or float32; got "
                    f"{x.dtype}. Use backend='torch' for float64."
                )
            check_triton_device("x", x)
        if not self._use_triton(x):
            return super().split(x)
        x = autocast_input(x)
        lead = x.shape[:-2]
        x3 = x.reshape(-1, n, C).contiguous()
        if self.dynamic:
            u, h_res, finish = self._dynamic(x3)
        else:
            u, h_res, finish = self._static(x3)

        def add_residual(f: torch.Tensor) -> torch.Tensor:
            return finish(check_branch_output(f, lead, C)).view(*lead, n, C)

        return u.view(*lead, C), add_residual, h_res.view(*lead, n, n)

    def _variant(self) -> tuple[str, float]:
        if self.variant == "deepseek" and self.eps == 0.0:
            return "log", 0.0
        return self.variant, float(self.eps)

    def _dynamic(self, x3: torch.Tensor):
        variant, eps = self._variant()
        # read once: both ops must use the same backward schedule even if the branch changes
        # the switch
        fused = bool(TUNING.mhc_fused_dx)
        u, _, h_post, h_res, sink, *_ = L.pre(
            x3, self.phi, self.alpha_pre, self.alpha_post, self.alpha_res, self.bias,
            self.n_iters, variant, eps, float(self.rms_eps), self.gemm_precision,
            self.pre_activation == "softmax", True, fused,
        )  # fmt: skip
        return u, h_res, lambda f: L.post(x3, f, h_post, h_res, sink, fused)

    def _static(self, x3: torch.Tensor):
        n, T = self.n_streams, x3.shape[0]
        with torch.autocast(x3.device.type, enabled=False):
            z = self.bias.float()
            pre = self._pre_act(z[:n]).expand(T, n)
            post = (2 * torch.sigmoid(z[n : 2 * n])).expand(T, n)
            res = sinkhorn_knopp(
                z[2 * n :].view(1, n, n), self.n_iters, variant=self.variant, eps=self.eps,
                backend="torch", check_finite=False,
            ).expand(T, n, n)  # fmt: skip
        # the sink of mhc_mix always applies H_resᵀ itself (its dX pass)
        u, sink = L.mix(x3, pre, res, False)
        return u, res, lambda f: L.post(x3, f, post, res, sink, True)

    def forward(self, x: torch.Tensor, branch=None) -> torch.Tensor:
        """See the class docstring. x: (..., n, C); returns (..., n, C)."""
        u, add_residual, _ = self.split(x)
        return add_residual(u if branch is None else branch(u))


class SplitHyperConnection(HyperConnection):
    """The hyper-connection interface in which calling the module returns the two halves.

    ``branch_input, add_residual, H_res = hc(H)`` for residual streams H of shape
    (..., num_streams, dim); then ``H_new = add_residual(sub_layer(branch_input))``. Same
    computation, parameters and kernels as :class:`HyperConnection` (this class only renames
    the arguments and makes :meth:`HyperConnection.split` the call); the two halves stay fused
    (the residual update reads H once and writes H_new once, with no H_res·H temporary).

    Args:
        dim: channels per stream.
        num_streams: number of streams n (default 4).
        dynamic: input-dependent coefficients (default True) or static ones.
        sinkhorn_iters: Sinkhorn rounds for H_res (default 20).
        layer_idx: the layer's index (default 0): H_pre starts out reading stream
            layer_idx mod n; None starts from equal weights.
        pre_activation: ``"softmax"`` (default here: H_pre are convex weights of the streams)
            or ``"sigmoid"``.
        **kwargs: the other arguments of :class:`HyperConnection` (``variant``, ``eps``,
            ``rms_eps``, ``alpha_init``, ``gemm_precision``, ``backend``, ``device``,
            ``dtype``).
    """

    _count_names = ("num_streams", "sinkhorn_iters")

    def __init__(
        self,
        dim: int,
        num_streams: int = 4,
        dynamic: bool = True,
        sinkhorn_iters: int = 20,
        layer_idx: int | None = 0,
        *,
        pre_activation: str = "softmax",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dim, num_streams, sinkhorn_iters, dynamic=dynamic, pre_activation=pre_activation,
            layer_idx=layer_idx, **kwargs,
        )  # fmt: skip

    def forward(self, x: torch.Tensor):  # type: ignore[override]
        """``(branch_input, add_residual, H_res)`` for H = x of shape (..., n, C); see
        :meth:`HyperConnection.split`."""
        return self.split(x)
