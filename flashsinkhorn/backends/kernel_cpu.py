"""CPU path: the stabilised Gibbs kernel, stored once per eps, and soft-mins as matrix–vector
products.

The log-domain soft-min (torch_ref.py) recomputes n·m exponentials every half-step. Here, for
the rows R and columns C of a problem and *absorbed* potentials (p̄_R, p̄_C), the backend
stores

    K_ij = exp((p̄_R,i + p̄_C,j − C_ij) / eps)                     (B, n, m)

once, and a soft-min of R from the column potential p is one matrix–vector product:

    T_i = p̄_R,i − eps (log s_i + c),   s = K v,   v_j = exp(z_j − c),
    z_j = log w_j + (p_j − p̄_C,j) / eps,   c = max_j z_j;

the soft-min of C from a row potential reads the same K transposed (s = Kᵀ u). No
exponential of the n·m scores is taken after the build, which is what POT's ``ot.sinkhorn``
does, here with the stabilisation of Schmitzer (2019): the potentials absorbed into K are kept
close enough to the current ones that v and s stay far from under- and overflow.

Absorption: K is built from the soft-min that needs it, computed exactly in the log domain
(T of that call, so p̄_R = T and p̄_C = p); then Σ_j K_ij w_j = 1 for every row. It is rebuilt
(about the cost of one log-domain soft-min) when eps changes (the other half-step of an
annealing iteration reuses it) and when a sum s_i falls below a floor (:func:`_limits`).
Entries of K below exp(CUT) of their row's largest are stored as 0; with v <= 1 and the floor
on s the mass they carry stays under the dtype's rounding of every sum (docs/cpu.md).

Costs other than the plain squared Euclidean one and label terms are read from the cost block
that the torch backend forms. At large eps (the expanded soft-min, limits.py) and for sides
other than the problem's (a dual-value pass with other weights) the backend runs the
log-domain soft-min itself.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..problem import Problem, Side
from .kernel_costs import shifted
from .torch_ref import CHUNK_ELEMENTS, TorchBackend, cost_block, row_chunks

#: Largest stored kernel, B·n·m values of the potential dtype, in bytes (select_path falls
#: back to the log-domain soft-min above it).
KERNEL_MAX_BYTES = 1 << 30
#: Score elements per row block of the build (the block's temporaries stay in cache).
BUILD_BLOCK = 1 << 18
#: Kernels of fewer values (B·n·m) run their soft-mins on one thread: a parallel region costs
#: more than it saves there, and far more on a loaded machine (200 × 240, d = 64, load 17 on 2
#: cores: 6.65 s with 2 threads against 0.51 s with one).
PARALLEL_MIN = 1 << 20


def kernel_bytes(problem: Problem) -> int:
    """Bytes of the stored kernel of ``problem``."""
    return problem.B * problem.X.n * problem.Y.n * problem.X.sq.element_size()


def kernel_fits(problem: Problem) -> bool:
    """The kernel of ``problem`` fits :data:`KERNEL_MAX_BYTES`; given cost matrices have their
    own backend (backends/matrix.py)."""
    return problem.cost != "matrix" and kernel_bytes(problem) <= KERNEL_MAX_BYTES


@contextlib.contextmanager
def _threads_for(numel: int):
    """One intra-op thread for a kernel below :data:`PARALLEL_MIN` values; the caller's
    setting is restored."""
    saved = torch.get_num_threads()
    if saved == 1 or numel >= PARALLEL_MIN:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@functools.cache
def _limits(dtype: torch.dtype) -> tuple[float, float, float]:
    """(smallest sum s_i per column, CUT, log of the smallest normal number) of a dtype.

    With L = −log(smallest normal number) (87.3 in float32, 708.4 in float64) and u the unit
    of rounding: entries of K below exp(CUT), CUT = −0.46 L, are stored as 0. The column
    scalings are divided by their largest, so v_j <= 1 and the zeroed entries carry at most
    m exp(CUT) of a sum; a sum s_i >= m exp(CUT) / (u e²) keeps that under exp(−2) u of it.
    """
    fi = torch.finfo(dtype)
    cut = -0.46 * -math.log(fi.tiny)
    return math.exp(cut - math.log(fi.eps) + 2.0), cut, math.log(fi.tiny)


def _same(a: Side, b: Side) -> bool:
    """The two sides read the same points, weights and cost (``limits.admit`` replaces the
    sides of a problem with copies that keep their tensors)."""
    if a is b:
        return True
    return (
        a.x is b.x
        and a.sq is b.sq
        and a.logw is b.logw
        and a.labels is b.labels
        and a.lcost is b.lcost
        and a.cost == b.cost
        and a.sq_floor == b.sq_floor
    )


class KernelBackend(TorchBackend):
    """Soft-mins from a stored, stabilised Gibbs kernel; transports, the envelope gradient and
    large-eps soft-mins as in :class:`~.torch_ref.TorchBackend`.

    One instance serves one problem (``select_path`` makes it): it holds the kernel of the
    last eps, (B, n, m) in the potential dtype.
    """

    name = "torch"
    path = "kernel"

    def __init__(self, chunk_elements: int = CHUNK_ELEMENTS, numel: int = PARALLEL_MIN):
        super().__init__(chunk_elements)
        self.numel = numel  # B·n·m of the problem, for :meth:`threads`
        self._K: torch.Tensor | None = None
        self._rows: Side | None = None  # the sides K was built for, K[b, i, j]: rows i
        self._cols: Side | None = None
        self._views: tuple | None = None  # per orientation, see _apply
        self._eps: float | None = None
        self._off = False
        #: Kernel builds of this instance (tests and benchmarks read it).
        self.builds = 0

    def release(self) -> None:
        """Frees the kernel once the solve is done: later soft-mins (marginals of a result) run
        in the log domain."""
        self._drop()
        self._off = True

    def _drop(self) -> None:
        self._K = self._views = None
        self._rows = self._cols = None

    def threads(self):
        return _threads_for(self.numel)

    def softmin(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
        T = self._kernel_softmin(rows, cols, col_pot, eps)
        if T is None:
            return super().softmin(rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision)
        if alpha == 0.0:
            out = T if beta == 1.0 else T * beta
        elif alpha + beta == 1.0:
            out = torch.lerp(old, T, beta)
        else:
            out = (old * alpha).add_(T, alpha=beta)
        return out, (T if want_raw else None)

    def _kernel_softmin(self, rows: Side, cols: Side, col_pot, eps: float):
        """T from the kernel (built or rebuilt here when needed), or None for the log domain."""
        if self._off or eps >= rows.large_eps or eps >= cols.large_eps:
            return None
        if eps != self._eps:
            self._drop()
            self._eps = eps
        if self._K is not None:
            orientation = self._orientation(rows, cols)
            if orientation is None:
                return None  # a one-off pass over other sides (weights): keep this kernel
            T = self._apply(orientation, cols, col_pot, eps)
            if T is not None:
                return T
        # (a build is exact and costs about one log-domain soft-min: rebuilding at every
        # half-step, far from convergence, is never slower than the log domain)
        return self._build(rows, cols, col_pot, eps)

    def _orientation(self, rows: Side, cols: Side) -> int | None:
        """0: K's own rows and columns; 1: transposed; None: other sides."""
        if _same(rows, self._rows) and _same(cols, self._cols):
            return 0
        if _same(rows, self._cols) and _same(cols, self._rows):
            return 1
        return None

    def _apply(self, orientation: int, cols: Side, col_pot, eps: float):
        # (kernel of this orientation, absorbed row potential, log w − absorbed column
        # potential/eps): z = log v before the shift
        K, pr, cw = self._views[orientation]
        z = torch.add(cw, col_pot, alpha=1.0 / eps)
        # a common shift of the column potential shifts T only: scale by the largest term
        top = z.amax() if K.dim() == 2 else z.amax(dim=-1, keepdim=True)
        # (clamped at the smallest normal exponent: a float32 exp that underflows is slow, and
        # v_j <= 1e-38 is far below the floor's resolution of s)
        v = z.sub_(top).clamp_(min=_limits(pr.dtype)[2]).exp_()
        if K.dim() == 2:
            s = torch.mv(K, v.view(-1))
        else:
            s = torch.bmm(K, v[:, :, None])[..., 0]
        if not s.min().item() >= _limits(pr.dtype)[0] * cols.n:  # also False for NaN
            return None
        return torch.add(pr, s.log_().add_(top), alpha=-eps)

    def _build(self, rows: Side, cols: Side, col_pot, eps: float) -> torch.Tensor:
        """Builds K for (rows, cols) absorbing (T, col_pot), T the exact soft-min it returns."""
        self._drop()
        B, n, _ = rows.x.shape
        m = cols.x.shape[1]
        dtype = rows.sq.dtype
        cut = _limits(dtype)[1]
        K = torch.empty((B, n, m), dtype=dtype)
        T = torch.empty_like(rows.sq)
        w = cols.w.to(dtype)[:, :, None]
        plain = shifted(rows.cost) and rows.labels is None
        col_pot = col_pot.to(dtype)
        for sl in row_chunks(B, n, m, BUILD_BLOCK):
            z = K[:, sl]
            # z = (p_j − C_ij)/eps + offset_i/eps, offset ‖r_i‖² (shifted form) or 0
            if plain:
                h = ((col_pot - cols.sq) / eps)[:, None, :]
                xr, yc = rows.x[:, sl].to(dtype), cols.x.to(dtype)
                torch.baddbmm(h, xr, yc.transpose(1, 2), alpha=2.0 / eps, out=z)
                offset = rows.sq[:, sl]
            else:
                torch.sub(col_pot[:, None, :], cost_block(rows, sl, cols, dtype), out=z)
                z.div_(eps)
                offset = torch.zeros_like(rows.sq[:, sl])
            top = (z + cols.logw[:, None, :]).amax(-1, keepdim=True)
            # exp of the clamped exponents, then the clamped entries to 0: torch's float32 exp
            # of arguments below about −87 (zero or subnormal results) is 100–500× slower
            z.sub_(top).clamp_(min=cut).exp_()
            torch.nn.functional.threshold_(z, math.exp(cut + 0.5), 0.0)
            s = torch.bmm(z, w)  # >= 1: the largest weighted entry is exp(0)
            z.div_(s)
            T[:, sl] = offset - eps * (top[..., 0] + torch.log(s[..., 0]))
        self._K, self._rows, self._cols = K, rows, cols
        Km = K[0] if B == 1 else K
        Kt = Km.transpose(-2, -1)
        # log w − p̄/eps of each side, the column term of its orientation
        self._views = (
            (Km, T, torch.add(cols.logw, col_pot, alpha=-1.0 / eps)),
            (Kt, col_pot.clone(), torch.add(rows.logw, T, alpha=-1.0 / eps)),
        )
        self.builds += 1
        return T
