"""Triton backend: streaming kernels for CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)."""

from __future__ import annotations

import torch

from ...tuning import TUNING
from ..base import Backend, Capabilities
from . import operands, plan, plan_self, softmin


class TritonBackend(Backend):
    """Streaming online-LSE kernels; potentials and reductions in fp32."""

    name = "triton"
    capabilities = Capabilities(graph_safe=True, kernels=True)

    def launch_tensors(self, problem):
        # the on-chip label tables live in a cache of operands.py, outside the problem
        sides = (problem.X,) if problem.X is problem.Y else (problem.X, problem.Y)
        return operands.staged_tables(sides)

    def softmin(self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision):
        return softmin.softmin(rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision)

    def half_step(
        self, rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision, phase="cold"
    ):  # fmt: skip
        # TUNING.plan_half: from an iterate, the row sums of the plan of (old, col_pot) give
        # the half-step without a running max (plan.py); False: the online-LSE sweep.
        if (
            phase in ("second", "iterate")
            and TUNING.plan_half
            and plan.half_eligible(rows, cols, eps)
        ):
            return plan.half_step(rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision)
        return self.softmin(rows, cols, col_pot, eps, old, alpha, beta, want_raw, precision)

    def symmetric_step(
        self, X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, phase="cold"
    ):  # fmt: skip
        # TUNING.plan_step: symmetric steps from an iterate read both soft-mins off one plan
        # sweep (plan.py); False: the two-sweep online-LSE step. At large eps the two-sweep
        # step expands about the mean score (softmin.py), the plan sweep does not.
        plan_ok = eps < X.large_eps and plan.eligible(X, Y) and plan.preferred(X)
        if phase != "cold" and TUNING.plan_step and plan_ok:
            return plan.symmetric_step(
                X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision, phase
            )
        return softmin.symmetric_step(X, Y, f, g, eps, alpha, beta_x, beta_y, want_raw, precision)

    def self_step(self, X, f, eps, alpha, beta, want_raw, precision, phase="cold"):
        # The self plan is symmetric: one sweep over the upper triangle of its tiles gives
        # T(f) (plan_self.py), under the same conditions as the plan step. The plain update
        # from zero potentials keeps the online-LSE sweep.
        ok = eps < X.large_eps and plan_self.eligible(X) and plan.preferred(X)
        if phase in plan_self.PHASES and TUNING.plan_step and ok:
            return plan_self.self_step(X, f, eps, alpha, beta, want_raw, precision, phase)
        return softmin.softmin(X, X, f, eps, f, alpha, beta, want_raw, precision)

    def has_plan_sums(self, X, Y, eps, cols):
        # the conditions of this backend's own plan steps (symmetric_step, half_step), less
        # the half-step's size threshold (a sharded problem's blocks are large by design)
        ok = eps < X.large_eps and plan.eligible(X, Y)
        if cols:
            return ok and TUNING.plan_step and plan.preferred(X)
        return ok and TUNING.plan_half

    def plan_sums(self, X, Y, f, g, eps, precision, shift, cols):
        from . import plan_block

        return plan_block.block_sums(X, Y, f, g, eps, precision, shift, cols)

    def plan_shift(self, X, Y, f, g, eps, phase):
        return plan.phase_shift(X, Y, f, g, eps, phase) if phase in plan.PHASES else None

    def sums_step(self, rows, sums, old, eps, alpha, beta, want_raw, shift, redo):
        from . import plan_block

        return plan_block.sums_step(rows, sums, old, eps, alpha, beta, want_raw, shift, redo)

    def softmin_pair(self, first, second, eps, alpha, want_raw, precision):
        from . import pair

        if pair.eligible(first, second, precision):
            return pair.pair_step(first, second, eps, alpha, want_raw, precision)
        return super().softmin_pair(first, second, eps, alpha, want_raw, precision)

    def transport(self, rows, cols, row_pot, col_pot, eps, V, A, Bw, precision):
        from . import transport

        return transport.transport(rows, cols, row_pot, col_pot, eps, V, A, Bw, precision)

    def transport_grad(self, rows, cols, row_pot, col_pot, eps, precision):
        from . import transport

        return transport.transport_grad(rows, cols, row_pot, col_pot, eps, precision)

    def plan_argmax(self, rows, cols, col_pot, eps, precision, idx=None, seed=None):
        from . import sample

        return sample.plan_argmax(rows, cols, col_pot, eps, precision, idx, seed)

    def dual_value(self, problem, f, g, eps):
        # One launch (sums.py) in float32. resolve_backend keeps float64 off this backend; the
        # check keeps the contract (None: use the torch formula) explicit.
        if problem.dtype != torch.float32:
            return None
        from . import sums

        return sums.dual_value(problem, f, g, eps)
