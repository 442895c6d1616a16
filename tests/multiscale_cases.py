"""Shared pieces of the multiscale tests (CPU and GPU): the benchmark's mixture-onto-shell
clouds, and the backend's soft-min and envelope gradient through the torch block-sparse path
and through the Triton kernel."""

import torch

from flashsinkhorn.backends.torch_ref import TorchBackend
from flashsinkhorn.multiscale import MultiscaleBackend


def mixture_and_shell(n: int, seed: int = 0):
    """x: 8 Gaussian blobs (std 0.1, centres in [-1, 1]³); y: a noisy unit sphere shell;
    both (n, 3) float32 on the CPU, and the bounding-box diagonal of both clouds."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(8, 3, generator=g) * 2 - 1
    lab = torch.randint(0, 8, (n,), generator=g)
    x = centres[lab] + 0.1 * torch.randn(n, 3, generator=g)
    s = torch.randn(n, 3, generator=g)
    s = s / s.norm(dim=1, keepdim=True)
    y = s * (1.0 + 0.05 * torch.randn(n, 1, generator=g))
    pts = torch.cat([x, y])
    return x, y, float((pts.amax(0) - pts.amin(0)).norm())


def torch_and_kernel_paths(p, f, g, eps, grad_rows: str = "x"):
    """[(T, G, marginal) of the torch path, the same through the kernel]: the soft-min of f
    against g on problem ``p`` and the envelope gradient of the ``grad_rows`` side, each with
    a fresh backend (tolerance 1e-3)."""
    out = []
    for kernel in (False, True):
        be = MultiscaleBackend(TorchBackend(), p, 1e-3)
        be.kernel = kernel
        T, _ = be.softmin(p.X, p.Y, g, eps, f, 0.0, 1.0, True, "ieee")
        if grad_rows == "x":
            G, marg = be.transport_grad(p.X, p.Y, f, g, eps, "ieee")
        else:
            G, marg = be.transport_grad(p.Y, p.X, g, f, eps, "ieee")
        out.append((T, G, marg))
    return out
