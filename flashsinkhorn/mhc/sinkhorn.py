"""Public entry point of the batched small-matrix Sinkhorn–Knopp projection.

``sinkhorn_knopp`` validates and picks a backend, once per call signature (``_plan``). While
``torch.compile`` traces, it calls the custom op ``flashsinkhorn::mhc_sinkhorn`` (forward)
whose autograd formula is the custom op ``flashsinkhorn::mhc_sinkhorn_backward``; both have
fake (meta) implementations, so the projection is traced without graph breaks. Eager calls run
the same forward and backward without the custom op's dispatch: directly without autograd,
through ``_SKFunction`` with it. The value check (``check_finite``) of a Triton call runs in
its forward kernel (:mod:`.value_check`).
"""

from __future__ import annotations

import importlib
import os

import torch
from torch.autograd.function import once_differentiable

from .. import _validation as V
from ..backends import triton_available
from .sk_torch import sk_backward_torch, sk_forward_torch
from .value_check import check_logit_values, give_back, raise_for, take_flag

__all__ = ["sinkhorn_knopp", "VARIANTS", "MAX_TRITON_N"]

VARIANTS = ("log", "deepseek")
BACKENDS = ("auto", "triton", "torch")
MAX_TRITON_N = 32
#: Read once: torch.compile cannot trace importlib's lookup (fullgraph would refuse the call).
_HAS_TRITON = triton_available()
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _OnFirstUse:
    """A module of Triton kernels, imported when first used: the torch path (and a machine
    without Triton) never imports Triton."""

    def __init__(self, name: str):
        self._name, self._module = name, None

    def __getattr__(self, attr: str):
        if self._module is None:
            self._module = importlib.import_module(self._name, __package__)
        value = getattr(self._module, attr)
        # later lookups find the attribute on the instance (no __getattr__ call); the
        # functions and kernels looked up this way are never rebound in their module
        setattr(self, attr, value)
        return value


_SK = _OnFirstUse(".sk_triton")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run_forward(
    x: torch.Tensor, n_iters: int, variant: str, eps: float, backend: str, check: bool = False
):
    """The projection of x; with ``check`` (Triton only) the kernel also checks the values,
    and the call waits for it and raises for logits without a projection."""
    if backend == "triton":
        if x.dim() == 3 and x.is_contiguous():
            # the common case without a reshape or a view (each ≈ 1-2 µs of host time)
            if not check:
                return _SK.sk_forward_triton(x, n_iters, variant, eps)
            return _checked_triton(x, n_iters, variant, eps)
        n = x.shape[-1]
        m = x.reshape(-1, n, n).contiguous()
        if not check:
            return _SK.sk_forward_triton(m, n_iters, variant, eps).view(x.shape)
        return _checked_triton(m, n_iters, variant, eps).view(x.shape)
    n = x.shape[-1]
    flat = x.reshape(-1, n, n)
    out = sk_forward_torch(flat.to(_compute_dtype(x.dtype)), n_iters, variant, eps)
    return out.to(x.dtype).reshape(x.shape)


def _checked_triton(m: torch.Tensor, n_iters: int, variant: str, eps: float) -> torch.Tensor:
    """The Triton forward of (B, n, n) contiguous logits with the value check in its kernel:
    one synchronisation, then the flag read."""
    flag = take_flag(m)
    out = _SK.sk_forward_triton(m, n_iters, variant, eps, flag=flag.kernel)
    bits = flag.read()
    if bits:
        raise_for(bits)  # the flag is not given back: it is not zero
    give_back(flag)
    return out


def _run_backward(x, grad, n_iters, variant, eps, backend):
    n = x.shape[-1]
    flat = x.reshape(-1, n, n)
    g = grad.reshape(-1, n, n)
    if backend == "triton":
        out = _SK.sk_backward_triton(
            flat.contiguous(), g.to(x.dtype).contiguous(), n_iters, variant, eps
        )
    else:
        cd = _compute_dtype(x.dtype)
        out = sk_backward_torch(flat.to(cd), g.to(cd), n_iters, variant, eps)
    return out.to(x.dtype).reshape(x.shape)


@torch.library.custom_op("flashsinkhorn::mhc_sinkhorn", mutates_args=())
def _sk_op(x: torch.Tensor, n_iters: int, variant: str, eps: float, backend: str) -> torch.Tensor:
    return _run_forward(x, n_iters, variant, eps, backend)


