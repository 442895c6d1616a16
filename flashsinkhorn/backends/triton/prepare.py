"""The canonical problem of float32 clouds in three launches (problem.prepare's fast path).

``problem.prepare`` centres both clouds at their joint weighted mean, checks the weights and
points, picks the float16 operand scale from the largest centred coordinate and writes the
kernel operands, norms and log-weights. In torch that is ~40 small launches and ~0.5 ms of host
work, as long as the whole 10-iteration solve at n = m = 10⁴ on the GPU. Here it is:

1. ``_prepare_stats_kernel``: per block of rows, the weighted coordinate sums, the per-feature
   minimum and maximum of the points, and the mass, minimum, maximum and NaN count of the
   weights (partials, no atomics: the result does not depend on scheduling);
2. ``_prepare_reduce_kernel``: per problem, the centre, each side's weighted mean after
   centring (``Side.mean``, for the plan step's first shift) and the value statistics the
   caller reads back in its one synchronisation. The largest centred coordinate is
   max_k max(max_i x_ik − c_k, c_k − min_i x_ik), exactly the maximum of |x_ik − c_k| since
   rounding is monotonic; a NaN or inf point makes it inf;
3. ``_prepare_side_kernel``: centred points, their float16 grid copy ("tf32") or hi/lo parts
   ("tf32x3"), squared norms, weights and log-weights.

The results equal the torch path's up to the rounding of the centre (a different summation
order), which can move a coordinate by one float16 step of the grid where it lies on a
rounding boundary (tests/test_prepare_fused.py).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..._cuda_graph import GraphCache, runtime, runtimes, tensor_key
from ..._triton_launch import FP_FUSION, cdiv, launch, precompile_once
from ...tuning import TUNING
from .configs import PREPARE_BLOCK, PREPARE_BLOCK_P, prepare_block_d

#: Precision codes of the side kernel: exact points, the float16 grid, float16 hi/lo parts.
_PRECISIONS = {"ieee": 0, "tf32": 1, "tf32x3": 2}
#: Values per problem in the statistics vector (see ``stats``; _prepare_reduce_kernel writes
#: exactly these ten, in that order).
N_STATS = 10


@triton.jit
def _stats_rows(
    P, W, Pw, Pmin, Pmax, Ps, i_b, i_m, i_p, n, d, n_prog, s_b, s_n, s_d, s_wb, s_wn, inv_n,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr,
):  # fmt: skip
    o_m = i_m * BLOCK + tl.arange(0, BLOCK)
    m_m = o_m < n
    i_b64 = i_b.to(tl.int64)
    if HAS_W:
        b_w = tl.load(W + i_b64 * s_wb + o_m.to(tl.int64) * s_wn, mask=m_m, other=0.0)
        b_w = b_w.to(tl.float32)
    else:
        b_w = tl.where(m_m, inv_n, 0.0)
    # A NaN weight is counted, not compared: min/max do not promise to propagate it.
    b_nan = tl.sum((m_m & (b_w != b_w)).to(tl.float32), 0)
    b_wok = m_m & (b_w == b_w)
    o_s = (i_b64 * n_prog + i_p) * 4
    # Masses and weighted sums in float64 (Ps, Pw): the centre rounded to float32 is then the
    # same whatever the summation order, as on another device or over ranks (distributed).
    tl.store(Ps + o_s, tl.sum(tl.where(b_wok, b_w, 0.0).to(tl.float64), 0))
    tl.store(Ps + o_s + 1, tl.min(tl.where(b_wok, b_w, float("inf")), 0))
    tl.store(Ps + o_s + 2, tl.max(tl.where(b_wok, b_w, float("-inf")), 0))
    tl.store(Ps + o_s + 3, b_nan)
    o_row = (i_b64 * n_prog + i_p) * d
    p_x = P + i_b64 * s_b + o_m.to(tl.int64)[:, None] * s_n
    for d0 in range(0, d, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < d
        m_x = m_m[:, None] & m_d[None, :]
        b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * s_d, mask=m_x, other=0.0)
        b_wx = b_w.to(tl.float64)[:, None] * b_x.to(tl.float64)
        tl.store(Pw + o_row + o_d, tl.sum(b_wx, 0), mask=m_d)
        # NaN counts as -inf for the minimum and +inf for the maximum: the centred maximum
        # becomes inf, which the caller reads as "some point is not finite".
        b_ok = m_x & (b_x == b_x)
        b_lo = tl.where(b_ok, b_x, tl.where(m_x, float("-inf"), float("inf")))
        b_hi = tl.where(b_ok, b_x, tl.where(m_x, float("inf"), float("-inf")))
        tl.store(Pmin + o_row + o_d, tl.min(b_lo, 0), mask=m_d)
        tl.store(Pmax + o_row + o_d, tl.max(b_hi, 0), mask=m_d)


# Arguments that change with n or m: not specialised, so a new size compiles nothing.
_DYNAMIC = ["n_x", "n_y", "n_bx", "n_prog", "s_xb", "s_yb", "s_ab", "s_bb"]


@triton.jit(do_not_specialize=_DYNAMIC)
def _prepare_stats_kernel(
    X, Y, A, Bw, Pw, Pmin, Pmax, Ps, n_x, n_y, d, n_bx, n_prog,
    s_xb, s_xn, s_xd, s_yb, s_yn, s_yd, s_ab, s_an, s_bb, s_bn, inv_nx, inv_ny,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_A: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    # Program i_p < n_bx: rows i_p·BLOCK… of x; otherwise rows of y. One partial row each.
    i_p = tl.program_id(0)
    i_b = tl.program_id(1)
    if i_p < n_bx:
        _stats_rows(X, A, Pw, Pmin, Pmax, Ps, i_b, i_p, i_p, n_x, d, n_prog,
                    s_xb, s_xn, s_xd, s_ab, s_an, inv_nx, BLOCK, BLOCK_D, HAS_A)  # fmt: skip
    else:
        _stats_rows(Y, Bw, Pw, Pmin, Pmax, Ps, i_b, i_p - n_bx, i_p, n_y, d, n_prog,
                    s_yb, s_yn, s_yd, s_bb, s_bn, inv_ny, BLOCK, BLOCK_D, HAS_B)  # fmt: skip


@triton.jit
def _mass_stats(Ps, i_b64, p_lo, p_hi, n_prog, BLOCK_P: tl.constexpr):
    # (mass (float64), min, max, NaN count) of one side's weights from its programs
    # [p_lo, p_hi).
    b_sum = tl.zeros([BLOCK_P], tl.float64)
    b_min = tl.full([BLOCK_P], float("inf"), tl.float32)
    b_max = tl.full([BLOCK_P], float("-inf"), tl.float32)
    b_nan = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(p_lo, p_hi, BLOCK_P):
        o_p = p0 + tl.arange(0, BLOCK_P)
        m_p = o_p < p_hi
        o_s = (i_b64 * n_prog + o_p) * 4
        b_sum += tl.load(Ps + o_s, mask=m_p, other=0.0)
        b_lo = tl.load(Ps + o_s + 1, mask=m_p, other=float("inf")).to(tl.float32)
        b_hi = tl.load(Ps + o_s + 2, mask=m_p, other=float("-inf")).to(tl.float32)
        b_min = tl.minimum(b_min, b_lo)
        b_max = tl.maximum(b_max, b_hi)
        b_nan += tl.load(Ps + o_s + 3, mask=m_p, other=0.0).to(tl.float32)
    return tl.sum(b_sum, 0), tl.min(b_min, 0), tl.max(b_max, 0), tl.sum(b_nan, 0)


@triton.jit(do_not_specialize=["n_bx", "n_prog"])
def _prepare_reduce_kernel(
    Pw, Pmin, Pmax, Ps, Centre, Means, Stats, d, n_bx, n_prog, s_mean,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, N_ST: tl.constexpr,
):  # fmt: skip
    # One program per problem: Stats[b] = (min a, max a, mass a, min b, max b, mass b,
    # max |x - centre| over both clouds, NaN count of a, of b, squared diagonal of the bounding
    # box of both clouds); Centre[b] = joint weighted mean;
    # Means[b], Means[b] + s_mean = weighted means of the centred x and y clouds.
    i_b = tl.program_id(0)
    i_b64 = i_b.to(tl.int64)
    ma, mina, maxa, nana = _mass_stats(Ps, i_b64, 0, n_bx, n_prog, BLOCK_P)
    mb, minb, maxb, nanb = _mass_stats(Ps, i_b64, n_bx, n_prog, n_prog, BLOCK_P)
    mass = ma + mb
    b_amax = tl.zeros([BLOCK_D], tl.float32)
    b_box = tl.zeros([BLOCK_D], tl.float32)
    b_bad = tl.zeros([BLOCK_D], tl.int32)
    for d0 in range(0, d, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < d
        b_s = tl.zeros([BLOCK_P, BLOCK_D], tl.float64)
        b_sx = tl.zeros([BLOCK_P, BLOCK_D], tl.float64)
        b_sy = tl.zeros([BLOCK_P, BLOCK_D], tl.float64)
        b_lo = tl.full([BLOCK_P, BLOCK_D], float("inf"), tl.float32)
        b_hi = tl.full([BLOCK_P, BLOCK_D], float("-inf"), tl.float32)
        for p0 in range(0, n_prog, BLOCK_P):
            o_p = p0 + tl.arange(0, BLOCK_P)
            m = (o_p < n_prog)[:, None] & m_d[None, :]
            o = (i_b64 * n_prog + o_p.to(tl.int64))[:, None] * d + o_d[None, :]
            b_pw = tl.load(Pw + o, mask=m, other=0.0)
            b_s += b_pw
            # each side's own sum (not total − x): ȳ keeps its accuracy when Σb ≪ Σa
            b_sx += tl.where((o_p < n_bx)[:, None], b_pw, 0.0)
            b_sy += tl.where((o_p >= n_bx)[:, None], b_pw, 0.0)
            b_lo = tl.minimum(b_lo, tl.load(Pmin + o, mask=m, other=float("inf")))
            b_hi = tl.maximum(b_hi, tl.load(Pmax + o, mask=m, other=float("-inf")))
        # The float64 mean, rounded once to the float32 centre the points are shifted by.
        b_c = (tl.sum(b_s, 0) / mass).to(tl.float32)
        b_c64 = b_c.to(tl.float64)
        tl.store(Centre + i_b64 * d + o_d, b_c, mask=m_d)
        tl.store(Means + i_b64 * d + o_d, (tl.sum(b_sx, 0) / ma - b_c64).to(tl.float32),
                 mask=m_d)  # fmt: skip
        tl.store(Means + s_mean + i_b64 * d + o_d, (tl.sum(b_sy, 0) / mb - b_c64).to(tl.float32),
                 mask=m_d)  # fmt: skip
        b_lo1 = tl.min(b_lo, 0)
        b_hi1 = tl.max(b_hi, 0)
        b_dev = tl.maximum(b_hi1 - b_c, b_c - b_lo1)
        b_amax = tl.maximum(b_amax, tl.where(m_d, b_dev, 0.0))
        b_box += tl.where(m_d, (b_hi1 - b_lo1) * (b_hi1 - b_lo1), 0.0)
        # Non-finite extremes or centre: some point is NaN or inf. Tested explicitly, since
        # tl.maximum need not propagate a NaN.
        b_fin = (b_c == b_c) & (tl.abs(b_c) < float("inf")) & (b_lo1 > float("-inf"))
        b_fin = b_fin & (b_hi1 < float("inf")) & (b_dev == b_dev)
        b_bad = tl.maximum(b_bad, (m_d & (b_fin == 0)).to(tl.int32))
    amax = tl.max(b_amax, 0)
    amax = tl.where(tl.max(b_bad, 0) > 0, float("inf"), amax)
    o_s = i_b64 * N_ST
    tl.store(Stats + o_s, mina)
    tl.store(Stats + o_s + 1, maxa)
    tl.store(Stats + o_s + 2, ma.to(tl.float32))
    tl.store(Stats + o_s + 3, minb)
    tl.store(Stats + o_s + 4, maxb)
    tl.store(Stats + o_s + 5, mb.to(tl.float32))
    tl.store(Stats + o_s + 6, amax)
    tl.store(Stats + o_s + 7, nana)
    tl.store(Stats + o_s + 8, nanb)
    tl.store(Stats + o_s + 9, tl.sum(b_box, 0))


@triton.jit
def _side_rows(
    P, W, Centre, Out, K, Sq, Wout, Logw, i_b, i_m, n, d, s_b, s_n, s_d, s_wb, s_wn,
    scale, inv_scale, inv_n, log_inv_n,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, HAS_W: tl.constexpr,
    WRITE_W: tl.constexpr,
):  # fmt: skip
    o_m = i_m * BLOCK + tl.arange(0, BLOCK)
    m_m = o_m < n
    i_b64 = i_b.to(tl.int64)
    o_m64 = o_m.to(tl.int64)
    o_row = i_b64 * n + o_m64  # (B, n) outputs, contiguous
    p_x = P + i_b64 * s_b + o_m64[:, None] * s_n
    b_sq = tl.zeros([BLOCK], tl.float32)
    for d0 in range(0, d, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m_d = o_d < d
        m_x = m_m[:, None] & m_d[None, :]
        b_c = tl.load(Centre + i_b64 * d + o_d, mask=m_d, other=0.0)
        b_x = tl.load(p_x + o_d.to(tl.int64)[None, :] * s_d, mask=m_x, other=0.0) - b_c[None, :]
        if PRECISION == 1:
            # The float16 grid of `scale`: x = h · scale exactly (problem.round_to_half_grid).
            b_h = (b_x * inv_scale).to(tl.float16)
            b_x = b_h.to(tl.float32) * scale
            tl.store(K + o_row[:, None] * d + o_d[None, :], b_h, mask=m_x)
        elif PRECISION == 2:
            # float16 [hi | lo] parts of x / scale (problem.split_half).
            b_xs = b_x * inv_scale
            b_hi = b_xs.to(tl.float16)
            b_lo = (b_xs - b_hi.to(tl.float32)).to(tl.float16)
            p_k = K + o_row[:, None] * (2 * d) + o_d[None, :]
            tl.store(p_k, b_hi, mask=m_x)
            tl.store(p_k + d, b_lo, mask=m_x)
        tl.store(Out + o_row[:, None] * d + o_d[None, :], b_x, mask=m_x)
        b_sq += tl.sum(b_x * b_x, 1)
    tl.store(Sq + o_row, b_sq, mask=m_m)
    if HAS_W:
        b_w = tl.load(W + i_b64 * s_wb + o_m64 * s_wn, mask=m_m, other=1.0).to(tl.float32)
        if WRITE_W:
            tl.store(Wout + o_row, b_w, mask=m_m)
        tl.store(Logw + o_row, tl.log(b_w), mask=m_m)
    else:
        tl.store(Wout + o_row, tl.zeros([BLOCK], tl.float32) + inv_n, mask=m_m)
        tl.store(Logw + o_row, tl.zeros([BLOCK], tl.float32) + log_inv_n, mask=m_m)


@triton.jit(do_not_specialize=[a for a in _DYNAMIC if a != "n_prog"])
def _prepare_side_kernel(
    X, Y, A, Bw, Centre, Xo, Yo, Xk, Yk, Xsq, Ysq, Wa, Wb, La, Lb, n_x, n_y, d, n_bx,
    s_xb, s_xn, s_xd, s_yb, s_yn, s_yd, s_ab, s_an, s_bb, s_bn,
    scale, inv_scale, inv_nx, inv_ny, log_inv_nx, log_inv_ny,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    HAS_A: tl.constexpr, HAS_B: tl.constexpr, WRITE_A: tl.constexpr, WRITE_B: tl.constexpr,
):  # fmt: skip
    i_p = tl.program_id(0)
    i_b = tl.program_id(1)
    if i_p < n_bx:
        _side_rows(X, A, Centre, Xo, Xk, Xsq, Wa, La, i_b, i_p, n_x, d, s_xb, s_xn, s_xd,
                   s_ab, s_an, scale, inv_scale, inv_nx, log_inv_nx,
                   BLOCK, BLOCK_D, PRECISION, HAS_A, WRITE_A)  # fmt: skip
    else:
        _side_rows(Y, Bw, Centre, Yo, Yk, Ysq, Wb, Lb, i_b, i_p - n_bx, n_y, d, s_yb, s_yn,
                   s_yd, s_bb, s_bn, scale, inv_scale, inv_ny, log_inv_ny,
                   BLOCK, BLOCK_D, PRECISION, HAS_B, WRITE_B)  # fmt: skip


@functools.lru_cache(maxsize=64)
def _log_inv(n: int) -> float:
    """ln of float32(1/n), the log-weight of uniform weights."""
    return math.log(float(torch.tensor(1.0 / n, dtype=torch.float32)))


def _weight_args(w: torch.Tensor | None) -> tuple:
    """(tensor, batch stride, point stride) of a (n,) or (B, n) weight vector; a dummy when
    None."""
    if w is None:
        return None, 0, 0
    if w.dim() == 1:
        return w, 0, w.stride(0)
    return w, w.stride(0), w.stride(1)


def stats(X: torch.Tensor, Y: torch.Tensor, a, b, outs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Centre and value statistics of two float32 clouds, without synchronising.

    Args:
        X: (B, n, d) float32 points (any strides).
        Y: (B, m, d) float32 points.
        a: weights of X, (n,) or (B, n) of any float dtype, or None for uniform 1/n.
        b: weights of Y, likewise.
        outs: the buffers of :func:`outputs` (the centre goes to ``outs["centre"]``, the
            weighted means of both clouds after centring to ``outs["means"]``).

    Returns:
        ``(centre, stats)``: (B, d) float32 joint weighted mean, and (B, N_STATS) float32 rows
        (min a, max a, mass a, min b, max b, mass b, max |centred coordinate| (inf when a point
        is NaN or inf), NaN count of a, NaN count of b, squared bounding-box diagonal).
    """
    B, n, d = X.shape
    m = Y.shape[1]
    dev = X.device
    n_bx, n_by = cdiv(n, PREPARE_BLOCK), cdiv(m, PREPARE_BLOCK)
    n_prog = n_bx + n_by
    f32, f64 = torch.float32, torch.float64
    pw, part, ps, st = _carve(dev, [((B, n_prog, d), f64), ((2, B, n_prog, d), f32),
                                    ((B, n_prog, 4), f64), ((B, N_STATS), f32)])  # fmt: skip
    centre, means = outs["centre"], outs["means"]
    wa, s_ab, s_an = _weight_args(a)
    wb, s_bb, s_bn = _weight_args(b)
    bd = prepare_block_d(d)
    launch(_prepare_stats_kernel, (n_prog, B),
        X, Y, wa if wa is not None else ps, wb if wb is not None else ps,
        pw, part[0], part[1], ps, n, m, d, n_bx, n_prog,
        X.stride(0), X.stride(1), X.stride(2), Y.stride(0), Y.stride(1), Y.stride(2),
        s_ab, s_an, s_bb, s_bn, 1.0 / n, 1.0 / m,
        BLOCK=PREPARE_BLOCK, BLOCK_D=bd, HAS_A=wa is not None, HAS_B=wb is not None, **FP_FUSION,
    )  # fmt: skip
    launch(_prepare_reduce_kernel, (B,),
        pw, part[0], part[1], ps, centre, means, st, d, n_bx, n_prog, means.stride(0),
        BLOCK_P=PREPARE_BLOCK_P, BLOCK_D=bd, N_ST=N_STATS, **FP_FUSION,
    )  # fmt: skip
    return centre, st


