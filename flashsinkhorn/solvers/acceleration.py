"""Acceleration of the Sinkhorn fixed-point iteration: over-relaxation and Anderson mixing.

Both keep their state per problem of a batch (problems converge at different rates) and read
nothing from the device between two convergence tests. The derivations and measured iteration
counts are in docs/convergence.md.

Over-relaxation replaces a half-step ``f ← λ T(g)`` by ``f ← (1 − ω) f + ω λ T(g)``.
Alternating (Gauss–Seidel) Sinkhorn is a 2-cyclic iteration whose plain rate is
κ = σ², so successive over-relaxation with ω* = 2 / (1 + sqrt(1 − κ)) brings the rate to
ω* − 1. :class:`AdaptiveOmega` estimates κ from the marginal errors that the loop measures
anyway (every ``check_every`` iterations): from steady plain windows (the symmetric schedule,
or after the safeguard), and, while over-relaxing (the alternating schedule starts at
``OMEGA_START``), from Young's relation κ = (ρ + ω − 1)² / (ω² ρ) for the observed rate ρ. An
error that grows between two tests drops that problem back to ω = 1 (also a fixed ω: the
safeguard against a factor too large for the problem). For the symmetric (Jacobi, averaged)
schedule the averaging weight θ = ω/2 must stay below 1 (the mass mode has eigenvalue −1).

Anderson acceleration (type II) mixes the last ``memory`` iterates of the fixed-point map
u ↦ F(u) by a regularised least-squares fit of their residuals r = F(u) − u. A mixed iterate
whose marginal error is larger than its predecessor's is rejected: the problem takes the plain
step from the previous iterate and its history is cleared (a safeguard that costs no host
synchronisation: the comparison is a mask on the device).
"""

from __future__ import annotations

import math

import torch

#: Largest over-relaxation factor the adaptive rule uses (ω → 2 stalls near convergence).
OMEGA_CAP = 1.95
#: Where the adaptive factor of the alternating schedule starts: below ω* of every problem
#: but the easiest (whose plain rate is fast anyway), so that the first windows already gain;
#: the measured rates then raise it (Young's relation) or the safeguard drops it to 1.
OMEGA_START = 1.5
#: Tikhonov weight of Anderson's least squares, relative to the trace of ΔRᵀΔR.
ANDERSON_REG = 1e-8


class AdaptiveOmega:
    """Per-problem over-relaxation factors estimated from the observed error decay.

    Args:
        batch: number of problems B.
        schedule: "alternating" (ω for SOR on each half-step) or "symmetric" (ω = 2θ, θ the
            averaging weight of the new soft-min).
        fixed: a fixed ω for every problem (only the safeguard changes it), or None to adapt.
    """

    def __init__(self, batch: int, schedule: str, fixed: float | None = None):
        self.schedule = schedule
        self.fixed = fixed
        if fixed is not None:
            start = float(fixed)
        else:
            start = OMEGA_START if schedule == "alternating" else 1.0
        self.omega = [start] * batch
        self._cap = [OMEGA_CAP] * batch
        self._prev: list[float | None] = [None] * batch
        self._rates: list[list[float]] = [[] for _ in range(batch)]
        self._window_omega = list(self.omega)
        self._tensor = None

    def uniform(self) -> float | None:
        """The common ω when every problem has the same one (scalar kernel arguments)."""
        first = self.omega[0]
        return first if all(w == first for w in self.omega) else None

    def update(self, errors: list[float], window: int) -> None:
        """Takes the errors measured at a check, ``window`` iterations after the previous one."""
        for i, e in enumerate(errors):
            prev, self._prev[i] = self._prev[i], e
            used = self._window_omega[i]
            self._window_omega[i] = self.omega[i]
            if prev is None or not prev > 0 or e == 0:
                continue
            if not e <= prev:  # grew, or is not finite
                # Growing error: back to the plain iteration, never as far as this ω again.
                if self.omega[i] > 1.0:
                    self._cap[i] = 1.0 + 0.5 * (self.omega[i] - 1.0)
                self.omega[i] = 1.0
                self._rates[i] = []
                continue
            if self.fixed is not None:
                continue
            rho = (e / prev) ** (1.0 / window)
            if used == 1.0:
                self._plain(i, rho)
            elif used == self.omega[i]:
                self._young(i, rho, used)

    def _target(self, i: int, kappa: float) -> float:
        kappa = min(max(kappa, 0.0), 1.0 - 1e-12)
        if self.schedule == "symmetric":
            # plain averaged rate (1 + σ)/2: σ = 2κ − 1, best θ = 2 / (3 − σ), ω = 2θ
            sigma = 2.0 * kappa - 1.0
            omega = 4.0 / (3.0 - sigma)
        else:
            omega = 2.0 / (1.0 + math.sqrt(1.0 - kappa))
        return min(omega, self._cap[i])

    def _plain(self, i: int, rho: float) -> None:
        rates = self._rates[i]
        rates.append(rho)
        if len(rates) < 3:
            return
        r0, r1, r2 = rates[-3:]
        steady = all(r < 1.0 for r in (r0, r1, r2)) and abs(r2 - r1) <= 0.25 * (1.0 - r2)
        if steady:
            self.omega[i] = max(1.0, self._target(i, r2))

    def _young(self, i: int, rho: float, omega: float) -> None:
        if self.schedule != "alternating" or rho <= 1.05 * (omega - 1.0):
            return
        kappa = (rho + omega - 1.0) ** 2 / (omega * omega * rho)
        self.omega[i] = max(omega, self._target(i, kappa))

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        """(B, 1) ω on the device of ``like`` (copied there again only after ω changed)."""
        key = (tuple(self.omega), like.dtype, like.device)
        if self._tensor is None or self._tensor[0] != key:
            t = torch.tensor(self.omega, dtype=like.dtype, device=like.device)[:, None]
            self._tensor = (key, t)
        return self._tensor[1]


