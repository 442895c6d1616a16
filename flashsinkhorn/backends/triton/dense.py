"""Dense path: build the Gram matrix K = X Yᵀ once (cuBLAS), then stream K every half-step.

At large d the streaming kernels spend most of their time recomputing x·yᵀ (2 n m d FLOPs per
half-step) while a half-step over a stored K reads n m 4 bytes: at d = 512 on an H100 that is
0.13 ms instead of several. The price is O(B n m) memory, so ``select_path`` takes this path only
for large d and when K fits a budget; the result reports which path ran.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..._triton_launch import FP_FUSION, cdiv
from ...problem import Problem, Side
from ..base import Backend, Capabilities
from ..blocks import matmul_precision
from . import TritonBackend
from .configs import (
    DENSE_CHUNK_ELEMENTS,
    DENSE_FREE_FRACTION,
    DENSE_MAX_BYTES,
    DENSE_SOFTMIN_STAGES,
    DENSE_SOFTMIN_TILES,
)
from .dense_grad import dense_transport_grad, k_scores
from .softmin import SOFTMIN_DYNAMIC, combine_one_side, partials
from .split import plan_split
from .tiles import SQEUCLIDEAN, online_lse, softmin_epilogue


# s_k and s_kb are specialised: always multiples of 16 (K's padded rows), one variant.
@triton.jit(do_not_specialize=SOFTMIN_DYNAMIC)
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
    # chunks are a multiple of BLOCK_N wide (split.chunk)
    col_start = tl.multiple_of(i_s * cols_per_split, BLOCK_N)
    col_stop = tl.minimum(col_start + cols_per_split, n_cols)
    for start_n in range(col_start, col_stop, BLOCK_N):
        b_z, _m_n, _o_n = k_scores(
            K, Csq, Clogw, Cpot, i_b, o_m, o_m64, m_m, start_n, n_cols, s_kb, s_k, s_vcb,
            scale2, inv_eps2, BLOCK_N, TRANSPOSED,
        )  # fmt: skip
        b_max, b_alpha, b_ref = online_lse(b_max, b_sum, b_z)
        b_sum = b_sum * b_alpha + tl.sum(tl.exp2(b_z - b_ref[:, None]), 1)
    o_vr = i_b * s_vrb + o_m
    if n_split > 1:
        tl.store(Pmax + i_s * s_ps + o_vr, b_max, mask=m_m)
        tl.store(Psum + i_s * s_ps + o_vr, b_sum, mask=m_m)
    else:
        softmin_epilogue(
            b_max, b_sum, Rsq, Rold, Out, Raw, o_vr, m_m, eps, alpha, beta, WRITE_RAW, SQEUCLIDEAN
        )


class DenseTritonBackend(TritonBackend):
    """Soft-mins and the envelope gradient from a stored Gram matrix; the other transport
    operators stream as usual."""

    name = "triton"
    path = "dense"
    # the Gram matrix is the backend's own tensor, not part of the cache key
    capabilities = Capabilities(graph_safe=False, kernels=True)
    #: fp32 scores per row block of the envelope gradient's softmax buffer
    chunk_elements = DENSE_CHUNK_ELEMENTS

    def __init__(self, problem: Problem):
        X, Y = problem.X, problem.Y
        self._x, self._y = X.x, Y.x
        # Rows padded to a multiple of 16 floats (zero columns past m): the kernels are
        # specialised on that stride and mask their tile loads at the padded width, which lets
        # every tile load be 16-byte vectors for any m with one compiled variant.
        y = Y.x.float()
        pad = -Y.n % 16
        if pad:
            y = torch.nn.functional.pad(y, (0, 0, 0, pad))
        prec = "tf32" if problem.precision == "tf32" else "ieee"
        # fp32 whatever autocast region the caller runs in (the kernels read K as fp32)
        with _no_autocast(X.x.device), matmul_precision(prec, X.x.device):
            self.gram = torch.bmm(X.x.float(), y.transpose(1, 2)).contiguous()

    # The stored scores serve every half-step: no plan sweep over recomputed tiles.
    half_step = Backend.half_step

    def softmin(self, rows: Side, cols: Side, col_pot, eps, old, alpha, beta, want_raw, precision):
        if not (
            (rows.x is self._x and cols.x is self._y) or (rows.x is self._y and cols.x is self._x)
        ):
            # K = X Yᵀ describes the problem this backend was built for, and no other
            raise RuntimeError("the dense-path backend was called with sides it was not built from")
        if eps >= rows.large_eps:
            # the expansion about the mean score lives in the streaming kernel only
            return super().softmin(rows, cols, col_pot, eps, old, alpha, beta, want_raw,
                                   precision)  # fmt: skip
        transposed = rows.x is not self._x
        K = self.gram
        B, n = rows.sq.shape
        m = cols.sq.shape[1]
        block_m, block_n, warps = DENSE_SOFTMIN_TILES[transposed]
        out = torch.empty_like(rows.sq)
        raw = torch.empty_like(rows.sq) if want_raw else out
        n_blocks = cdiv(n, block_m)
        split, cps = plan_split(n_blocks * B, m, block_n, rows.sq.device)
        pmax, psum = partials(split, rows.sq)
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
            num_stages=DENSE_SOFTMIN_STAGES,
            **FP_FUSION,
        )
        if split > 1:
            combine_one_side(pmax, psum, rows.sq, old, out, raw, split, eps, alpha, beta, want_raw)
        return out, (raw if want_raw else None)

    def _orientation(self, rows: Side, cols: Side) -> bool | None:
        """False: rows of K (the x side), True: its columns, None: sides K was not built from."""
        if rows.x is self._x and cols.x is self._y:
            return False
        if rows.x is self._y and cols.x is self._x:
            return True
        return None

    def transport(self, rows, cols, row_pot, col_pot, eps, V, A, Bw, precision):
        """The marginal alone (``V`` None, no Hadamard factor) from one soft-min sweep over
        K: â_i = w_i exp((row_pot_i − T_i) / eps) with T the raw soft-min of ``col_pot``
        (the convergence test's formula, solvers/objective.py), 4·n·m bytes read where the
        streaming transport forms x·yᵀ again (2·n·m·d products). Values stream as usual."""
        plain = V is None and A is None and Bw is None
        if not plain or self._orientation(rows, cols) is None or eps >= rows.large_eps:
            return super().transport(rows, cols, row_pot, col_pot, eps, V, A, Bw, precision)
        _, raw = self.softmin(rows, cols, col_pot, eps, row_pot, 0.0, 1.0, True, precision)
        return None, rows.w * torch.exp((row_pot - raw) / eps)

    def plan_argmax(self, rows, cols, col_pot, eps, precision, idx=None, seed=None):
        """Argmax and Gumbel-max draws reading each draw's row of K (sample.py)."""
        transposed = self._orientation(rows, cols)
        if transposed is None:
            return super().plan_argmax(rows, cols, col_pot, eps, precision, idx, seed)
        from .sample import dense_plan_argmax

        return dense_plan_argmax(self.gram, transposed, rows, cols, col_pot, eps, idx, seed)

    def symmetric_step(
        self, X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, phase="cold"
    ):  # fmt: skip
        # Two launches over K (plus merges). One sweep forming both soft-mins per tile reads K
        # half as often but ran 1.1-1.7x slower on the H200: the per-tile column reductions
        # cross warps through shared memory (docs/performance.md).
        f_new, tf = self.softmin(X, Y, g, eps, f, alpha, beta_x, want_raw, precision)
        g_new, tg = self.softmin(Y, X, f, eps, g, alpha, beta_y, want_raw, precision)
        return f_new, g_new, tf, tg

    def self_step(self, X, f, eps, alpha, beta, want_raw, precision, phase="cold"):
        # A sweep over the stored K (the streaming triangle would recompute it).
        return self.softmin(X, X, f, eps, f, alpha, beta, want_raw, precision)

    def transport_grad(self, rows, cols, row_pot, col_pot, eps, precision):
        """Envelope gradient from the stored Gram matrix: one kernel writes each row block of
        the plan's row softmax from K, cuBLAS multiplies it by the points (dense_grad.py). The
        streaming kernel recomputes x·yᵀ, and at 10k, d = 512 took ≈ 9 ms of a 12.9 ms
        fwd+bwd (docs/performance.md). Same contract as Backend.transport_grad."""
        if rows.x is self._x and cols.x is self._y:
            transposed = False
        elif rows.x is self._y and cols.x is self._x:
            transposed = True
        else:  # sides K was not built from
            return super().transport_grad(rows, cols, row_pot, col_pot, eps, precision)
        # A backward run under autocast would otherwise take the plan-times-points bmm in
        # 16 bits; the streaming kernel it replaces ignores autocast.
        with _no_autocast(rows.x.device):
            return dense_transport_grad(
                self.gram, transposed, rows, cols, row_pot, col_pot, eps, precision,
                self.chunk_elements,
            )  # fmt: skip


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


def gram_bytes(B: int, n: int, m: int) -> int:
    """Bytes of a stored K = X Yᵀ of B problems n × m: fp32 values, rows padded to 16 floats."""
    return 4 * B * n * (m + -m % 16)


def dense_bytes(problem: Problem) -> int:
    """Bytes of the stored K = X Yᵀ of ``problem``."""
    return gram_bytes(problem.B, problem.X.n, problem.Y.n)


def free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device`` now (CUDA: the driver's count; CPU: free physical pages),
    or None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_dense_memory(problem: Problem) -> None:
    """Refuses a forced ``path="dense"`` whose K would not fit the device's free memory,
    before anything of size n·m is allocated."""
    nbytes, free = dense_bytes(problem), free_bytes(problem.device)
    if free is not None and nbytes > free:
        raise ValueError(
            f"path='dense' stores K = x yᵀ: B·n·m = {problem.B}·{problem.X.n}·{problem.Y.n} "
            f"fp32 values, {nbytes:,} bytes ({nbytes / 2**30:.1f} GiB), more than the "
            f"{free:,} bytes free on {problem.device}; use path='streaming' (memory "
            "O((n + m) d)) or path='auto'"
        )


def dense_fits(problem: Problem) -> bool:
    """True when K = X Yᵀ (fp32) fits the memory budget on the problem's device."""
    nbytes = dense_bytes(problem)
    if nbytes > DENSE_MAX_BYTES:
        return False
    if problem.device.type == "cuda":
        return fits_free_memory(nbytes, problem.device)
    return True


def fits_free_memory(nbytes: int, device: torch.device) -> bool:
    """True when ``nbytes`` are at most ``DENSE_FREE_FRACTION`` of the memory free on the
    CUDA ``device`` (room for the solve's other buffers and the caller's). Free counts the
    blocks torch's caching allocator holds unused too: the Gram matrix of the previous
    solve of the same size, released but kept, would otherwise halve the budget of the next
    one."""
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return nbytes <= DENSE_FREE_FRACTION * (free + cached)
