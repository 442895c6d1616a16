"""Canonical form of an OT problem between two (batched) point clouds.

The public API validates its arguments and builds a :class:`Problem`; the solver and the
backends only ever see this form: points (B, n, d) centred at the joint weighted mean (and, for
``precision="tf32"``, rounded to TF32 so that norms and dot products describe the same points),
squared norms, weights and log-weights, all contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from . import _validation as V

#: A backend's implementation of ``prepare``'s arithmetic (see :func:`prepare`).
SidesFn = Callable[..., tuple]


@dataclass(frozen=True)
class Side:
    """One marginal of the problem.

    Attributes:
        x: (B, n, d) centred points in the compute dtype.
        sq: (B, n) squared norms ‖x_i‖² of those points, in the potential dtype.
        w: (B, n) weights (non-negative), potential dtype.
        logw: (B, n) log-weights (-inf where a weight is 0).
        rho: KL relaxation strength of this marginal, None for a hard constraint.
    """

    x: torch.Tensor
    sq: torch.Tensor
    w: torch.Tensor
    logw: torch.Tensor
    rho: float | None
    #: Kernel operand on float32 input, or None to use ``x``. Precision "tf32": (B, n, d) float16,
    #: the points divided by ``kscale`` (a power of two); ``x`` holds exactly the same points.
    #: Precision "tf32x3": (B, n, 2d) float16 parts [hi | lo] with hi + lo = x / kscale to
    #: 22 bits (``split_half``); ``x`` keeps the float32 points.
    xk: torch.Tensor | None = None
    kscale: float = 1.0
    #: Some weights are zero. Such points carry no mass, so the iteration never corrects
    #: their potentials; the solver sets them from the final soft-min (solvers/loop.py).
    has_null: bool = False
    #: Kernel cost on these (transformed) points: "sqeuclidean" (‖r − c‖²) or "euclidean"
    #: (sqrt(max(‖r − c‖², sq_floor))); see flashsinkhorn/costs.py. "matrix": a given cost
    #: matrix, ``x`` then holds this side's rows of it (backends/matrix.py).
    cost: str = "sqeuclidean"
    #: (B, n) int32 labels of these points, or None (no label term).
    labels: torch.Tensor | None = None
    #: (V, V) label cost already multiplied by label_weight, oriented with this side's labels
    #: as the first index (the y side holds the transpose), potential dtype; or None.
    lcost: torch.Tensor | None = None
    #: Floor of the squared distance under the square root of the euclidean cost (GeomLoss
    #: p=1 uses 1e-8); 0 for the functional API.
    sq_floor: float = 0.0
    #: (B, d) weighted mean Σ w x / Σ w of the centred points before any float16 rounding,
    #: potential dtype; None where the side was not built by ``prepare`` (:func:`side_mean`).
    mean: torch.Tensor | None = None
    #: The mass the soft-mins and the dual value attribute to this side's weights (its
    #: nominal mass): exactly 1 with ``unit_mass`` (uniform weights), else the sum of
    #: ``mass_of`` (the x side's weights, for the y side of a balanced problem), else the
    #: weights' own sum. Float sums differ from it by rounding, which eps multiplies at large
    #: eps (docs/precision.md). Flags and the other side's tensor, not a new tensor: the
    #: solve-graph keys (solvers/graphs.py) hold every tensor field's address.
    unit_mass: bool = False
    mass_of: torch.Tensor | None = None
    #: eps from which the soft-min with this side as the rows uses the expansion about the
    #: mean score (limits.py, docs/precision.md); inf: never.
    large_eps: float = math.inf

    @property
    def n(self) -> int:
        return self.x.shape[1]

    @property
    def split(self) -> bool:
        """True when ``xk`` holds float16 hi/lo parts (precision "tf32x3")."""
        return self.xk is not None and self.xk.shape[-1] == 2 * self.x.shape[-1]

    @property
    def mass(self) -> torch.Tensor:
        """(B,) total mass of the weights."""
        return self.w.sum(-1)

    @property
    def nominal_mass(self) -> torch.Tensor:
        """(B,) the mass attributed to this side (see ``unit_mass``)."""
        if self.unit_mass:
            return torch.ones_like(self.w[:, 0])
        return (self.w if self.mass_of is None else self.mass_of).sum(-1)

    @property
    def renormalised(self) -> bool:
        """The nominal mass is not the weights' own sum."""
        return self.unit_mass or self.mass_of is not None

    def damping(self, eps: float) -> float:
        """Factor λ = 1 / (1 + eps / rho) applied to the soft-min (1 for a balanced side)."""
        return 1.0 if self.rho is None else 1.0 / (1.0 + eps / self.rho)


