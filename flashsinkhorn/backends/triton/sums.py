"""Once-per-solve scalars from weighted sums over both sides, in one launch each.

The plan step's shifts for its "zero" and "second" phases (plan.phase_shift) and the dual value
of the returned potentials (solvers/objective.dual_value) are a few weighted sums over the
points of each problem followed by scalar arithmetic. In torch that is 10-15 small kernels
each, about 25 µs of GPU time apiece at n = m = 10⁴ (docs/performance.md): more than
a tenth of one plan sweep. Here one program per problem streams both sides once and writes
the scalar.

Per side, with weights w and a per-point value p (a potential, or the squared norms):
s0 = Σ w, s1 = Σ w·p, and for a KL-relaxed side s2 = Σ w·exp(−p / rho) and
s3 = Σ w·(1 − exp(−p / rho)), the latter summed term by term (a series near 0) so that a large
rho does not cancel s0 − s2 in float32. Zero-weight points contribute nothing, whatever their
value. Then, per ``mode``:

* ``MODE_ZERO``: −Ĉ + c, the mean cost Ĉ = s1x/s0x + s1y/s0y − 2 x̄·ȳ (p = the squared norms,
  x̄, ȳ the weighted means of the centred points; ``tiles.mean_cost`` of it for other costs);
* ``MODE_SECOND``: k (s1x/s0x + s1y/s0y) + c (p = the potentials);
* ``MODE_VALUE``: φx + φy − eps (mass(P) − M_x M_y) with φ = M s1/s0 for a hard marginal
  and rho M s3/s0 for a KL one, and mass(P) = M of a hard side, else the mean of
  M (1 − s3/s0) over the sides; M is the side's nominal mass (``Side.nominal_mass``, the one
  in the soft-mins); mass(P) − M_x M_y is summed from s3 and 1 − M without cancellation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, launch
from ...problem import Problem, Side, side_mean
from ..kernel_costs import cost_id
from .configs import SUMS_BLOCK, SUMS_BLOCK_D
from .tiles import mean_cost

MODE_ZERO, MODE_SECOND, MODE_VALUE = 0, 1, 2


@triton.jit
def _one_minus_exp_neg(t):
    # 1 − exp(−t) without cancellation: its Taylor series (Horner, 9 terms; the first dropped
    # term is t^10 / 10! < 3e-10 relative for |t| < 0.5), else the direct form.
    b_q = 1.0 - t * (1.0 / 9.0)
    b_q = 1.0 - t * (1.0 / 8.0) * b_q
    b_q = 1.0 - t * (1.0 / 7.0) * b_q
    b_q = 1.0 - t * (1.0 / 6.0) * b_q
    b_q = 1.0 - t * (1.0 / 5.0) * b_q
    b_q = 1.0 - t * (1.0 / 4.0) * b_q
    b_q = 1.0 - t * (1.0 / 3.0) * b_q
    b_q = 1.0 - t * 0.5 * b_q
    return tl.where(tl.abs(t) < 0.5, t * b_q, 1.0 - tl.exp(-t))


@triton.jit
def _side_sums(W, P, i_b64, n, s_wb, s_pb, inv_rho, KL, BLOCK: tl.constexpr):
    # (Σ w, Σ w p, Σ w exp(−p / rho), Σ w (1 − exp(−p / rho))) of one side; the last two only
    # where KL is set.
    b_s0 = tl.zeros([BLOCK], tl.float32)
    b_s1 = tl.zeros([BLOCK], tl.float32)
    b_s2 = tl.zeros([BLOCK], tl.float32)
    b_s3 = tl.zeros([BLOCK], tl.float32)
    for i0 in range(0, n, BLOCK):
        o_n = i0 + tl.arange(0, BLOCK)
        m_n = o_n < n
        b_w = tl.load(W + i_b64 * s_wb + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_p = tl.load(P + i_b64 * s_pb + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_s0 += b_w
        # a zero weight times an infinite value contributes nothing
        b_s1 += tl.where(b_w != 0.0, b_w * b_p, 0.0)
        if KL:
            b_t = b_p * inv_rho
            b_s2 += tl.where(b_w != 0.0, b_w * tl.exp(-b_t), 0.0)
            b_s3 += tl.where(b_w != 0.0, b_w * _one_minus_exp_neg(b_t), 0.0)
    return tl.sum(b_s0, 0), tl.sum(b_s1, 0), tl.sum(b_s2, 0), tl.sum(b_s3, 0)


# Every integer argument unspecialised (Triton would otherwise compile separate kernels for the
# values 1 and multiples of 16): one compiled kernel, built with the plan step's kernels.
@triton.jit(do_not_specialize=["n", "m", "d", "s_wxb", "s_pxb", "s_wyb", "s_pyb", "mode", "kl_x",
                               "kl_y", "cost"])  # fmt: skip
def _solve_scalar_kernel(
    Wx, Px, Wy, Py, Mx, My, NMx, NMy, Out, n, m, d, s_wxb, s_pxb, s_wyb, s_pyb,
    mode, kl_x, kl_y, inv_rho_x, inv_rho_y, rho_x, rho_y, cost, k, c, eps,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per problem; mode, cost and marginal kinds are run-time values, so that a
    # single compiled kernel serves both shifts and the value.
    i_b64 = tl.program_id(0).to(tl.int64)
    s0x, s1x, s2x, s3x = _side_sums(Wx, Px, i_b64, n, s_wxb, s_pxb, inv_rho_x, kl_x != 0, BLOCK)
    s0y, s1y, s2y, s3y = _side_sums(Wy, Py, i_b64, m, s_wyb, s_pyb, inv_rho_y, kl_y != 0, BLOCK)
    if mode == 0:
        b_dot = tl.zeros([BLOCK_D], tl.float32)
        for d0 in range(0, d, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D)
            m_d = o_d < d
            b_mx = tl.load(Mx + i_b64 * d + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_my = tl.load(My + i_b64 * d + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_dot += b_mx * b_my
        mean_sq = tl.maximum(s1x / s0x + s1y / s0y - 2.0 * tl.sum(b_dot, 0), 0.0)
        out = c - mean_cost(cost, mean_sq)
    elif mode == 1:
        out = k * (s1x / s0x + s1y / s0y) + c
    else:
        # mass(P) − M_x M_y is formed without cancellation: eps multiplies it (objective.py).
        # Every side sum is taken with the weights scaled to the nominal mass M (NMx, NMy:
        # Side.nominal_mass, the one in the soft-mins), M s/s0, so that eps ln M in the
        # potentials meets the same M in the mass term.
        nmx = tl.load(NMx + i_b64)
        nmy = tl.load(NMy + i_b64)
        phi_x = tl.where(kl_x != 0, rho_x * nmx * (s3x / s0x), nmx * (s1x / s0x))
        phi_y = tl.where(kl_y != 0, rho_y * nmy * (s3y / s0y), nmy * (s1y / s0y))
        gap_kl = 0.5 * (nmx * (1.0 - nmy) + nmy * (1.0 - nmx) - nmx * (s3x / s0x)
                        - nmy * (s3y / s0y))  # fmt: skip
        gap = tl.where(kl_x == 0, nmx * (1.0 - nmy), tl.where(kl_y == 0, nmy * (1.0 - nmx), gap_kl))
        out = phi_x + phi_y - eps * gap
    tl.store(Out + i_b64, out)


def _launch(mode: int, X: Side, Y: Side, px, py, *, k=0.0, c=0.0, eps=0.0, means=None,
            masses=None):  # fmt: skip
    B = X.w.shape[0]
    out = torch.empty(B, dtype=torch.float32, device=X.w.device)
    mx, my = means if means is not None else (out, out)
    nmx, nmy = masses if masses is not None else (out, out)
    px, py = px.contiguous(), py.contiguous()
    kl_x, kl_y = X.rho is not None, Y.rho is not None
    launch(_solve_scalar_kernel, (B,),
        X.w, px, Y.w, py, mx, my, nmx, nmy, out, X.w.shape[1], Y.w.shape[1], mx.shape[-1],
        X.w.stride(0), px.stride(0), Y.w.stride(0), py.stride(0),
        mode, int(kl_x), int(kl_y), 1.0 / X.rho if kl_x else 0.0, 1.0 / Y.rho if kl_y else 0.0,
        float(X.rho or 0.0), float(Y.rho or 0.0), cost_id(X.cost), float(k),
        float(c), float(eps),
        BLOCK=SUMS_BLOCK, BLOCK_D=SUMS_BLOCK_D, **FP_FUSION,
    )  # fmt: skip
    return out


def zero_shift(X: Side, Y: Side, c: float) -> torch.Tensor:
    """(B,) float32 c − Ĉ, Ĉ the weighted mean cost between the clouds (plan.phase_shift)."""
    means = (side_mean(X).float().contiguous(), side_mean(Y).float().contiguous())
    return _launch(MODE_ZERO, X, Y, X.sq, Y.sq, c=c, means=means)


def second_shift(X: Side, Y: Side, f, g, k: float, c: float) -> torch.Tensor:
    """(B,) float32 k (f̄ + ḡ) + c with f̄, ḡ the weighted means of the potentials."""
    return _launch(MODE_SECOND, X, Y, f, g, k=k, c=c)


def dual_value(problem: Problem, f: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """(B,) float32 OT_eps of the potentials from the dual (solvers/objective.dual_value)."""
    X, Y = problem.X, problem.Y
    masses = (X.nominal_mass.float().contiguous(), Y.nominal_mass.float().contiguous())
    return _launch(MODE_VALUE, X, Y, f, g, eps=eps, masses=masses)
