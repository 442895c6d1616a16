"""``OTPlanSampler`` with the interface of torchcfm's sampler, on streamed plans.

An OT-CFM training script written against ``torchcfm.optimal_transport.OTPlanSampler``
switches by changing its import: the constructor arguments and the methods ``get_map``,
``sample_map``, ``sample_plan``, ``sample_plan_with_labels`` and ``sample_trajectory`` keep
their meaning, while the plans are solved on the batches' device and sampled without forming
them (docs/couplings.md lists the differences).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import _validation as V
from .._boundary import entry_point
from ..result import SinkhornResult
from .minibatch import flatten_pair, solve_batches
from .sampling import draw_columns, draw_rows, resolve_generator

METHODS = ("exact", "sinkhorn", "unbalanced")


def max_sq_distance(x0: torch.Tensor, x1: torch.Tensor, rows: int = 4096) -> float:
    """max_ij ‖x0_i − x1_j‖² in row blocks (the normaliser of ``normalize_cost=True``)."""
    a = x0.double() if x0.dtype == torch.float64 else x0.float()
    b = x1.to(a.dtype)
    b_sq = b.square().sum(1)
    top = torch.zeros((), dtype=a.dtype, device=a.device)
    for s in range(0, a.shape[0], rows):
        blk = a[s : s + rows]
        d2 = blk.square().sum(1)[:, None] + b_sq[None, :] - 2.0 * blk @ b.T
        top = torch.maximum(top, d2.amax())
    return float(top)


class OTPlanSampler:
    """Samples minibatch pairs from an optimal-transport plan (squared Euclidean cost).

    The interface of torchcfm 1.0.7's ``OTPlanSampler``: build it with a method and call
    ``sample_plan(x0, x1)`` each training step. Plans are solved by
    :func:`flashsinkhorn.sinkhorn` on the batches' device and sampled by
    :func:`flashsinkhorn.coupling.sample_pairs` (never stored), so no cost matrix goes to the
    host.

    Args:
        method: "exact" (a near-exact entropic plan: eps annealed to 1e-3 times the mean
            squared distance, whose expected pair cost was measured within 1 % of POT's
            ``ot.emd``, docs/couplings.md; not an exact linear-programming solution),
            "sinkhorn" (entropic plan with eps = ``reg``) or "unbalanced" (KL-relaxed
            marginals of strength ``reg_m``, eps = ``reg``). "partial" is not supported and
            raises ``ValueError``.
        reg: eps of "sinkhorn" and "unbalanced", in units of the squared distance (of the
            cost divided by its maximum with ``normalize_cost``). Default 0.05.
        reg_m: marginal relaxation of "unbalanced", same units. Default 1.0.
        normalize_cost: divide the cost by its maximum over the minibatch (reg and reg_m are
            then relative to it). Default False.
        num_threads: accepted for compatibility (POT's exact solver threads); unused.
        warn: accepted for compatibility; unused (non-convergence warns with
            :class:`~flashsinkhorn.ConvergenceWarning`, and a plan float32 cannot represent
            raises instead of falling back to a uniform plan).
        backend: "auto", "torch" or "triton", as in :func:`flashsinkhorn.sinkhorn`.
        tol: marginal-error tolerance of each solve. Default 1e-3.
        generator: ``torch.Generator`` for the draws (on the batches' device); default
            torch's default generator (``torch.manual_seed`` makes runs reproducible).

    Raises:
        ValueError: an unknown method, "partial", or out-of-range reg / reg_m.
    """

    def __init__(
        self,
        method: str,
        reg: float = 0.05,
        reg_m: float = 1.0,
        normalize_cost: bool = False,
        num_threads: int | str = 1,
        warn: bool = True,
        *,
        backend: str = "auto",
        tol: float | None = 1e-3,
        generator: torch.Generator | None = None,
    ) -> None:
        if method == "partial":
            raise ValueError(
                "method='partial' (entropic partial Wasserstein) is not supported; use "
                "method='unbalanced', whose KL-relaxed marginals also leave outliers "
                "unmatched"
            )
        self.method = V.check_choice("method", method, METHODS)
        self.reg = V.check_positive("reg", reg)
        self.reg_m = V.check_positive("reg_m", reg_m)
        self.normalize_cost = V.check_bool("normalize_cost", normalize_cost)
        self.num_threads = num_threads
        self.warn = warn
        self.backend = V.check_choice("backend", backend, V.BACKENDS)
        self.tol = V.check_positive("tol", tol, allow_none=True)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator)}")
        self.generator = generator

    # ----- solves -----

    def _solve(self, x0: torch.Tensor, x1: torch.Tensor) -> SinkhornResult:
        f0, f1 = flatten_pair(x0, x1)
        f0, f1 = f0.detach(), f1.detach()
        scale = max_sq_distance(f0, f1) if self.normalize_cost else 1.0
        eps, rho, mode = self.reg, None, {"sinkhorn": "entropic"}.get(self.method, self.method)
        if self.method == "exact":
            eps = None  # the near-exact mode's own eps (minibatch.default_eps)
        elif self.method == "unbalanced":
            rho = self.reg_m
        return solve_batches(f0, f1, eps=eps, mode=mode, rho=rho, tol=self.tol, n_iters=1000,
                             backend=self.backend, precision="auto", scale=scale)  # fmt: skip

    def _pairs(self, x0, x1, replace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        replace = V.check_bool("replace", replace)
        res = self._solve(x0, x1)
        gen = resolve_generator(self.generator, None, res.solution.problem.device)
        with torch.no_grad():
            rows = draw_rows(res, x0.shape[0], replace, gen)
            cols = draw_columns(res, rows, gen)
        return rows[0], cols[0]

    # ----- the torchcfm interface -----

    @entry_point
    def get_map(self, x0: torch.Tensor, x1: torch.Tensor) -> np.ndarray:
        """The dense plan between two minibatches, as a NumPy array (n, m) summing to 1.

        Forms the n × m plan (as torchcfm does); training steps should call
        :meth:`sample_plan`, which never does.
        """
        res = self._solve(x0, x1)
        P = res.plan(max_elements=max(1 << 26, x0.shape[0] * x1.shape[0]))
        return P.double().cpu().numpy()

    def sample_map(
        self, pi, batch_size: int, replace: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """Draws ``batch_size`` index pairs from a dense plan ``pi`` (NumPy array or tensor,
        (n, m)) with NumPy's global generator, as torchcfm does.

        Returns:
            ``(i, j)`` NumPy int arrays of shape (batch_size,).
        """
        pi = pi.detach().cpu().numpy() if isinstance(pi, torch.Tensor) else np.asarray(pi)
        if pi.ndim != 2:
            raise ValueError(f"pi must be a 2-D plan (n, m), got shape {pi.shape}")
        batch_size = V.check_int("batch_size", batch_size, 1)
        w = pi.reshape(-1).astype(np.float64)
        w = w / w.sum()
        # NumPy's global generator, as torchcfm: np.random.seed makes the draws reproducible
        flat = np.random.choice(w.size, size=batch_size, replace=bool(replace), p=w)  # noqa: NPY002
        return np.divmod(flat, pi.shape[1])

    @entry_point
    def sample_plan(
        self, x0: torch.Tensor, x1: torch.Tensor, replace: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Solves the plan between two minibatches and returns ``(x0[i], x1[j])`` for
        len(x0) pairs drawn from it (streamed: the plan is never formed).

        ``replace=True`` (default) draws i.i.d. pairs (i, j) ~ P. ``replace=False`` draws
        every row once, each with its partner j ~ P_ij / â_i (torchcfm draws distinct
        (i, j) cells of the flattened plan instead; for a permutation plan both give the
        permutation).
        """
        i, j = self._pairs(x0, x1, replace)
        return x0[i], x1[j]

    @entry_point
    def sample_plan_with_labels(
        self,
        x0: torch.Tensor,
        x1: torch.Tensor,
        y0: torch.Tensor | None = None,
        y1: torch.Tensor | None = None,
        replace: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """As :meth:`sample_plan`, also returning the labels of the pairs.

        Returns:
            ``(x0[i], x1[j], y0[i] or None, y1[j] or None)``.
        """
        i, j = self._pairs(x0, x1, replace)
        return (x0[i], x1[j], None if y0 is None else y0[i], None if y1 is None else y1[j])

    @entry_point
    def sample_trajectory(self, X: torch.Tensor) -> torch.Tensor:
        """Chains plans between consecutive time slices into trajectories.

        Starting from every sample of slice 0, each next point is drawn from the plan between
        slices t and t + 1 given the current one (streamed).

        Args:
            X: (bs, times, ...) populations at successive times.

        Returns:
            (bs, times, ...) tensor of trajectories, on X's device (torchcfm returns a NumPy
            array of the same content for CPU tensors).
        """
        if not isinstance(X, torch.Tensor) or X.dim() < 3:
            raise ValueError("X must be a tensor of shape (bs, times, ...)")
        bs, times = X.shape[0], X.shape[1]
        idx = torch.arange(bs, device=X.device)
        path = [idx]
        gen = resolve_generator(self.generator, None, X.device)
        with torch.no_grad():
            for t in range(times - 1):
                res = self._solve(X[:, t], X[:, t + 1])
                idx = draw_columns(res, idx[None, :], gen)[0]
                path.append(idx)
        return torch.stack([X[:, t][path[t]] for t in range(times)], dim=1)
