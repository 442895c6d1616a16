"""Dense path: build the Gram matrix K = X Yᵀ once (cuBLAS), then stream K every half-step.

At large d the streaming kernels spend most of their time recomputing x·yᵀ (2 n m d FLOPs per
half-step) while a half-step over a stored K reads n m 4 bytes: at d = 512 on an H100 that is
0.13 ms instead of several. The price is O(B n m) memory, so ``select_path`` takes this path only
for large d and when K fits a budget; the result reports which path ran.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv
from ...problem import Problem, Side
from ..torch_ref import matmul_precision
from . import TritonBackend, plan
from .lse import _DYNAMIC, _partials, _softmin_epilogue, combine_one_side, plan_split

# Smallest d at which the dense path is chosen by "auto", and the largest K it may allocate.
DENSE_MIN_D = 256
DENSE_MAX_BYTES = 4 << 30
#: Symmetric steps from one plan sweep over K (plan.py with the Gram matrix) instead of two
#: soft-min sweeps: half the bytes per iteration. Off until measured on a GPU (tested against
#: the two sweeps under the interpreter; docs/performance.md entry 21). A step whose sums leave
#: the plan's range is redone by the guarded *streaming* step (exact, but it recomputes x·yᵀ).
USE_PLAN_STEP = False


@triton.jit(do_not_specialize=_DYNAMIC + ["s_k", "s_kb"])
def _dense_softmin_kernel(
    K,
    Rsq,
    Csq,
    Clogw,
    Cpot,
    Rold,
    Out,
    Raw,
    Pmax,
    Psum,
    n_rows,
    n_cols,
    cols_per_split,
    n_split,
    s_kb,
    s_k,
    s_vrb,
    s_vcb,
    s_ps,
    eps,
    alpha,
    beta,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    WRITE_RAW: tl.constexpr,
):
    # Row r, column c of the half-step read K[r, c] (x side updated) or K[c, r] (y side):
    # the same online LSE as the streaming kernel with the dot product replaced by a load.
    i_m = tl.program_id(0)
    i_b = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2)
    scale2 = 2.0 * 1.4426950408889634 / eps
    inv_eps2 = 1.4426950408889634 / eps
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < n_rows
    o_m64 = o_m.to(tl.int64)
    b_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    b_sum = tl.zeros([BLOCK_M], tl.float32)
    col_start = i_s * cols_per_split
    col_stop = tl.minimum(col_start + cols_per_split, n_cols)
    for start_n in range(col_start, col_stop, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        m_n = o_n < n_cols
        o_n64 = o_n.to(tl.int64)
        if TRANSPOSED:
            p_k = K + i_b * s_kb + o_n64[None, :] * s_k + o_m64[:, None]
        else:
            p_k = K + i_b * s_kb + o_m64[:, None] * s_k + o_n64[None, :]
        b_s = tl.load(p_k, mask=m_m[:, None] & m_n[None, :], other=0.0)
        o_vc = i_b * s_vcb + o_n
        b_h = (
            tl.load(Cpot + o_vc, mask=m_n, other=0.0) - tl.load(Csq + o_vc, mask=m_n, other=0.0)
        ) * inv_eps2
        b_h += tl.load(Clogw + o_vc, mask=m_n, other=float("-inf")) * 1.4426950408889634
        b_z = b_s * scale2 + b_h[None, :]
        b_new = tl.maximum(b_max, tl.max(b_z, 1))
        b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
        b_sum = b_sum * tl.exp2(b_max - b_ref) + tl.sum(tl.exp2(b_z - b_ref[:, None]), 1)
        b_max = b_new
    o_vr = i_b * s_vrb + o_m
    if n_split > 1:
        tl.store(Pmax + i_s * s_ps + o_vr, b_max, mask=m_m)
        tl.store(Psum + i_s * s_ps + o_vr, b_sum, mask=m_m)
    else:
        _softmin_epilogue(b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW)


class DenseTritonBackend(TritonBackend):
    """Soft-mins from a stored Gram matrix; transport operators stream as usual."""

    name = "triton"
    path = "dense"
    # the Gram matrix is the backend's own tensor, not part of the cache key
    graph_safe = False

    def __init__(self, problem: Problem):
        X, Y = problem.X, problem.Y
        self._x = X.x
        with matmul_precision("tf32" if problem.precision == "tf32" else "ieee", X.x.device):
            self.gram = torch.bmm(X.x.float(), Y.x.float().transpose(1, 2)).contiguous()

    def softmin(self, rows: Side, cols: Side, col_pot, eps, old, alpha, beta, want_raw, precision):
        transposed = rows.x is not self._x
        K = self.gram
        B, n = rows.sq.shape
        m = cols.sq.shape[1]
        # Long contiguous runs along the stored rows of K: 16 x 256 tiles (row sweeps) and
        # 64 x 256 (column sweeps) read ~2.0 and ~2.4 TB/s on the H100, 128 x 64 only 0.7.
        block_m, block_n, warps = (64, 256, 8) if transposed else (16, 256, 4)
        out = torch.empty_like(rows.sq)
        raw = torch.empty_like(rows.sq) if want_raw else out
        n_blocks = cdiv(n, block_m)
        split, cps = plan_split(n_blocks * B, m, block_n, rows.sq.device)
        pmax, psum = _partials(split, rows.sq)
        _dense_softmin_kernel[(n_blocks, B, split)](
            K,
            rows.sq,
            cols.sq,
            cols.logw,
            col_pot,
            old,
            out,
            raw,
            pmax,
            psum,
            n,
            m,
            cps,
            split,
            K.stride(0),
            K.stride(1),
            rows.sq.stride(0),
            cols.sq.stride(0),
            B * n,
            float(eps),
            float(alpha),
            float(beta),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            TRANSPOSED=transposed,
            WRITE_RAW=want_raw,
            num_warps=warps,
            num_stages=3,
            **FP_FUSION,
        )
        if split > 1:
            combine_one_side(pmax, psum, rows.sq, old, out, raw, split, eps, alpha, beta, want_raw)
        return out, (raw if want_raw else None)

    def symmetric_step(
        self, X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, phase="cold"
    ):  # fmt: skip
        if (
            USE_PLAN_STEP and phase != "cold" and X.x is self._x and plan.eligible(X, Y)
        ):  # fmt: skip
            return plan.symmetric_step(
                X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, phase,
                gram=self.gram,
            )  # fmt: skip
        # Two launches over K (plus merges).
        f_new, tf = self.softmin(X, Y, g, eps, f, alpha, beta_x, want_raw, precision)
        g_new, tg = self.softmin(Y, X, f, eps, g, alpha, beta_y, want_raw, precision)
        return f_new, g_new, tf, tg


def dense_fits(problem: Problem) -> bool:
    """True when K = X Yᵀ (fp32) fits the memory budget on the problem's device."""
    nbytes = 4 * problem.B * problem.X.n * problem.Y.n
    if nbytes > DENSE_MAX_BYTES:
        return False
    if problem.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(problem.device)
        return nbytes <= 0.4 * free
    return True