def stackable(sides: list[Side]) -> bool:
    """Whether sides can be concatenated along the batch (:func:`stack_sides`): the same
    number of points, dtype, operand format and scale, relaxation, cost, and no label term."""
    s0 = sides[0]
    return all(
        s.x.shape[1:] == s0.x.shape[1:]
        and s.x.dtype == s0.x.dtype
        and (s.xk is None) == (s0.xk is None)
        and (s.xk is None or s.xk.shape[1:] == s0.xk.shape[1:])
        and s.rho == s0.rho
        and s.kscale == s0.kscale
        and s.cost == s0.cost
        and s.sq_floor == s0.sq_floor
        and s.large_eps == s0.large_eps
        and s.labels is None
        for s in sides
    )


def stack_sides(sides: list[Side]) -> Side:
    """The sides of several problems as one batch (B₁ + B₂ + …, n, d): one launch then
    serves all of them (the terms of a divergence). Requires :func:`stackable`."""
    if not stackable(sides):
        raise ValueError("sides of different shapes, formats or costs cannot be stacked")

    def cat(name):
        ts = [getattr(s, name) for s in sides]
        return None if ts[0] is None else torch.cat(ts, 0)

    return replace(
        sides[0],
        x=cat("x"),
        sq=cat("sq"),
        w=cat("w"),
        logw=cat("logw"),
        xk=cat("xk"),
        mean=cat("mean") if all(s.mean is not None for s in sides) else None,
        has_null=any(s.has_null for s in sides),
        # nominal masses (Side.nominal_mass) stay per problem
        unit_mass=all(s.unit_mass for s in sides),
        mass_of=None,
    )


@dataclass(frozen=True)
class Stats:
    """Host statistics of a prepared problem, over every problem of the batch.

    Attributes:
        amax: largest |coordinate| of the centred points (inf when one is not finite).
        box2: largest squared diagonal of the bounding box of both clouds of one problem.
        mass: largest total mass of a weight vector.
        sq_max: largest squared norm of a centred point, or None when not computed (the fused
            path reads it only when needed, limits.py).
        live: (bounding-box diagonal², largest squared norm) of the points that carry mass,
            where the builder of the problem knows them: a sharded problem reduces them over
            its ranks, since its sides hold one rank's points only. None: limits.py computes
            them from the sides when some weights are zero.
    """

    amax: float
    box2: float
    mass: float
    sq_max: float | None = None
    live: tuple[float, float] | None = None


def side_mean(side: Side) -> torch.Tensor:
    """(B, d) weighted mean of a side's centred points: ``side.mean`` where ``prepare`` set it
    (no pass over the points), else computed from ``side.x``."""
    if side.mean is not None:
        return side.mean
    w = side.w / side.w.sum(-1, keepdim=True)
    return (w[..., None] * side.x.to(w.dtype)).sum(1)


@dataclass(frozen=True)
class Problem:
    """An entropic OT problem in canonical batched form.

    The cost is C_ij = ‖x_i − y_j‖² by default; ``X.cost``/``X.labels`` (the same on both
    sides) select the euclidean kernel cost and the label term (flashsinkhorn/costs.py).
    """

    X: Side
    Y: Side
    batched: bool
    precision: str
    # (B, d) joint weighted mean subtracted from both clouds (potential dtype); maps results
    # that live in point space (barycentric map) back to the caller's coordinates.
    centre: torch.Tensor | None = None
    #: What ``prepare`` read back in its synchronisation (host floats; None where unknown):
    #: the range checks and the choice of soft-min (limits.py) use them.
    stats: Stats | None = None

    @property
    def diameter(self) -> float | None:
        """Diagonal of the bounding box of both clouds (the largest over a batch), read with
        ``prepare``'s statistics; None where unknown or not finite."""
        if self.stats is None or not math.isfinite(self.stats.box2):
            return None
        return math.sqrt(self.stats.box2)

    @property
    def B(self) -> int:
        return self.X.x.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.X.sq.dtype

    @property
    def device(self) -> torch.device:
        return self.X.x.device

    @property
    def cost(self) -> str:
        """Kernel cost: "sqeuclidean" or "euclidean"."""
        return self.X.cost

    @property
    def has_labels(self) -> bool:
        return self.X.labels is not None

    @property
    def default_cost(self) -> bool:
        """True for the plain ‖x − y‖² cost (no euclidean kernel, no label term)."""
        return self.X.cost == "sqeuclidean" and self.X.labels is None

    def transposed(self) -> Problem:
        """The same problem with the roles of x and y exchanged."""
        return replace(self, X=self.Y, Y=self.X)

    def unbatch(self, t: torch.Tensor) -> torch.Tensor:
        """Drops the batch axis of a (B, ...) result when the inputs were not batched."""
        return t if self.batched else t[0]