@_sk_op.register_fake
def _(x, n_iters, variant, eps, backend):
    return torch.empty_like(x)


@torch.library.custom_op("flashsinkhorn::mhc_sinkhorn_backward", mutates_args=())
def _sk_bwd_op(
    x: torch.Tensor, grad: torch.Tensor, n_iters: int, variant: str, eps: float, backend: str
) -> torch.Tensor:
    return _run_backward(x, grad, n_iters, variant, eps, backend)


@_sk_bwd_op.register_fake
def _(x, grad, n_iters, variant, eps, backend):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, n_iters, variant, eps, backend = inputs
    ctx.save_for_backward(x)
    ctx.args = (n_iters, variant, eps, backend)


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return _sk_bwd_op(x, grad, *ctx.args), None, None, None, None


_sk_op.register_autograd(_backward, setup_context=_setup_context)


def check_triton_device(name: str, x: torch.Tensor) -> None:
    """``backend="triton"`` needs the triton package and CUDA tensors (CPU tensors under the
    interpreter), as in the OT API (``flashsinkhorn.backends.resolve_backend``)."""
    if not _HAS_TRITON:
        raise ValueError("backend='triton' needs the triton package; use backend='torch'")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not (x.is_cuda or (x.device.type == "cpu" and interpreting)):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
            f"got {name} on device {x.device}; use backend='auto' or 'torch'"
        )


def resolve_backend(x: torch.Tensor, backend: str) -> str:
    """Concrete backend ("triton" or "torch") for a validated input."""
    n = x.shape[-1]
    if backend == "auto":
        ok = x.is_cuda and n <= MAX_TRITON_N and x.dtype in _TRITON_DTYPES
        return "triton" if ok and _HAS_TRITON else "torch"
    if backend == "triton":
        if n > MAX_TRITON_N:
            raise ValueError(
                f"backend='triton' supports n <= {MAX_TRITON_N} (logits of shape (..., n, n)); "
                f"got n = {n}. Use backend='auto' or 'torch'."
            )
        if x.dtype not in _TRITON_DTYPES:
            raise TypeError(
                f"backend='triton' supports logits of dtype float16, bfloat16 or float32; "
                f"got {x.dtype}. Use backend='torch' for float64."
            )
        check_triton_device("logits", x)
    return backend


def _validate(
    logits, n_iters, variant, eps, backend, check_finite
) -> tuple[int, str, float, str, bool]:
    """Checks every argument; returns (n_iters, variant, eps, concrete backend, check_finite)
    with ``"deepseek"`` at eps = 0 routed to ``"log"``."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(
            f"logits must have a floating dtype (float16, bfloat16, float32, float64); "
            f"got {logits.dtype}"
        )
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2] or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have square trailing dimensions (..., n, n) with n >= 1; got shape "
            f"{tuple(logits.shape)}"
        )
    n_iters = V.check_int("n_iters", n_iters, 1)
    V.check_choice("variant", variant, VARIANTS)
    eps = V.check_nonnegative("eps", eps)
    V.check_choice("backend", backend, BACKENDS)
    check_finite = V.check_bool("check_finite", check_finite)
    if variant == "deepseek" and eps == 0.0:
        variant = "log"  # identical recursion without the additive constant
    return n_iters, variant, eps, resolve_backend(logits, backend), check_finite


# Validated arguments per call signature (see sinkhorn_knopp). Only calls whose scalar
# arguments have exactly the types the validation admits are cached (True == 1 and 1.0 == 1
# hash alike, and a 0-d tensor hashes by identity): the key needs no type entries, which
# halves its cost on the hot path.
_PLANS: dict = {}
_PLANS_MAX = 4096
_Tensor = torch.Tensor


def _plan(logits, n_iters, variant, eps, backend, check_finite):
    """Validated arguments for this call, from the cache or by running :func:`_validate`."""
    key = None
    if (
        type(n_iters) is int
        and type(eps) is float
        and type(check_finite) is bool
        and type(logits) is _Tensor
    ):
        key = (logits.shape, logits.dtype, logits.device, n_iters, variant, eps, backend,
               check_finite)  # fmt: skip
        try:
            plan = _PLANS.get(key)
        except TypeError:  # an unhashable variant or backend: the validation names it
            key = plan = None
        if plan is not None:
            return plan
    plan = _validate(logits, n_iters, variant, eps, backend, check_finite)
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


class _SKFunction(torch.autograd.Function):
    """The eager path of the projection: the same forward and backward as the custom op,
    without the custom op's dispatch (≈ 30 µs of host time per call on a CPU)."""

    @staticmethod
    def forward(x, n_iters, variant, eps, backend, check):
        return _run_forward(x, n_iters, variant, eps, backend, check)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs[:5], output)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _run_backward(x, grad, *ctx.args), None, None, None, None, None


