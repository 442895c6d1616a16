"""The backend interface: the soft-min primitive that every Sinkhorn half-step is made of.

For a row side R (points r_i, squared norms ‖r_i‖²) and a column side C (points c_j,
log-weights log w_j, potential p_j) the soft-min is

    T_i = −eps · log Σ_j w_j exp((p_j − ‖r_i − c_j‖²) / eps)
        = ‖r_i‖² − eps · LSE_j[(2 r_i·c_j + p_j − ‖c_j‖²) / eps + log w_j],

the second form being the biased dot-product LSE the kernels stream (shifted potentials). A
half-step writes ``alpha * old + beta * T`` (averaging and unbalanced damping fused in), and
optionally T itself, from which the marginals of the current plan follow for free:
(P 1)_i = w_i exp((old_i − T_i) / eps).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..problem import Side

#: Solve strategies: the loop on the points ("plain"), or a coarse solve on cell centroids,
#: a lift and a block-sparse fine loop ("multiscale", flashsinkhorn/multiscale/).
STRATEGIES = ("plain", "multiscale")

#: The range in which a sum of plan entries without a running max is trusted (the Triton plan
#: step's, docs/kernels.md): below, float32 exps flushed to zero could matter; above, a term
#: may have overflowed.
PLAN_SUM_RANGE = (2.0**-64, 3.0e38)


@dataclass(frozen=True)
class Capabilities:
    """What a backend bound to a problem can do. The engine, the loop, the CUDA-graph caches
    and the autograd functions read these, never a backend's ``name`` or ``path``.

    Attributes:
        transports: ``transport`` and ``transport_grad`` are implemented (gradients,
            ``apply``, ``plan``).
        second_order: point gradients of the squared Euclidean cost may be differentiated
            again (the streaming HVP reads this backend's transports).
        graph_safe: only the problem's tensors feed its launches (no state of its own), so a
            fixed-iteration solve may be captured and replayed as a CUDA graph
            (solvers/graphs.py).
        kernels: the soft-mins run compiled device kernels: float32 solves default to TF32
            products on pre-rounded points, and the "auto" acceleration weighs an
            iteration's launches against its kernels.
        strategy: how a solve runs on it, one of :data:`STRATEGIES`.
        sharded: its problem is one process's share of a problem sharded over several
            (``reduce_error``, ``reduce_sum`` sum over them): the loop's Anderson mixing
            reduces its inner products through ``reduce_sum``.
    """

    transports: bool = True
    second_order: bool = True
    graph_safe: bool = False
    kernels: bool = False
    strategy: str = "plain"
    sharded: bool = False

    def default_precision(self, dtype: torch.dtype) -> str:
        """The precision "auto" resolves to: TF32 (on pre-rounded points) for float32 solves
        on compiled kernels, exact products otherwise."""
        return "tf32" if self.kernels and dtype == torch.float32 else "ieee"

    @property
    def long_iterations(self) -> bool:
        """An iteration costs far more than its launches on large problems: the "auto"
        acceleration then weighs the scores per half-step (``SinkhornOptions.resolve``)."""
        return self.kernels or self.strategy == "multiscale"


class Backend(ABC):
    """One implementation of the soft-min primitive and of the transport operators.

    A subclass declares :attr:`capabilities` (a class attribute, or a property for a backend
    bound to one problem); ``name`` and ``path`` only label the result.
    """

    #: Label of the implementation, reported as ``SinkhornResult.backend``.
    name: str = "abstract"
    #: How the soft-mins read the cost, reported as ``SinkhornResult.path``: "streaming"
    #: (recomputed tiles), "dense" (stored), "matrix" (a given cost) or "multiscale".
    path: str = "streaming"
    capabilities: Capabilities = Capabilities()

    @abstractmethod
    def softmin(
        self,
        rows: Side,
        cols: Side,
        col_pot: torch.Tensor,
        eps: float,
        old: torch.Tensor,
        alpha: float,
        beta: float,
        want_raw: bool,
        precision: str,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One half-step.

        Args:
            rows: the side being updated, n rows.
            cols: the other side, m columns.
            col_pot: (B, m) current potential of the column side.
            eps: entropic regularisation (run-time value).
            old: (B, n) current potential of the row side.
            alpha: weight of ``old`` in the output.
            beta: weight of the soft-min in the output.
            want_raw: also return the soft-min T itself.
            precision: "ieee", "tf32" or "tf32x3" for the dot products.

        Returns:
            ``(alpha * old + beta * T, T or None)``, both (B, n).
        """

    def half_step(
        self,
        rows: Side,
        cols: Side,
        col_pot: torch.Tensor,
        eps: float,
        old: torch.Tensor,
        alpha: float,
        beta: float,
        want_raw: bool,
        precision: str,
        phase: str = "cold",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A half-step of the alternating schedule: :meth:`softmin`, told where ``old`` stands
        in the loop (``phase`` as in :meth:`symmetric_step`), so that a backend may read the
        soft-min off the row sums of the plan of (old, col_pot), shifted by ``old`` (Triton:
        plan.py). Results do not depend on it beyond rounding."""
        return self.softmin(rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision)

    def symmetric_step(
        self,
        X: Side,
        Y: Side,
        f: torch.Tensor,
        g: torch.Tensor,
        eps: float,
        alpha: float,
        beta_x: float,
        beta_y: float,
        want_raw: bool,
        precision: str,
        phase: str = "cold",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Both half-steps from the same (f, g); a backend may fuse them into one launch.

        ``phase`` says where (f, g) stands in the loop, so that a backend may read both
        soft-mins off one plan sweep, shifted by an estimate of where its sums lie (Triton:
        plan.py, which falls back by itself when the estimate fails): "zero" (f = g = 0),
        "second" (the first averaged step after a plain update from zero), "iterate" (any
        later iterate) or "cold" (nothing known: no plan sweep). Results do not depend on it
        beyond rounding.
        """
        f_new, tf = self.softmin(X, Y, g, eps, f, alpha, beta_x, want_raw, precision)
        g_new, tg = self.softmin(Y, X, f, eps, g, alpha, beta_y, want_raw, precision)
        return f_new, g_new, tf, tg

    def self_step(
        self,
        X: Side,
        f: torch.Tensor,
        eps: float,
        alpha: float,
        beta: float,
        want_raw: bool,
        precision: str,
        phase: str = "cold",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step of a self problem (one side, one potential): ``alpha * f + beta * T(f)``
        with T(f) the soft-min of f over the side against itself.

        ``phase`` as in :meth:`symmetric_step`; a backend may then read T(f) off the upper
        triangle of the symmetric plan (Triton: plan_self.py). Results do not depend on it
        beyond rounding.

        Returns:
            ``(alpha * f + beta * T(f), T(f) or None)``, both (B, n).
        """
        return self.softmin(X, X, f, eps, f, alpha, beta, want_raw, precision)

    def softmin_pair(
        self,
        first: tuple,
        second: tuple,
        eps: float,
        alpha: float,
        want_raw: bool,
        precision: str,
    ) -> tuple[tuple, tuple]:
        """Two independent half-steps, each with its own rows and columns; a backend may run
        them in one launch (a sharded problem's x rows against some y columns and y rows
        against some x columns: four sides, where ``symmetric_step`` has two).

        Args:
            first: ``(rows, cols, col_pot, old, beta)`` of one half-step.
            second: the same for the other.
            eps, alpha, want_raw, precision: as in :meth:`softmin`, shared by both.

        Returns:
            ``((out, raw or None), (out, raw or None))``, one per half-step.
        """
        r1, c1, p1, o1, b1 = first
        r2, c2, p2, o2, b2 = second
        return (
            self.softmin(r1, c1, p1, eps, o1, alpha, b1, want_raw, precision),
            self.softmin(r2, c2, p2, eps, o2, alpha, b2, want_raw, precision),
        )

    # Plan sums of one block of a sharded problem (docs/distributed.md). A rank holds its rows
    # against some columns: the plan's row sums over those columns and column sums over those
    # rows add up across ranks, so one all-reduce of the column sums completes a symmetric
    # step whose every score was formed once.

    def has_plan_sums(self, X: Side, Y: Side, eps: float, cols: bool) -> bool:
        """Whether :meth:`plan_sums` serves these sides: the soft-mins of the block X × Y are
        then read off the plan's sums, as this backend's own fused step would (``cols``: the
        symmetric step, both sums; else the half-step, row sums only). Decided by the sides'
        kinds (labels, zero weights, dimension), eps and the switches only, never by values,
        so that every rank of a sharded problem decides alike. False by default."""
        return False

    def plan_sums(
        self,
        X: Side,
        Y: Side,
        f: torch.Tensor,
        g: torch.Tensor,
        eps: float,
        precision: str,
        shift: torch.Tensor | None,
        cols: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row and column sums of the plan π_ij = w_i w_j exp((f_i + g_j − C_ij − σ) / eps)
        over the block X × Y (σ = ``shift``, (B,), or 0), without a running max: sums outside
        the trusted range are caught by :meth:`sums_step`.

        Returns:
            ``(rows (B, n), cols (B, m) or None without ``cols``)``.
        """
        raise NotImplementedError(f"backend {self.name!r} has no plan sums")

    def plan_shift(self, X: Side, Y: Side, f, g, eps: float, phase: str):
        """(B,) the shift σ of the plan's exponent that this backend's fused step takes in
        ``phase`` (``symmetric_step``), or None (no shift)."""
        return None

    def sums_step(
        self,
        rows: Side,
        sums: torch.Tensor,
        old: torch.Tensor,
        eps: float,
        alpha: float,
        beta: float,
        want_raw: bool,
        shift: torch.Tensor | None,
        redo: tuple | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The half-step ``alpha · old + beta · T`` of ``rows`` from the plan's sums over them:
        with s_i the row sums of the plan of (old, some column potential) shifted by σ,
        T_i = old_i − σ − eps ln(s_i / w_i).

        Args:
            sums: (B, n) the plan sums (:meth:`plan_sums`, possibly added up across ranks).
            redo: ``(cols, col_pot, precision)``: the whole column side, whose soft-min
                replaces the result when a sum is out of the trusted range; None leaves the
                result as it is (the flag says that it is wrong).

        Returns:
            ``(out, T or None, flag)``, flag (1,) > 0 where some sum was out of range. This
            implementation reads the flag on the host before a recompute (the torch backend's
            CPU tensors); a device backend guards the recompute on the device instead.
        """
        lo, hi = PLAN_SUM_RANGE
        sigma = 0.0 if shift is None else shift[:, None]
        t = old - sigma - eps * (torch.log(sums.to(old.dtype)) - rows.logw)
        out = t * beta if alpha == 0.0 else alpha * old + beta * t
        flag = (~((sums >= lo) & (sums <= hi))).any().to(old.dtype).reshape(1)
        if redo is not None and bool(flag):
            cols, col_pot, precision = redo
            out, t = self.softmin(rows, cols, col_pot, eps, old, alpha, beta, True, precision)
        return out, (t if want_raw else None), flag

    # Transport operators from potentials (docs/transport.md). Not abstract, so that a partial
    # backend (e.g. a test double) still instantiates; both shipped backends implement them.

    def transport(
        self,
        rows: Side,
        cols: Side,
        row_pot: torch.Tensor,
        col_pot: torch.Tensor,
        eps: float,
        V: torch.Tensor | None,
        A: torch.Tensor | None,
        Bw: torch.Tensor | None,
        precision: str,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Applies the plan of (row_pot, col_pot) to V in one streaming pass.

        With P_ij = w^R_i w^C_j exp((row_pot_i + col_pot_j − ‖r_i − c_j‖²) / eps), computes
        ``out = (P ∘ A Bwᵀ) V`` (``P V`` when A and Bw are None) and the row marginal
        ``â = P 1``. ``Pᵀ U`` is ``transport(cols, rows, col_pot, row_pot, …, U, …)``.

        Args:
            rows: the side indexing the output rows, n points.
            cols: the side summed over, m points.
            row_pot: (B, n) potential of the row side.
            col_pot: (B, m) potential of the column side.
            eps: entropic regularisation (run-time value).
            V: (B, m, p) values, any width p; None computes the marginal only.
            A: (B, n, r) left Hadamard factor, or None.
            Bw: (B, m, r) right Hadamard factor, or None (given together with A).
            precision: "ieee", "tf32" or "tf32x3" for the matrix products.

        Returns:
            ``(out (B, n, p) or None, marginal (B, n))`` in the potential dtype.
        """
        raise NotImplementedError(f"backend {self.name!r} has no transport operator")

    def transport_grad(
        self,
        rows: Side,
        cols: Side,
        row_pot: torch.Tensor,
        col_pot: torch.Tensor,
        eps: float,
        precision: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Envelope gradient of OT_eps w.r.t. the row points, fused in one pass.

        Returns:
            ``(2 (diag(â) r − P c) (B, n, d), â (B, n))`` in the potential dtype, with P the
            plan of (row_pot, col_pot) and â = P 1 its row marginal (induced marginal).
        """
        raise NotImplementedError(f"backend {self.name!r} has no transport gradient")

    # Sampling from a plan (docs/couplings.md). Not abstract, like the transports.

    def plan_argmax(
        self,
        rows: Side,
        cols: Side,
        col_pot: torch.Tensor,
        eps: float,
        precision: str,
        idx: torch.Tensor | None = None,
        seed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The column of largest plan entry of each row, optionally Gumbel-perturbed.

        For a row i the plan's columns are P_ij ∝ w^C_j exp((col_pot_j − C_ij) / eps); the
        row factor does not move the argmax, so the row potential is not needed. With
        ``seed`` the argmax is of log P_ij + G_ij, G the counter-based Gumbel noise of
        backends/gumbel.py for the draw counters b·k + r: a draw j ~ P_i· per row. The plan
        is streamed, never stored.

        Args:
            rows: the side of the rows, n points.
            cols: the side of the columns, m points.
            col_pot: (B, m) potential of the column side.
            eps: entropic regularisation of the plan.
            precision: "ieee", "tf32" or "tf32x3" for the dot products.
            idx: (B, k) int64 rows to visit (draw r reads row idx[b, r]); None: every row.
            seed: (2,) int64 seed words (backends/gumbel.py) on the problem's device; None:
                the plain argmax.

        Returns:
            (B, k) int64 column indices (k = n when ``idx`` is None).
        """
        raise NotImplementedError(f"backend {self.name!r} has no plan sampler")

    def launch_tensors(self, problem) -> tuple[torch.Tensor, ...]:
        """Tensors besides the problem's own fields that this backend's launches on
        ``problem`` read (a staged copy of a label table): a cached CUDA graph of its launches
        is keyed by them too (solvers/graphs.py). None by default."""
        return ()

    def bound_error(self, err: torch.Tensor) -> torch.Tensor:
        """(B,) marginal error of the exact plan from the error measured by the last soft-mins
        (``want_raw``): the identity, except for a backend that visits part of the plan only
        (multiscale: it adds the bound of the skipped mass)."""
        return err

    def reduce_error(self, err: torch.Tensor) -> torch.Tensor:
        """(B,) marginal error of the whole problem from this process's part of it: the
        identity, except for a backend that shards one problem over several processes."""
        return err

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sums over the processes that share one problem of this process's partial sums
        ``t`` (inner products over a sharded iterate: Anderson mixing): the identity, except
        for a backend that shards one problem over several processes."""
        return t

    def threads(self):
        """Context in which the solver loop runs: the CPU kernel path of a small problem runs
        it on one intra-op thread (parallel regions cost more than they save there)."""
        return contextlib.nullcontext()

    def release(self) -> None:
        """Called once the solve of its problem is done: a backend that holds per-problem
        buffers (the CPU kernel path's stored kernel) frees them. Later calls still work."""
        return None

    def dual_value(self, problem, f: torch.Tensor, g: torch.Tensor, eps: float):
        """(B,) OT_eps of the potentials in one fused reduction, or None when the backend has
        none (solvers/objective.dual_value then evaluates its torch formula)."""
        return None