@dataclass(frozen=True)
class SelfTerms:
    """The self problems OT(x, x) and OT(y, y) of a joint problem (a debiased divergence).

    Each uses a side of the joint problem on both ends, so it shares its centring, operand
    scale and large-eps threshold: a *self problem* of the loop (``X is Y``: one potential,
    one soft-min per iteration). With an asymmetric label cost W the self costs are not
    symmetric, and the two are two-potential problems instead.

    Attributes:
        xx: the problem of OT(x, x).
        yy: the problem of OT(y, y).
        both: xx and yy stacked into one batch of 2B self problems (one launch per
            iteration for both) when their sides stack, else None.
    """

    xx: Problem
    yy: Problem
    both: Problem | None

    def part(self, t: torch.Tensor, k: int) -> torch.Tensor:
        """Rows of problem ``k`` (0: xx, 1: yy) of a (2B, ...) tensor of ``both``."""
        B = self.xx.B
        return t[k * B : (k + 1) * B]


def self_terms(problem: Problem) -> SelfTerms:
    """The self terms of ``problem`` (:class:`SelfTerms`): the one place they are built."""
    X, Y = problem.X, problem.Y
    if X.lcost is not None and not torch.equal(X.lcost, X.lcost.transpose(0, 1)):
        # An asymmetric label cost makes the self terms' costs asymmetric: their plans are
        # not symmetric and they keep two potentials (each side's lcost is oriented with its
        # own labels first: X holds W, Y holds Wᵀ).
        px = replace(problem, Y=replace(X, lcost=Y.lcost))
        py = replace(problem, X=replace(Y, lcost=X.lcost))
        return SelfTerms(px, py, None)
    if Y.lcost is not None:
        Y = replace(Y, lcost=X.lcost)  # W = Wᵀ: one object for both orientations
    px = replace(problem, X=X, Y=X)
    py = replace(problem, X=Y, Y=Y)
    if not stackable([X, Y]):
        return SelfTerms(px, py, None)
    Z = stack_sides([X, Y])
    centre = None if problem.centre is None else problem.centre.repeat(2, 1)
    return SelfTerms(px, py, Problem(Z, Z, True, problem.precision, centre))


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Rounds float32 values to the nearest TF32 value (10 explicit mantissa bits)."""
    if x.dtype != torch.float32:
        return x
    i = x.contiguous().view(torch.int32)
    # Round half away from zero on the 13 dropped bits, then clear them.
    i = (i + 0x1000) & ~0x1FFF
    return i.view(torch.float32)


def round_to_half_grid(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds float32 points to the float16 grid scaled by ``scale``.

    Returns ``(x_rounded, x_half)`` with ``x_rounded == x_half * scale`` exactly. Values on this
    grid have at most 11 significant bits, like TF32, so tensor-core products of them are exact
    in either format, and norms computed from ``x_rounded`` describe the same points as the dot
    products. The float16 copy halves the kernels' operand bytes and doubles the tensor-core
    rate; its absolute rounding error is at most 2^-11 relative to the point's largest
    coordinate and 2^-25 of ``scale`` for tiny coordinates.
    """
    half = (x / scale).to(torch.float16)
    return half.to(torch.float32) * scale, half.contiguous()


#: The split scale puts max |coordinate| / kscale in (2^13, 2^14]: the high parts stay below
#: float16's 65504 and the low parts (about 2^-11 of the high ones) stay normal for every
#: coordinate above 2^-17 of the largest.
SPLIT_HEADROOM = 2.0**14