def outputs(X, Y, a, b, precision: str) -> dict:
    """The buffers the three kernels write, carved from one allocation.

    One block per call (and one for the scratch of :func:`stats`) keeps the caching
    allocator's pattern short and periodic across a training loop's calls, so that the cached
    solve graphs (solvers/graphs.py, keyed on these addresses) keep hitting.

    Returns a dict with ``centre`` (B, d), ``means`` (2, B, d) (written by
    :func:`stats`) and per side ``x``/``y``: dicts with ``mean`` (that side's row of
    ``means``), ``x`` (B, n, d)
    float32, ``xk`` ((B, n, d) or (B, n, 2d) float16, or None for "ieee"), ``sq``, ``logw``
    and ``w`` ((B, n) float32; ``w`` is the caller's weight tensor itself when it already is
    (B, n) float32 contiguous, as on the torch path), and ``write_w`` (the kernel writes ``w``).
    """
    B, n, d = X.shape
    m = Y.shape[1]
    kd = {"ieee": 0, "tf32": d, "tf32x3": 2 * d}[precision]
    f32, f16 = torch.float32, torch.float16
    specs, keeps = [((B, d), f32), ((2, B, d), f32)], []
    for k, w in ((n, a), (m, b)):
        keep = w is not None and w.dtype == f32 and w.is_contiguous() and (w.dim() == 2 or B == 1)
        keeps.append(keep)
        specs += [((B, k, d), f32), ((B, k, kd), f16), ((B, k), f32), ((B, k), f32)]
        specs += [((B, k), f32)] if not keep else []
    it = iter(_carve(X.device, specs))
    out = {"centre": next(it), "means": next(it)}
    for name, w, keep in (("x", a, keeps[0]), ("y", b, keeps[1])):
        o = {"x": next(it), "xk": next(it), "sq": next(it), "logw": next(it)}
        if not kd:
            o["xk"] = None
        o["w"] = (w if w.dim() == 2 else w[None]) if keep else next(it)
        o["write_w"] = not keep and w is not None
        o["mean"] = out["means"][0 if name == "x" else 1]
        out[name] = o
    return out


