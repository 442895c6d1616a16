"""Backend selection. The solver only sees the :class:`~.base.Backend` interface."""

from __future__ import annotations

import importlib.util
import os

import torch

from .base import Backend
from .kernel_cpu import KernelBackend, kernel_fits
from .torch_ref import TorchBackend

_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_available() -> bool:
    """True when the triton package can be imported."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a finder that refuses it, a broken install
        return False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> Backend:
    """Maps ``backend=`` to an implementation.

    "auto" picks Triton for CUDA tensors of a dtype it handles and torch otherwise (on CPU
    tensors, one that ``select_path`` may turn into the stored-kernel backend); "torch" is the
    log-domain soft-min; "triton" on CPU tensors needs the interpreter (TRITON_INTERPRET=1).
    """
    if name == "auto":
        if device.type == "cuda" and dtype in _TRITON_DTYPES and triton_available():
            name = "triton"
        else:
            return TorchBackend(kernel_path=device.type == "cpu")
    if name == "torch":
        return TorchBackend()
    if not triton_available():
        raise ValueError("backend='triton' needs the triton package; use backend='torch'")
    if dtype not in _TRITON_DTYPES:
        raise ValueError(
            f"backend='triton' supports float32, float16 and bfloat16 points, got {dtype}; "
            "use backend='torch' (or 'auto') for float64"
        )
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1), "
            f"got device {device}"
        )
    from .triton import TritonBackend

    return TritonBackend()


def select_path(backend: Backend, problem, path: str) -> Backend:
    """Chooses between streaming kernels and a stored Gram matrix for the soft-mins.

    "auto" takes the dense path on the Triton backend for fp32 points with d >= 256 when
    B·n·m fp32 values fit the memory budget (see ``triton/dense.py``, ``triton/configs.py``); on
    CPU tensors with ``backend="auto"`` the stored Gibbs kernel when its B·n·m values fit
    ``kernel_cpu.KERNEL_MAX_BYTES`` (``kernel_cpu.py``); the torch backend otherwise works on
    materialised row blocks of log-domain scores.
    """
    if backend.name != "triton":
        if path == "streaming":
            raise ValueError("path='streaming' needs backend='triton' (the torch backend is dense)")
        if path == "auto" and getattr(backend, "kernel_path", False) and kernel_fits(problem):
            return KernelBackend(backend.chunk_elements, problem.B * problem.X.n * problem.Y.n)
        return backend
    if path == "streaming":
        return backend
    if not getattr(problem, "default_cost", True):
        # The stored Gram matrix holds x·yᵀ only: other costs and the label term stream.
        if path == "dense":
            raise ValueError(
                "path='dense' supports the squared Euclidean cost without labels only; use "
                "path='streaming' or 'auto' for cost='euclidean' or label_cost"
            )
        return backend
    from .triton.configs import DENSE_MIN_D
    from .triton.dense import DenseTritonBackend, check_dense_memory, dense_fits

    if path == "auto":
        d = problem.X.x.shape[-1]
        if not (d >= DENSE_MIN_D and problem.X.x.dtype == torch.float32 and dense_fits(problem)):
            return backend
    elif problem.X.x.dtype != torch.float32:
        raise ValueError(f"path='dense' supports float32 points, got {problem.X.x.dtype}")
    else:
        check_dense_memory(problem)
    return DenseTritonBackend(problem)


def transient_path(x: torch.Tensor, y: torch.Tensor, backend: str) -> str:
    """``path`` for a solve whose result is used once and dropped (a minibatch coupling).

    "dense" for float32 CUDA points (n, d), (m, d) with d >= ``DENSE_MIN_D`` on the Triton
    backend when the Gram matrix fits ``DENSE_FREE_FRACTION`` of the free memory, whatever
    ``DENSE_MAX_BYTES`` (the cap of results that keep it): streaming recomputes x·yᵀ in every
    sweep, 2·n·m·d products against 4·n·m bytes read (a coupling of 65,536² at d = 3072,
    10 iterations, on an H100: 0.75 s of floor against 0.16 s). "auto" (``select_path``'s
    rule) otherwise.
    """
    if backend not in ("auto", "triton") or x.device.type != "cuda":
        return "auto"
    from .triton.configs import DENSE_MIN_D
    from .triton.dense import fits_free_memory, gram_bytes

    if x.dtype != torch.float32 or y.dtype != torch.float32 or x.shape[-1] < DENSE_MIN_D:
        return "auto"
    if not fits_free_memory(gram_bytes(1, x.shape[0], y.shape[0]), x.device):
        return "auto"
    return "dense"
