"""Benchmark cases: problem sizes and the input generator shared by every provider.

Protocol (bench/README.md): x, y ~ U[0, 1]^d, random positive weights normalised to one,
eps = 0.1 for the full squared-Euclidean cost ``C_ij = ||x_i - y_j||^2``, a fixed number
of iterations (no annealing, no early stop), float32 inputs.

Inputs are drawn on the CPU from a generator seeded by the problem size, so every
provider (PyTorch or JAX, CPU or GPU) solves exactly the same problem and the values
they report can be compared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

#: Entropic regularisation for the full squared-Euclidean cost.
EPS = 0.1
#: Fixed number of Sinkhorn iterations (potential updates) in every case.
ITERS = 10


@dataclass(frozen=True)
class Size:
    """One problem size: ``n`` source points, ``m`` target points in dimension ``d``.

    ``B`` is the batch size for batched cases (``None`` for a single problem).
    """

    n: int
    m: int
    d: int
    B: int | None = None

    def label(self) -> str:
        """Short human-readable label, e.g. ``10000x10000 d=64`` or ``B=64 1024x1024 d=3``."""
        core = f"{self.n}x{self.m} d={self.d}"
        return f"B={self.B} {core}" if self.B else core

    def as_dict(self) -> dict:
        """Plain dict, the JSON form used between the driver and its workers."""
        return {"n": self.n, "m": self.m, "d": self.d, "B": self.B}

    @staticmethod
    def from_dict(d: dict) -> Size:
        """Inverse of :meth:`as_dict`."""
        return Size(int(d["n"]), int(d["m"]), int(d["d"]), d.get("B"))


@dataclass(frozen=True)
class Case:
    """A benchmark case.

    ``kind`` is one of ``fwd`` (solve only), ``fwdbwd`` (OT value and its gradient with
    respect to x), ``batched`` (fwd+bwd on a batch of problems), ``firstcall`` (a fresh
    process: import, first solve, then a new n at the same d) and ``hvp`` (a Hessian-vector
    product from converged potentials; ``iters`` of its rows counts CG iterations).
    """

    name: str
    kind: str
    sizes: tuple[Size, ...]
    cpu_sizes: tuple[Size, ...]
    description: str
    params: dict = field(default_factory=dict)

    def select(self, device: str, quick: bool) -> tuple[Size, ...]:
        """Sizes to run: tiny ones on CPU, the first (reference) size with ``--quick``."""
        if device == "cpu":
            return self.cpu_sizes
        return self.sizes[:1] if quick else self.sizes


def _sq(n: int, d: int, B: int | None = None) -> Size:
    return Size(n, n, d, B)


CASES: dict[str, Case] = {
    "fwd": Case(
        name="fwd",
        kind="fwd",
        sizes=(
            _sq(10_000, 64),
            _sq(10_000, 512),
            _sq(40_000, 128),
            _sq(50_000, 64),
            _sq(20_000, 1024),
        ),
        cpu_sizes=(_sq(256, 8), _sq(300, 17)),
        description="forward solve: potentials f, g and the OT value",
    ),
    "fwdbwd": Case(
        name="fwdbwd",
        kind="fwdbwd",
        sizes=(_sq(10_000, 128), _sq(10_000, 512), _sq(40_000, 128)),
        cpu_sizes=(_sq(256, 8),),
        description="OT value and its gradient with respect to x",
    ),
    "batched": Case(
        name="batched",
        kind="batched",
        sizes=(_sq(1024, 3, 64),),
        cpu_sizes=(_sq(128, 3, 4),),
        description="training shape: B problems, OT value (B,) and gradient w.r.t. x",
    ),
    "firstcall": Case(
        name="firstcall",
        kind="firstcall",
        sizes=(_sq(10_000, 64),),
        cpu_sizes=(_sq(512, 8),),
        description="fresh process: import + first solve, then a new n at the same d",
        params={"second_n_factor": 1.5},
    ),
    "hvp": Case(
        name="hvp",
        kind="hvp",
        sizes=(_sq(10_000, 64),),
        cpu_sizes=(_sq(256, 8),),
        description=(
            "Hessian-vector product of OT_eps w.r.t. x from converged potentials: exactly "
            "cg_iters CG iterations, tau = 1e-5, strict fp32 (bench/providers/_hvp.py)"
        ),
        params={"cg_iters": 50, "tau": 1e-5},
    ),
}


def parse_sizes(spec: str, kind: str, batch: int | None = None) -> tuple[Size, ...]:
    """Parse ``--sizes`` such as ``2000x64,10000x64`` (n=m) or ``2000x3000x64`` (n, m, d).

    For batched cases ``batch`` (default 64) is the batch size of every size.
    """
    out = []
    for tok in filter(None, (t.strip() for t in spec.split(","))):
        parts = [int(p) for p in re.split(r"[x:]", tok)]
        if len(parts) == 2:
            n, d = parts
            m = n
        elif len(parts) == 3:
            n, m, d = parts
        else:
            raise ValueError(f"--sizes: cannot parse {tok!r}; use NxD or NxMxD")
        B = (batch or 64) if kind == "batched" else None
        out.append(Size(n, m, d, B))
    return tuple(out)


def seed_for(size: Size) -> int:
    """Deterministic seed derived from the size (so each size gets its own clouds)."""
    return (size.n * 1_000_003 + size.m * 10_007 + size.d * 101 + (size.B or 0)) % (2**31 - 1)


def make_inputs(size: Size, device: str | torch.device = "cpu", dtype=torch.float32):
    """Return ``x, y, a, b`` for ``size``: uniform clouds and random normalised weights.

    Shapes: ``x`` (n, d) / ``y`` (m, d) / ``a`` (n,) / ``b`` (m,), or with a leading
    batch axis when ``size.B`` is set. Drawn on the CPU (float64, then cast) and moved.
    """
    gen = torch.Generator().manual_seed(seed_for(size))
    lead = (size.B,) if size.B else ()
    x = torch.rand(*lead, size.n, size.d, generator=gen, dtype=torch.float64)
    y = torch.rand(*lead, size.m, size.d, generator=gen, dtype=torch.float64)
    a = torch.rand(*lead, size.n, generator=gen, dtype=torch.float64) + 0.5
    b = torch.rand(*lead, size.m, generator=gen, dtype=torch.float64) + 0.5
    a = a / a.sum(-1, keepdim=True)
    b = b / b.sum(-1, keepdim=True)
    return tuple(t.to(dtype).contiguous().to(device) for t in (x, y, a, b))