def kernel_scale(precision: str, amax: float) -> float:
    """``kscale`` of the float16 kernel operands for the largest |centred coordinate| amax."""
    if not amax > 0 or not math.isfinite(amax) or precision not in ("tf32", "tf32x3"):
        return 1.0
    s = 2.0 ** math.ceil(math.log2(amax))
    # Below 2^-126 the split scale would be a float32 subnormal and, under 2^-149, zero (x/0:
    # NaN parts). Points that small have squared distances that underflow anyway.
    return s if precision == "tf32" else max(s / SPLIT_HEADROOM, 2.0**-126)


def split_half(x: torch.Tensor, scale: float) -> torch.Tensor:
    """(…, 2d) float16 [hi | lo] with hi + lo = x / scale to 22 significant bits.

    hi is x / scale rounded to float16 and lo the float16 rounding of the exact float32
    remainder, as TF32x3 splits its operands: tensor-core products hi·hi + hi·lo + lo·hi give
    x·y to about 2^-22 relative (the dropped lo·lo is 2^-22 of the product), at the float16
    rate and with the bytes of the float32 points.
    """
    xs = x.to(torch.float32) / scale
    hi = xs.to(torch.float16)
    lo = (xs - hi.to(torch.float32)).to(torch.float16)
    return torch.cat([hi, lo], -1).contiguous()


def _batched(t: torch.Tensor, batched: bool) -> torch.Tensor:
    return t if batched else t.unsqueeze(0)


def _weights(w: torch.Tensor | None, B: int, n: int, like: torch.Tensor, dtype) -> torch.Tensor:
    if w is None:
        return torch.full((B, n), 1.0 / n, dtype=dtype, device=like.device)
    w = w.to(dtype)
    return w.expand(B, n).contiguous() if w.dim() == 1 else w.contiguous()


def prepare(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    *,
    rho_x: float | None,
    rho_y: float | None,
    precision: str,
    check_finite: bool = True,
    cost: str = "sqeuclidean",
    labels: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    sq_floor: float = 0.0,
    sides: SidesFn | None = None,
) -> Problem:
    """Validates the clouds and weights and builds the canonical :class:`Problem`.

    Args:
        x: (n, d) or (B, n, d) source points.
        y: (m, d) or (B, m, d) target points.
        a: weights of x, (n,), (B, n) or None for uniform 1/n.
        b: weights of y, (m,), (B, m) or None for uniform 1/m.
        rho_x: KL relaxation of the x marginal, None for balanced.
        rho_y: KL relaxation of the y marginal, None for balanced.
        precision: the resolved precision ("ieee", "tf32" or "tf32x3"); "tf32" rounds the
            centred points to the 11-bit grid of TF32/float16 (see ``round_to_half_grid``).
        check_finite: check points and weights for NaN/inf (one device synchronisation).
        cost: kernel cost of the (already transformed) points, "sqeuclidean" or "euclidean".
        labels: ``(label_x, label_y, W)`` with labels (n,)/(B, n) and (m,)/(B, m), already
            validated (``costs.check_cost``), and W (V, V) already multiplied by
            label_weight; or None.
        sq_floor: floor of the squared distance of the euclidean cost.
        sides: a backend's implementation of the arithmetic (``backends.prepare_sides``):
            called as ``sides(X, Y, a, b, rho_x, rho_y, precision, checks)`` on the batched
            clouds, it returns ``(side_x, side_y, centre, stats)``; None uses torch operations.

    Returns:
        The problem with centred points; the caller's tensors are not modified.
    """
    V.check_points("x", x)
    V.check_points("y", y)
    V.check_pair(x, y)
    a = V.check_weights("a", a, x)
    b = V.check_weights("b", b, y)
    batched = x.dim() == 3
    X = _batched(x.detach(), batched)
    Y = _batched(y.detach(), batched)
    B, n, _ = X.shape
    m = Y.shape[1]
    # Potentials and reductions in fp32 at least; the points keep a half dtype for the kernels.
    pdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    scaled = X.dtype == torch.float32 and precision in ("tf32", "tf32x3")
    balanced = rho_x is None and rho_y is None
    # Value checks: float64 weights are often float32 ones upcast, so allow their rounding.
    checks = Checks(
        a is not None, b is not None, balanced, scaled or check_finite, check_finite,
        1e-6 if pdtype == torch.float64 else 1e-4,
    )  # fmt: skip
    if sides is not None:
        side_x, side_y, centre, stats = sides(X, Y, a, b, rho_x, rho_y, precision, checks)
    else:
        wa = _weights(a, B, n, X, pdtype)
        wb = _weights(b, B, m, Y, pdtype)
        side_x, side_y, centre, stats = _prepare_torch(
            X, Y, wa, wb, rho_x, rho_y, precision, checks
        )
    # Uniform weights have mass exactly 1, not the rounded sum of n copies of 1/n; one mass
    # for both sides of a balanced problem, whose sums differ by rounding only (checked above).
    side_x = replace(side_x, unit_mass=a is None)
    side_y = replace(side_y, unit_mass=b is None)
    if balanced:
        side_y = replace(side_y, unit_mass=a is None, mass_of=None if a is None else side_x.w)
    if cost != "sqeuclidean" or labels is not None:
        side_x, side_y = _with_cost(side_x, side_y, cost, labels, sq_floor, B, pdtype)
    return Problem(side_x, side_y, batched, precision, centre, stats)


