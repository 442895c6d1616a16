"""Plain-loop references for the mHC projection and layer.

These follow the written definitions step by step (no fusion, no shifts beyond the row max) and
are meant to be differentiated by autograd, usually in float64. The tests pin every fast path
against them; the layer reference is also the PyTorch baseline in ``bench/bench_mhc.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import _validation as V

__all__ = ["sinkhorn_knopp_reference", "HyperConnectionReference"]


def sinkhorn_knopp_reference(
    logits: torch.Tensor, n_iters: int = 20, variant: str = "log", eps: float = 1e-6
) -> torch.Tensor:
    """Sinkhorn–Knopp projection written as the plain alternating loop.

    Args:
        logits: (..., n, n) tensor.
        n_iters: number of (row, column) rounds.
        variant: ``"log"``: P = exp(M − rowmax M), then ``n_iters`` rounds of row then column
            normalisation. ``"deepseek"``: P = softmax(M, −1) + eps, P /= (colsum + eps), then
            ``n_iters − 1`` rounds of row then column normalisation, each with + eps in the
            denominator.
        eps: additive constant of the ``"deepseek"`` variant (ignored by ``"log"``).

    Returns:
        (..., n, n) tensor of the same dtype.
    """
    V.check_int("n_iters", n_iters, 1)
    V.check_choice("variant", variant, ("log", "deepseek"))
    V.check_nonnegative("eps", eps)
    if variant == "log":
        p = torch.exp(logits - logits.amax(-1, keepdim=True))
        for _ in range(n_iters):
            p = p / p.sum(-1, keepdim=True)
            p = p / p.sum(-2, keepdim=True)
        return p
    if variant == "deepseek":
        p = torch.softmax(logits, -1) + eps
        p = p / (p.sum(-2, keepdim=True) + eps)
        for _ in range(n_iters - 1):
            p = p / (p.sum(-1, keepdim=True) + eps)
            p = p / (p.sum(-2, keepdim=True) + eps)
        return p
    raise AssertionError(variant)  # checked above


def check_layer_args(
    dim, n_streams, n_iters, variant, eps, rms_eps, alpha_init, dtype,
    names: tuple[str, str] = ("n_streams", "n_iters"),
) -> tuple[int, int, int, float, float, float]:  # fmt: skip
    """Validates the hyper-connection arguments shared by both layers.

    ``names``: the caller's names of the stream and iteration counts, for the messages
    (``SplitHyperConnection`` calls them ``num_streams`` and ``sinkhorn_iters``).

    Returns:
        ``(dim, n_streams, n_iters, eps, rms_eps, alpha_init)`` as Python numbers.
    """
    dim = V.check_int("dim", dim, 1)
    n_streams = V.check_int(names[0], n_streams, 1)
    n_iters = V.check_int(names[1], n_iters, 1)
    V.check_choice("variant", variant, ("log", "deepseek"))
    eps = V.check_nonnegative("eps", eps)
    # rms_eps > 0: an all-zero token would otherwise divide 0 by 0.
    rms_eps = V.check_positive("rms_eps", rms_eps)
    alpha_init = V.check_finite("alpha_init", alpha_init)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
    return dim, n_streams, n_iters, eps, rms_eps, alpha_init


def check_branch_output(f: object, lead: tuple, dim: int) -> torch.Tensor:
    """Checks that the branch output F is a floating tensor of the branch input's shape
    (*lead, dim) (anything else would be broadcast into the residual update); returns it as
    (T, dim)."""
    want = (*lead, dim)
    if not isinstance(f, torch.Tensor) or not f.is_floating_point():
        raise TypeError(
            f"branch output must be a floating torch.Tensor of shape {want} (the shape of its "
            f"input), got {V.describe(f)}"
        )
    if tuple(f.shape) != want:
        raise ValueError(
            f"branch output must have shape {want}, the shape of the branch input u "
            f"(..., dim); got {tuple(f.shape)}"
        )
    return f.reshape(-1, dim)


def branch_output(branch, u: torch.Tensor, lead: tuple, dim: int) -> torch.Tensor:
    """``branch(u)`` for u of shape (*lead, dim), checked by :func:`check_branch_output`, as
    (T, dim)."""
    if branch is None:
        return u.reshape(-1, dim)
    return check_branch_output(branch(u.view(*lead, dim)), lead, dim)


def check_layer_input(x: object, n: int, dim: int, params: torch.Tensor) -> torch.Tensor:
    """Checks the residual streams X (..., n, dim) against the layer and its parameters."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"x must be a floating torch.Tensor of shape (..., n_streams, dim), got {V.describe(x)}"
        )
    if x.dim() < 2 or x.shape[-2:] != (n, dim):
        raise ValueError(
            f"x must have shape (..., {n}, {dim}) (n_streams, dim); got {tuple(x.shape)}"
        )
    if x.device != params.device:
        raise ValueError(
            f"x must be on the device of the layer's parameters ({params.device}), got {x.device}"
        )
    return x


