"""nn.Module losses: :class:`SinkhornDivergence` (our conventions) and :class:`SamplesLoss`
(a drop-in for GeomLoss's ``SamplesLoss(loss="sinkhorn", p=2, ...)``, GeomLoss conventions)."""

from __future__ import annotations

from typing import Any

import torch

from . import _validation as V
from ._boundary import entry_point
from .autograd.samples_loss import GeomLossSpec, SamplesLossFunction, geomloss_potentials
from .engine import solve_geomloss
from .losses import divergence, sinkhorn_divergence, zero_if_identical
from .option_table import option_parameters
from .options import SOLVER_DEFAULTS, HVPOptions, SinkhornOptions

_GEOMLOSS_BACKENDS = {
    "auto": "auto",
    "tensorized": "torch",
    "online": "auto",
    "multiscale": "auto",
    "torch": "torch",
    "triton": "triton",
}


class SinkhornDivergence(torch.nn.Module):
    """Debiased Sinkhorn divergence S_eps as a module (cost ‖x − y‖², our conventions).

    ``SinkhornDivergence(eps=0.1, **options)(x, y, a=None, b=None)`` equals
    :func:`flashsinkhorn.sinkhorn_divergence` with the stored options.

    Args:
        eps: entropic regularisation in squared-distance units.
        **options: any keyword option of :func:`flashsinkhorn.sinkhorn_divergence` (n_iters,
            tol, check_every, schedule, acceleration, omega, anderson_memory, scaling,
            diameter, rho_x, rho_y, backend, precision, check_finite, path, progress,
            hvp_options, and the cost options cost, feature_map, label_x, label_y,
            label_cost, feature_weight, label_weight of docs/costs.md). The solver settings
            are validated here, the cost settings at the call (they are checked against the
            clouds).

    Examples:
        >>> import torch
        >>> import flashsinkhorn as fs
        >>> loss_fn = fs.SinkhornDivergence(eps=0.1)
        >>> x = torch.rand(200, 3, requires_grad=True)
        >>> loss = loss_fn(x, torch.rand(300, 3))
        >>> loss.backward()
        >>> loss.shape, x.grad.shape
        (torch.Size([]), torch.Size([200, 3]))
    """

    def __init__(self, eps: float, **options: Any):
        super().__init__()
        self.eps = V.check_positive("eps", eps)
        unknown = set(options) - set(option_parameters(sinkhorn_divergence)) - {"eps"}
        if unknown:
            raise TypeError(f"SinkhornDivergence got unexpected options: {sorted(unknown)}")
        # The solver settings are checked now; the cost ones need the clouds (at the call).
        opts = SinkhornOptions.build(
            eps=self.eps, hvp_options=options.get("hvp_options"),
            **{k: v for k, v in options.items() if k in SOLVER_DEFAULTS},
        )  # fmt: skip
        V.check_divergence_rho(opts.rho_x, opts.rho_y)
        self.options = options

    @entry_point
    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor | None = None,
        b: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """S between (x, a) and (y, b); () or (B,)."""
        return divergence("SinkhornDivergence", x, y, a, b, eps=self.eps, **self.options)

    def extra_repr(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"eps={self.eps:g}{opts}"


class SamplesLoss(torch.nn.Module):
    """Drop-in replacement for ``geomloss.SamplesLoss(loss="sinkhorn", p=2 or 1, ...)``.

    Follows GeomLoss's conventions exactly: for p = 2 the cost C = ½‖x − y‖², eps = blur²,
    rho = reach²; for p = 1 the cost C = ‖x − y‖ (as GeomLoss: sqrt(max(‖x − y‖², 1e-8))),
    eps = blur, rho = reach;
    the eps schedule from ``diameter`` down to ``blur`` by ``scaling``, exactly GeomLoss's
    number of symmetric iterations and its final "last extrapolation". The result equals
    GeomLoss's tensorized backend (float64: to round-off). Gradients come from fused streaming
    kernels (no n × m tensor on the Triton path); with ``reach`` they are the derivative of the
    value, which GeomLoss's autograd misses by a factor (rho + eps/2)/(rho + eps).

    Args:
        loss: only "sinkhorn".
        p: 2 (half squared Euclidean cost) or 1 (Euclidean distance; gradient 0 where two
            points are within 1e-4 of each other, GeomLoss's clamp).
        blur: target length scale, eps = blur². Default 0.05.
        reach: None (balanced) or the KL relaxation length scale, rho = reach².
        diameter: start of the annealing; None estimates it from the bounding box.
        scaling: ratio between successive blur values, in (0, 1). Default 0.5.
        truncate: accepted and ignored (a multiscale-only option); None or a number > 0.
        cost: only None (the squared Euclidean cost).
        kernel: only None (accepted for signature compatibility).
        cluster_scale: only None (accepted for signature compatibility).
        debias: return the debiased divergence. Default True.
        potentials: return the pair of dual potentials (F, G) instead of the value, in
            GeomLoss's shapes: (1, N) and (1, M) for (N, D) clouds, (B, N) and (B, M) for
            batches, and (N,), (M,) where GeomLoss would run its multiscale routine
            (``backend="multiscale"``, or "auto" above 10⁸ point pairs in <= 3 dimensions,
            for unbatched clouds or a batch of one). Default False.
        verbose: accepted and ignored (a bool).
        backend: "auto" (Triton on CUDA, torch otherwise), "tensorized" (= "torch"),
            "online"/"multiscale" (= "auto"), "torch" or "triton".
        precision: dot-product precision, as in :func:`flashsinkhorn.sinkhorn`. Default "auto".
        check_finite: check the points and weights for NaN/inf before solving (one device
            synchronisation); False skips it. Default True.
        hvp_options: Schur-solve settings of second derivatives, as in
            :func:`flashsinkhorn.ot_cost` (keys ``tau``, ``cg_tol``, ``cg_max_iter``,
            ``cg_check_every``). Differentiating the point gradients again
            (``create_graph=True``) applies the streaming HVP of the debiased divergence for
            p = 2 without ``reach`` (docs/hvp.md); p = 1 and ``reach`` refuse it.

    Call forms: ``loss(x, y)`` (uniform weights) and ``loss(a, x, b, y)``; points (N, D) or
    (B, N, D); weights (N,), (N, 1), (B, N) or (B, N, 1). Returns () or (B,), or (F, G).
    The flags ``debias``, ``potentials``, ``verbose`` and ``check_finite`` must be bools.

    Examples:
        >>> import torch
        >>> import flashsinkhorn as fs
        >>> loss_fn = fs.SamplesLoss("sinkhorn", p=2, blur=0.1)   # GeomLoss's arguments
        >>> x, y = torch.rand(200, 3), torch.rand(300, 3)
        >>> loss = loss_fn(x, y)
        >>> loss.shape, bool(loss >= 0)
        (torch.Size([]), True)
    """

    def __init__(
        self,
        loss: str = "sinkhorn",
        p: int = 2,
        blur: float = 0.05,
        reach: float | None = None,
        diameter: float | None = None,
        scaling: float = 0.5,
        truncate: float | None = 5,
        cost: None = None,
        kernel: None = None,
        cluster_scale: None = None,
        debias: bool = True,
        potentials: bool = False,
        verbose: bool = False,
        backend: str = "auto",
        precision: str = "auto",
        check_finite: bool = True,
        hvp_options: dict | None = None,
    ):
        super().__init__()
        if loss != "sinkhorn":
            raise ValueError(
                f"loss must be 'sinkhorn' (the only loss supported so far), got {loss!r}"
            )
        p_value = V.as_real("p", p, "1 or 2")
        if p_value not in (1.0, 2.0):
            raise ValueError(f"p must be 1 or 2, got {p!r}")
        if cost is not None:
            raise ValueError("cost must be None: only the squared Euclidean cost is supported")
        if kernel is not None or cluster_scale is not None:
            raise ValueError("kernel and cluster_scale are not supported (loss='sinkhorn' only)")
        V.check_choice("backend", backend, tuple(_GEOMLOSS_BACKENDS))
        V.check_choice("precision", precision, V.PRECISIONS)
        scaling = V.check_scaling(scaling)
        if scaling is None:
            raise ValueError("scaling must be in (0, 1), got None")
        # Accepted for GeomLoss's signature and not used (multiscale only), but still a number.
        V.check_positive("truncate", truncate, allow_none=True)
        V.check_bool("verbose", verbose)
        self.spec = GeomLossSpec(
            blur=V.check_positive("blur", blur),
            reach=V.check_positive("reach", reach, allow_none=True),
            diameter=V.check_positive("diameter", diameter, allow_none=True),
            scaling=scaling,
            debias=V.check_bool("debias", debias),
            backend=_GEOMLOSS_BACKENDS[backend],
            precision=precision,
            check_finite=V.check_bool("check_finite", check_finite),
            p=int(p_value),
            route=backend,
            hvp=HVPOptions.build(hvp_options),
        )
        self.potentials = V.check_bool("potentials", potentials)

    @entry_point
    def forward(
        self, *args: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``loss(x, y)`` or ``loss(a, x, b, y)``."""
        if len(args) == 2:
            x, y = args
            a = b = None
        elif len(args) == 4:
            a, x, b, y = args
        else:
            raise TypeError(
                f"SamplesLoss takes (x, y) or (a, x, b, y), got {len(args)} positional arguments"
            )
        V.check_points("x", x)
        V.check_points("y", y)
        V.check_pair(x, y)
        a = V.check_weights("a", a, x)
        b = V.check_weights("b", b, y)
        loop = solve_geomloss(x, y, a, b, self.spec)
        if self.potentials:
            return geomloss_potentials(loop, x, y, self.spec)
        out = SamplesLossFunction.apply(x, y, a, b, self.spec, loop)
        return zero_if_identical(out, x, y, a, b) if self.spec.debias else out

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"blur={s.blur:g}, reach={s.reach}, diameter={s.diameter}, scaling={s.scaling:g}, "
            f"debias={s.debias}, potentials={self.potentials}, backend={s.backend!r}"
        )