class Anderson:
    """Type-II Anderson mixing of a batched fixed-point iteration u ↦ F(u), with a safeguard.

    Args:
        like: (B, N) tensor giving the batch, size, dtype and device of the iterates.
        memory: number of past differences of iterates and residuals in the least-squares
            fit (>= 1).
        gauge: (B, N) weights w such that F(u + c) = F(u) + c (the potentials' translation
            freedom of a balanced problem): every mixed iterate is centred to <w, u> = 0.
            None when there is no such freedom.
        reduce: for an iterate sharded over processes (each holds N of its entries): sums
            per-process partial sums over the processes (``Backend.reduce_sum``). Every inner
            product of a step (the least-squares system, the gauge's, the marginal error)
            then goes through one call of it per step; None: the iterate is whole.
    """

    def __init__(self, like: torch.Tensor, memory: int, gauge: torch.Tensor | None = None,
                 reduce=None):  # fmt: skip
        B, N = like.shape
        self.m = int(memory)
        # Circular buffers of the last differences of iterates and of residuals; a problem's
        # history is cleared by zeroing its rows (a zero column gets a zero coefficient).
        self.dU = like.new_zeros(B, self.m, N)
        self.dR = like.new_zeros(B, self.m, N)
        self.slot = 0
        self.reduce = reduce
        if gauge is not None:
            mass = gauge.sum(-1, keepdim=True)
            gauge = gauge / (mass if reduce is None else reduce(mass))
        self.gauge = gauge
        self._eye = torch.eye(self.m, dtype=like.dtype, device=like.device)
        self._prev = None  # (u, r, err) of the last accepted iterate
        self._mixed = torch.zeros(B, dtype=torch.bool, device=like.device)
        #: rejected mixed iterates, summed over the batch (a device counter)
        self.rejected = torch.zeros((), dtype=torch.long, device=like.device)
        #: (B,) marginal error of the last step's input plan, over every process
        self.err: torch.Tensor | None = None

    def step(self, u: torch.Tensor, Fu: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
        """The next iterate from the current one, its image and the error of its plan.

        Args:
            u: (B, N) current iterate.
            Fu: (B, N) its image under the fixed-point map.
            err: (B,) marginal error of the plan that ``u`` defines (this process's part of
                it with ``reduce``; :attr:`err` holds the whole after the step).
        """
        if self.reduce is not None:
            return self._sharded_step(u, Fu, err)
        self.err = err
        r = Fu - u
        if self._prev is not None:
            pu, pr, _ = self._prev
            u, r, err, clear = self._safeguard(u, r, err)
            # (zero for the rejected problems: u and r are their predecessors again)
            self.dU[:, self.slot] = u - pu
            self.dR[:, self.slot] = r - pr
            self.slot = (self.slot + 1) % self.m
        self._prev = (u, r, err)
        gram = self.dR @ self.dR.transpose(1, 2)  # (B, m, m)
        gamma, trace = self._solve(gram, self.dR @ r[:, :, None])
        mixed = u + r - ((self.dU + self.dR) * gamma).sum(1)
        self._mixed = trace > 0
        if self.gauge is not None:
            mixed = mixed - (self.gauge * mixed).sum(-1, keepdim=True)
        return mixed

    def _safeguard(self, u, r, err):
        """A mixed iterate that raised the error is replaced by the plain step from its
        predecessor, and that problem's history starts again: ``(u, r, err, keep)`` with
        keep (B, 1, 1) 0 for the rejected problems (their history is zeroed)."""
        pu, pr, perr = self._prev
        bad = self._mixed & (err > perr)
        self.rejected += bad.sum()
        u = torch.where(bad[:, None], pu, u)
        r = torch.where(bad[:, None], pr, r)
        err = torch.where(bad, perr, err)
        keep = (~bad).to(u.dtype)[:, None, None]
        self.dU.mul_(keep)
        self.dR.mul_(keep)
        return u, r, err, keep

    def _solve(self, gram: torch.Tensor, rhs: torch.Tensor):
        """(γ (B, m, 1), trace (B,)) of the regularised least squares gram γ = rhs."""
        trace = gram.diagonal(dim1=1, dim2=2).sum(-1)
        reg = ANDERSON_REG * trace + torch.finfo(gram.dtype).tiny
        # Cholesky of the regularised (SPD) Gram matrix: no pivoting, no host synchronisation.
        chol, _ = torch.linalg.cholesky_ex(gram + reg[:, None, None] * self._eye)
        gamma = torch.cholesky_solve(rhs, chol)
        return torch.nan_to_num(gamma, nan=0.0, posinf=0.0, neginf=0.0), trace

    def _sharded_step(self, u, Fu, err):
        """:meth:`step` of an iterate sharded over processes, with one ``reduce`` of every
        partial sum: the history is updated first as if the mixed iterate were kept, and a
        rejected problem's sums are replaced afterwards by those of a cleared history (zero
        Gram matrix and right-hand side; the plain step from its predecessor)."""
        B, m = u.shape[0], self.m
        r = Fu - u
        prev = self._prev
        if prev is not None:
            pu, pr, _ = prev
            self.dU[:, self.slot] = u - pu
            self.dR[:, self.slot] = r - pr
            self.slot = (self.slot + 1) % m
        gram = (self.dR @ self.dR.transpose(1, 2)).reshape(B, -1)
        parts = [gram, (self.dR @ r[:, :, None])[..., 0], err.reshape(B, 1)]
        if self.gauge is not None:
            gw = self.gauge[:, None, :]
            parts += [(gw * (self.dU + self.dR)).sum(-1), (self.gauge * (u + r)).sum(-1, True)]
            if prev is not None:
                parts.append((self.gauge * (pu + pr)).sum(-1, keepdim=True))
        sums = self.reduce(torch.cat(parts, -1))
        gram = sums[:, : m * m].reshape(B, m, m)
        rhs = sums[:, m * m : m * m + m, None]
        err = self.err = sums[:, m * m + m]
        if prev is not None:
            u, r, err, good = self._safeguard(u, r, err)
            gram, rhs = gram * good, rhs * good
            bad = good[:, 0, 0] == 0
        self._prev = (u, r, err)
        gamma, trace = self._solve(gram, rhs)
        mixed = u + r - ((self.dU + self.dR) * gamma).sum(1)
        self._mixed = trace > 0
        if self.gauge is not None:
            k = m * m + m + 1
            # <w, mixed> = <w, u + r> − Σ_k γ_k <w, dU_k + dR_k>
            centre = sums[:, k + m] - (sums[:, k : k + m] * gamma[..., 0]).sum(-1)
            if prev is not None:
                centre = torch.where(bad, sums[:, k + m + 1], centre)
            mixed = mixed - centre[:, None]
        return mixed