PRE_ACTIVATIONS = ("sigmoid", "softmax")
#: Logit of H_pre at stream ``layer_idx mod n`` (and minus it elsewhere) when a layer index is
#: given: the branch then starts out reading mostly that one stream (σ(4) ≈ 0.982).
PRE_INIT_LOGIT = 4.0
#: Diagonal logit of H_res at initialisation (identity-like mixing).
RES_INIT_LOGIT = 4.0


def check_layer_options(dynamic, pre_activation, layer_idx) -> tuple[bool, str, int | None]:
    """Validates the options ``dynamic``, ``pre_activation`` and ``layer_idx``."""
    dynamic = V.check_bool("dynamic", dynamic)
    V.check_choice("pre_activation", pre_activation, PRE_ACTIVATIONS)
    if layer_idx is not None:
        layer_idx = V.check_int("layer_idx", layer_idx, 0)
    return dynamic, pre_activation, layer_idx


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """X in the autocast dtype when autocast is on for its device and X is float32 (the layer
    is matmul-like: autocast would run it in the lower precision); X otherwise."""
    dev = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        low = torch.get_autocast_dtype(dev)
        if low in (torch.float16, torch.bfloat16):
            return x.to(low)
    return x


class HyperConnectionReference(nn.Module):
    """Manifold-constrained hyper-connection written with plain PyTorch ops.

    Same parameters, conventions and call signature as :class:`flashsinkhorn.mhc.HyperConnection`.
    For tokens X ∈ R^{n×C} (n residual streams):

    * x = flatten(X) ∈ R^{nC}, r = sqrt(mean(x²) + rms_eps), h = x·φ ∈ R^{n²+2n};
    * H_pre = σ(α_pre·h[:n]/r + b[:n]) (or a softmax over the n streams),
      H_post = 2σ(α_post·h[n:2n]/r + b[n:2n]),
      H_res = SinkhornKnopp(reshape(α_res·h[2n:]/r + b[2n:], n, n));
    * branch input u = Σ_i H_pre[i]·X[i] ∈ R^C, F = branch(u);
    * X_next[i] = Σ_j H_res[i, j]·X[j] + H_post[i]·F   (X_next = H_res·X + H_postᵀ·F).

    With ``dynamic=False`` the coefficients do not depend on X: the same formulas with h = 0
    (no φ and no α parameters), H_pre = σ(b[:n]) etc., shared by all tokens.
    """

    #: The public names of the stream and iteration counts, for argument errors.
    _count_names = ("n_streams", "n_iters")

    def __init__(
        self,
        dim: int,
        n_streams: int = 4,
        n_iters: int = 20,
        variant: str = "log",
        eps: float = 1e-6,
        rms_eps: float = 1e-6,
        alpha_init: float = 0.01,
        device=None,
        dtype=None,
        *,
        dynamic: bool = True,
        pre_activation: str = "sigmoid",
        layer_idx: int | None = None,
    ) -> None:
        super().__init__()
        dim, n_streams, n_iters, eps, rms_eps, alpha_init = check_layer_args(
            dim, n_streams, n_iters, variant, eps, rms_eps, alpha_init, dtype, self._count_names
        )
        dynamic, pre_activation, layer_idx = check_layer_options(dynamic, pre_activation, layer_idx)
        n = n_streams
        self.dim, self.n_streams, self.n_iters = dim, n, n_iters
        self.variant, self.eps, self.rms_eps = variant, eps, rms_eps
        self.dynamic, self.pre_activation, self.layer_idx = dynamic, pre_activation, layer_idx
        kw = {"device": device, "dtype": dtype or torch.float32}
        width = n * n + 2 * n
        if dynamic:
            self.phi = nn.Parameter(torch.empty(n * dim, width, **kw))
            self.alpha_pre = nn.Parameter(torch.full((1,), alpha_init, **kw))
            self.alpha_post = nn.Parameter(torch.full((1,), alpha_init, **kw))
            self.alpha_res = nn.Parameter(torch.full((1,), alpha_init, **kw))
        self.bias = nn.Parameter(torch.zeros(width, **kw))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """φ ~ N(0, 1/(nC)); biases start at identity-like mixing: H_res ≈ I (diagonal logits
        ``RES_INIT_LOGIT``), H_post = 1, H_pre = σ(0) = ½ on every stream (a uniform softmax),
        or, with ``layer_idx``, logits ±``PRE_INIT_LOGIT`` that favour stream layer_idx mod n
        (layers at different depths start out reading different streams)."""
        n = self.n_streams
        if self.dynamic:
            nn.init.normal_(self.phi, std=(n * self.dim) ** -0.5)
        self.bias.zero_()
        self.bias[2 * n :].view(n, n).fill_diagonal_(RES_INIT_LOGIT)
        if self.layer_idx is not None:
            self.bias[:n].fill_(-PRE_INIT_LOGIT)
            self.bias[self.layer_idx % n] = PRE_INIT_LOGIT

    def _pre_act(self, z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(z, -1) if self.pre_activation == "softmax" else torch.sigmoid(z)

    def coefficients(self, x: torch.Tensor):
        """Coefficients of every token.

        Args:
            x: (T, n, C) residual streams.

        Returns:
            (h_pre (T, n), h_post (T, n), h_res (T, n, n)), in the parameters' dtype.
        """
        n = self.n_streams
        if not self.dynamic:
            z = self.bias
            res = sinkhorn_knopp_reference(z[2 * n :].view(1, n, n), self.n_iters, self.variant,
                                           self.eps)  # fmt: skip
            T = x.shape[0]
            pre = self._pre_act(z[:n]).expand(T, n)
            post = (2 * torch.sigmoid(z[n : 2 * n])).expand(T, n)
            return pre, post, res.expand(T, n, n)
        flat = x.reshape(x.shape[0], -1).to(self.phi.dtype)
        r = torch.sqrt(flat.square().mean(-1, keepdim=True) + self.rms_eps)
        h = flat @ self.phi
        pre = self._pre_act(self.alpha_pre * h[:, :n] / r + self.bias[:n])
        post = 2 * torch.sigmoid(self.alpha_post * h[:, n : 2 * n] / r + self.bias[n : 2 * n])
        res = self.alpha_res * h[:, 2 * n :] / r + self.bias[2 * n :]
        res = sinkhorn_knopp_reference(res.view(-1, n, n), self.n_iters, self.variant, self.eps)
        return pre, post, res

    def split(self, x: torch.Tensor):
        """The layer in two halves, around a sub-layer that the caller runs.

        Args:
            x: (..., n, C) residual streams H.

        Returns:
            ``(branch_input, add_residual, h_res)``: the branch input u (..., C); a function
            ``add_residual(branch_output)`` that takes F (..., C) and returns the next
            residual streams (..., n, C); the mixing matrices H_res (..., n, n) (float32 or
            the parameters' dtype).
        """
        check_layer_input(x, self.n_streams, self.dim, self.bias)
        x = autocast_input(x)
        lead, n, C = x.shape[:-2], self.n_streams, self.dim
        xt = x.reshape(-1, n, C)
        with torch.autocast(x.device.type, enabled=False):
            pre, post, res = self.coefficients(xt)
        u = torch.einsum("ti,tic->tc", pre.to(x.dtype), xt)

        def add_residual(f: torch.Tensor) -> torch.Tensor:
            f = check_branch_output(f, lead, C)
            out = torch.einsum("tij,tjc->tic", res.to(x.dtype), xt)
            out = out + post.to(x.dtype)[..., None] * f[:, None, :].to(x.dtype)
            return out.view(*lead, n, C)

        return u.view(*lead, C), add_residual, res.view(*lead, n, n)

    def forward(self, x: torch.Tensor, branch=None) -> torch.Tensor:
        """Apply one hyper-connected sub-layer.

        Args:
            x: (..., n, C) residual streams.
            branch: callable (..., C) -> (..., C) (attention, MLP, …); identity if None.

        Returns:
            (..., n, C) next residual streams.
        """
        u, add_residual, _ = self.split(x)
        return add_residual(u if branch is None else branch(u))