def _carve(device, specs) -> list[torch.Tensor]:
    """Contiguous tensors of the given (shape, dtype) carved from one allocation per dtype
    (256-byte aligned), one ``as_strided`` view each."""
    offs, totals = [], {}
    for shape, dt in specs:
        numel = math.prod(shape)
        offs.append(totals.get(dt, 0))
        totals[dt] = totals.get(dt, 0) + -(-numel * dt.itemsize // 256) * 256 // dt.itemsize
    bufs = {dt: torch.empty(max(t, 1), dtype=dt, device=device) for dt, t in totals.items()}
    out = []
    for o, (shape, dt) in zip(offs, specs, strict=True):
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * shape[i + 1]
        out.append(bufs[dt].as_strided(shape, stride, o))
    return out


def sides(X, Y, a, b, centre, precision: str, scale: float, outs: dict) -> tuple[dict, dict]:
    """Centred float32 points and what the kernels read of them, for both clouds.

    Args:
        X, Y, a, b: as in :func:`stats`.
        centre: (B, d) float32 centre from :func:`stats`.
        precision: "ieee", "tf32" or "tf32x3" (``problem.centred_side``).
        scale: the float16 operand scale (a power of two; ``problem.kernel_scale``).
        outs: the buffers of :func:`outputs`, filled here.

    Returns:
        ``(outs["x"], outs["y"])`` (see :func:`outputs`).
    """
    B, n, d = X.shape
    m = Y.shape[1]
    prec = _PRECISIONS[precision]
    kd = 0 if prec == 0 else (d if prec == 1 else 2 * d)
    ox, oy = outs["x"], outs["y"]
    write_a, write_b = ox["write_w"], oy["write_w"]
    wa, s_ab, s_an = _weight_args(a)
    wb, s_bb, s_bn = _weight_args(b)
    n_bx, n_by = cdiv(n, PREPARE_BLOCK), cdiv(m, PREPARE_BLOCK)
    dummy = ox["sq"]
    launch(_prepare_side_kernel, (n_bx + n_by, B),
        X, Y, wa if wa is not None else dummy, wb if wb is not None else dummy, centre,
        ox["x"], oy["x"], ox["xk"] if kd else dummy, oy["xk"] if kd else dummy,
        ox["sq"], oy["sq"], ox["w"], oy["w"], ox["logw"], oy["logw"], n, m, d, n_bx,
        X.stride(0), X.stride(1), X.stride(2), Y.stride(0), Y.stride(1), Y.stride(2),
        s_ab, s_an, s_bb, s_bn, float(scale), 1.0 / float(scale), 1.0 / n, 1.0 / m,
        _log_inv(n), _log_inv(m),
        BLOCK=PREPARE_BLOCK, BLOCK_D=prepare_block_d(d), PRECISION=prec, HAS_A=wa is not None,
        HAS_B=wb is not None, WRITE_A=write_a, WRITE_B=write_b, **FP_FUSION,
    )  # fmt: skip
    return ox, oy


# TUNING.prepare_graphs: replay the launches of :func:`stats` and :func:`sides` from CUDA graphs
# once a call pattern (the addresses, shapes, strides and dtypes of the clouds, weights and
# outputs, and the operand scale) repeats: one graph launch instead of ~30 µs of Triton
# launcher work each (docs/performance.md). False: always launch from Python.


#: Calls of one prepare key run eagerly before its launches are captured. A capture costs
#: about as much as a 10k² solve's host work (0.6-1.3 ms on an H200) and saves a few tens of µs
#: per replay: captured on the second call, a new cloud's second solve took 1.12-1.27x the
#: steady state (10k², d = 64, default tolerance). A key met a third time is a loop's.
PREPARE_EAGER_RUNS = 2


def _graphs(device) -> GraphCache:
    """The cached prepare launches of ``device`` (in its runtime, ``_cuda_graph.py``)."""
    return runtime(device).cache("prepare", lambda: GraphCache(32, PREPARE_EAGER_RUNS))


def _all_graphs() -> list[GraphCache]:
    return [c for rt in runtimes() for n, c in rt.caches().items() if n == "prepare"]


def _graphed(X) -> bool:
    return TUNING.prepare_graphs and X.is_cuda and not torch.cuda.is_current_stream_capturing()


def run_stats(X, Y, a, b, outs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`stats`, replayed from a cached CUDA graph when the call pattern repeats. The
    statistics are then the graph's own buffer, valid until its next replay."""
    if not _graphed(X):
        return stats(X, Y, a, b, outs)
    centre = outs["centre"]
    key = ("stats", tensor_key(X), tensor_key(Y), tensor_key(a), tensor_key(b),
           tensor_key(centre), tensor_key(outs["means"]))  # fmt: skip
    # Only the graph's own scratch is returned from the capture: a view of ``outs`` held by
    # the cache would keep that block alive, and the next call's outputs could never land on
    # the same addresses again.
    (st,) = _graphs(X.device).run(key, lambda: stats(X, Y, a, b, outs)[1:], X.device, clone=False)
    return centre, st


def run_sides(X, Y, a, b, centre, precision: str, scale: float, outs: dict) -> tuple[dict, dict]:
    """:func:`sides`, replayed from a cached CUDA graph when the call pattern repeats."""
    if not _graphed(X):
        return sides(X, Y, a, b, centre, precision, scale, outs)
    held = [outs[s][k] for s in ("x", "y") for k in ("x", "xk", "sq", "w", "logw")]
    key = ("sides", tensor_key(X), tensor_key(Y), tensor_key(a), tensor_key(b),
           tensor_key(centre), *(tensor_key(t) for t in held), outs["x"]["write_w"],
           outs["y"]["write_w"], precision, float(scale))  # fmt: skip

    def launch_sides():
        sides(X, Y, a, b, centre, precision, scale, outs)
        return ()

    _graphs(X.device).run(key, launch_sides, X.device, clone=False)
    return outs["x"], outs["y"]


def graph_stats() -> dict[str, int]:
    """Captures, failed captures and replays of the prepare graphs since :func:`clear_graphs`."""
    out = {"captured": 0, "failed": 0, "replayed": 0}
    for c in _all_graphs():
        for k, v in c.stats().items():
            out[k] += v
    return out


def clear_graphs() -> None:
    """Drops the cached prepare graphs of every device."""
    for c in _all_graphs():
        c.clear()


def precompile(X, Y, a, b, precision: str) -> None:
    """Compiles the three kernels of this kind of call in parallel on first use."""
    key = ("prepare", X.device, X.shape[-1], X.stride(-1) == 1, Y.stride(-1) == 1, precision,
           None if a is None else (a.dtype, a.dim()), None if b is None else (b.dtype, b.dim()))  # fmt: skip

    def both():
        outs = outputs(X, Y, a, b, precision)
        centre, _ = stats(X, Y, a, b, outs)
        sides(X, Y, a, b, centre, precision, 1.0, outs)

    precompile_once(key, both)