@dataclass(frozen=True)
class Checks:
    """What the value checks of ``prepare`` look at: given weights, their mass gap (balanced
    problems with a given weight vector) and the largest centred coordinate (finiteness of
    the points, and the float16 operand scale)."""

    has_a: bool
    has_b: bool
    balanced: bool
    amax: bool
    #: raise for NaN/inf points (``prepare``'s check_finite)
    finite: bool
    #: largest relative mass gap of a balanced problem
    rtol: float

    @property
    def names(self) -> list[str]:
        return [nm for nm, g in (("a", self.has_a), ("b", self.has_b)) if g]

    @property
    def gap(self) -> bool:
        return self.balanced and (self.has_a or self.has_b)

    @property
    def any(self) -> bool:
        return bool(self.names) or self.amax


def check_values(per: dict, gap: float, amax: float, checks: Checks, X, Y) -> None:
    """Raises for invalid weights or points from the statistics read in one synchronisation.

    ``per`` maps a given weight's name to (min, max, smallest total mass over the batch); a
    NaN weight makes its min NaN.
    """
    for nm, (lo, _, _) in per.items():
        if lo < 0:
            raise ValueError(f"{nm} must be non-negative")
    for nm, (lo, hi, _) in per.items():
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError(f"{nm} must be finite")
    if checks.finite and not math.isfinite(amax):
        # say which cloud
        for name, t in (("x", X), ("y", Y)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} must not contain NaN or inf")
    for nm, (_, _, mass_min) in per.items():
        if not mass_min > 0:
            raise ValueError(f"{nm} must have a positive total mass (all weights are zero)")
    if checks.gap and gap > checks.rtol:
        raise ValueError(
            "a and b must have equal total mass in a balanced problem "
            f"(relative gap {gap:.2e} > {checks.rtol:g}); normalise them or pass rho_x/rho_y "
            "for an unbalanced problem"
        )