def sinkhorn_knopp(
    logits: torch.Tensor,
    n_iters: int = 20,
    *,
    variant: str = "log",
    eps: float = 1e-6,
    backend: str = "auto",
    check_finite: bool = True,
) -> torch.Tensor:
    """Project each n×n matrix of logits onto (approximately) the Birkhoff polytope.

    Args:
        logits: (..., n, n) floating tensor; every leading index is an independent matrix.
        n_iters: number of Sinkhorn rounds (≥ 1).
        variant: ``"log"`` (default): P₀ = exp(M − rowmax M), then ``n_iters`` rounds of
            (normalise rows, normalise columns); the result is column-stochastic up to
            rounding and row-stochastic up to the iteration error. ``"deepseek"``: DeepSeek's
            reference, P₀ = softmax(M, −1) + eps, a column normalisation, then ``n_iters − 1``
            rounds, every normalisation dividing by (sum + eps).
        eps: the additive constant of ``"deepseek"`` (≥ 0); ignored by ``"log"``.
        backend: ``"auto"`` (Triton on CUDA for n ≤ 32 and 16/32-bit floats, else torch),
            ``"triton"`` (CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``) or
            ``"torch"``.
        check_finite: raise for NaN or +inf logits, and for a row or column of -inf (no
            projection exists); one device synchronisation (the Triton backend checks in the
            projection kernel itself, the torch backend with two reductions). False skips the
            check (NaN in, NaN out). A call traced by ``torch.compile`` or captured into a
            CUDA graph never checks (neither can wait for the device).

    Returns:
        (..., n, n) tensor of the input dtype (half precision is read and written in its
        dtype and computed in float32). Differentiable; the backward recomputes the
        iterations (no saved history).

    The arguments are validated on the first call for a given (shape, dtype, device,
    arguments); later calls with the same ones reuse that result and go straight to the
    kernel launch (``check_finite``'s value check still runs on every call, in that launch).

    Raises:
        TypeError: non-tensor or non-floating logits; float64 with ``backend="triton"``;
            ``n_iters`` not an int, ``eps`` not a number, ``check_finite`` not a bool.
        ValueError: logits not (..., n, n) with n >= 1; n_iters < 1; unknown
            variant/backend; eps < 0 or not finite; n > 32, no triton package or CPU tensors
            without the interpreter with ``backend="triton"``; NaN/+inf logits or a row or
            column of -inf (``check_finite``).

    Examples:
        >>> import torch
        >>> from flashsinkhorn.mhc import sinkhorn_knopp
        >>> H = sinkhorn_knopp(torch.randn(8, 4, 4))    # 8 matrices, each nearly doubly stochastic
        >>> H.shape, bool(H.min() >= 0)
        (torch.Size([8, 4, 4]), True)
        >>> torch.allclose(H.sum(-1), torch.ones(8, 4), atol=1e-3)
        True
    """
    if torch.compiler.is_compiling():
        # Validated while tracing (no cost at run time); the custom op keeps the projection
        # one opaque node of the graph. A compiled graph cannot synchronise on data, so it
        # never checks the values.
        n_iters, variant, eps, backend, _ = _validate(
            logits, n_iters, variant, eps, backend, check_finite
        )
        return _sk_op(logits, n_iters, variant, eps, backend)
    n_iters, variant, eps, backend, check = _plan(
        logits, n_iters, variant, eps, backend, check_finite
    )
    if check:
        if logits.is_meta:
            check = False  # meta tensors hold no values
        elif logits.is_cuda and torch.cuda.is_current_stream_capturing():
            check = False  # a capture cannot wait for the device (as torch.compile above)
        elif backend != "triton":
            check_logit_values(logits)
            check = False
    if logits.requires_grad and torch.is_grad_enabled():
        return _SKFunction.apply(logits, n_iters, variant, eps, backend, check)
    return _run_forward(logits, n_iters, variant, eps, backend, check)