def _prepare_torch(X, Y, wa, wb, rho_x, rho_y, precision, checks: Checks):
    """The sides and centre with torch operations (any device and dtype)."""
    pdtype = wa.dtype
    ma, mb = wa.sum(-1), wb.sum(-1)
    # Translation invariance: centre at the joint weighted mean so that fp32 norms stay accurate.
    Xc = X.to(pdtype)
    Yc = Y.to(pdtype)
    # The sums in float64, rounded once: the centre is then the same whatever the summation
    # order (the Triton prepare kernels, the ranks of a sharded problem).
    f64 = torch.float64
    sum_x = torch.einsum("bn,bnd->bd", wa.to(f64), Xc.to(f64))
    sum_y = torch.einsum("bm,bmd->bd", wb.to(f64), Yc.to(f64))
    ma64, mb64 = wa.to(f64).sum(-1), wb.to(f64).sum(-1)
    centre = ((sum_x + sum_y) / (ma64 + mb64).unsqueeze(-1)).to(pdtype)
    mean_x = (sum_x / ma64.unsqueeze(-1) - centre.to(f64)).to(pdtype)
    mean_y = (sum_y / mb64.unsqueeze(-1) - centre.to(f64)).to(pdtype)
    Xc = Xc - centre[:, None, :]
    Yc = Yc - centre[:, None, :]

    # Value checks in one synchronisation, from a few reductions. Uniform weights (a or b None)
    # are built here and need none. A given weight vector contributes its minimum and maximum
    # (negative: min < 0; NaN or inf: a non-finite min or max; zero weights: min == 0) and its
    # smallest total mass. The points' finiteness rides on the largest |centred coordinate|, a
    # NaN or inf anywhere makes it non-finite; with "tf32"/"tf32x3" it also sets the operand
    # scale. (Invalid weights make the centre meaningless, but nothing is used before the
    # checks pass.)
    given = [(nm, w, mw) for nm, w, mw in (("a", wa, ma), ("b", wb, mb)) if nm in checks.names]
    stats: list[torch.Tensor] = []
    for _, w, mw in given:
        stats += [*torch.aminmax(w), mw.min()]
    if checks.gap:
        stats.append(((ma - mb).abs() / torch.maximum(ma, mb)).max())
    # The scale statistics of the range checks (limits.py) ride on the same synchronisation:
    # largest centred coordinate, bounding-box diagonal², largest mass and squared norm.
    lo = torch.minimum(Xc.amin(1), Yc.amin(1))
    hi = torch.maximum(Xc.amax(1), Yc.amax(1))
    sq_max = torch.maximum((Xc * Xc).sum(-1).max(), (Yc * Yc).sum(-1).max())
    stats += [torch.maximum(Xc.abs().max(), Yc.abs().max()), ((hi - lo) ** 2).sum(-1).max()]
    stats += [torch.maximum(ma.max(), mb.max()), sq_max]
    vals = torch.stack([t.to(pdtype) for t in stats]).tolist()
    wvals, rest = vals[: 3 * len(given)], vals[3 * len(given) :]
    per = {nm: wvals[3 * k : 3 * k + 3] for k, (nm, _, _) in enumerate(given)}
    amax = rest[-4]
    gap = rest[0] if checks.gap else 0.0
    check_values(per, gap, amax, checks, X, Y)
    scale_stats = Stats(amax, rest[-3], rest[-2], rest[-1])
    # Zero-weight points (see Side.has_null).
    null_a = "a" in per and per["a"][0] == 0
    null_b = "b" in per and per["b"][0] == 0
    scaled = X.dtype == torch.float32 and precision in ("tf32", "tf32x3")
    kscale = kernel_scale(precision, amax) if scaled else 1.0
    side_x = centred_side(Xc, X.dtype, wa, rho_x, precision, kscale, null_a, mean_x)
    side_y = centred_side(Yc, X.dtype, wb, rho_y, precision, kscale, null_b, mean_y)
    return side_x, side_y, centre, scale_stats


def centred_side(
    xc: torch.Tensor,
    in_dtype: torch.dtype,
    w: torch.Tensor,
    rho: float | None,
    precision: str,
    kscale: float,
    has_null: bool,
    mean: torch.Tensor | None = None,
) -> Side:
    """The :class:`Side` of centred points ``xc`` (potential dtype), as the kernels read them.

    Precision "tf32" on float32 input rounds the points to the float16 grid of ``kscale``;
    "tf32x3" adds float16 hi/lo parts of the unrounded points (``split_half``); half-precision
    input stays half (fp32 accumulation in the kernels). Norms are always those of the points
    the kernels will read.
    """
    xk = None
    if precision == "tf32" and in_dtype == torch.float32:
        xc, xk = round_to_half_grid(xc, kscale)
    elif precision == "tf32x3" and in_dtype == torch.float32:
        xk = split_half(xc, kscale)
    sq = (xc * xc).sum(-1)
    if in_dtype in (torch.float16, torch.bfloat16):
        xc = xc.to(in_dtype)
        sq = xc.to(w.dtype).pow(2).sum(-1)
    return Side(xc.contiguous(), sq.contiguous(), w, w.log(), rho, xk, kscale, has_null,
                mean=mean)  # fmt: skip


def _with_cost(side_x: Side, side_y: Side, cost, labels, sq_floor, B, pdtype):
    """Attaches the kernel cost and the label term (int32 labels, oriented W) to both sides."""
    extra = {"cost": cost, "sq_floor": float(sq_floor)}
    if labels is None:
        return replace(side_x, **extra), replace(side_y, **extra)
    lx, ly, W = labels
    n, m = side_x.n, side_y.n
    lx = lx.to(torch.int32).expand(B, n).contiguous()
    ly = ly.to(torch.int32).expand(B, m).contiguous()
    W = W.detach().to(pdtype)
    side_x = replace(side_x, labels=lx, lcost=W.contiguous(), **extra)
    side_y = replace(side_y, labels=ly, lcost=W.transpose(0, 1).contiguous(), **extra)
    return side_x, side_y
