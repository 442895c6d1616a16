"""The problems of each case: fp32 inputs drawn on the CPU from fixed seeds."""

from __future__ import annotations

from dataclasses import dataclass

CASES = ("u64", "u64_50k", "shape3d", "mix16", "batched", "unbalanced")


@dataclass
class Problem:
    """One solve: inputs (CPU, fp32), eps and relaxation."""

    case: str
    pid: str
    x: object
    y: object
    a: object
    b: object
    eps: float
    rho: float | None = None

    @property
    def batched(self) -> bool:
        return self.x.dim() == 3

    def shape(self) -> dict:
        B = self.x.shape[0] if self.batched else None
        n, d = self.x.shape[-2:]
        return {"B": B, "n": int(n), "m": int(self.y.shape[-2]), "d": int(d)}

    def key(self) -> str:
        s = self.shape()
        return f"{self.pid}|{s['B']}|{s['n']}|{s['m']}|{s['d']}|{self.eps:.6g}|{self.rho}"


def _uniform(shape):
    import torch

    return torch.full(shape, 1.0 / shape[-1], dtype=torch.float32)


def _gen(seed):
    import torch

    return torch.Generator().manual_seed(seed)


def _mixture(gen, n, means, std):
    import torch

    k, d = means.shape
    lab = torch.randint(0, k, (n,), generator=gen)
    return means[lab] + std * torch.randn(n, d, generator=gen)


def bbox_diameter(x, y) -> float:
    """Diagonal of the bounding box of both clouds (batched: the largest)."""
    import torch

    pts = torch.cat([x, y], dim=-2)
    ext = pts.amax(dim=-2) - pts.amin(dim=-2)
    return float(ext.norm(dim=-1).max())


def make_problems(case: str, quick: bool) -> list[Problem]:
    """The problems of ``case`` (fixed seeds; ``quick``: n = 2000, B = 8)."""
    import torch

    if case == "u64_50k":
        n = 2000 if quick else 50_000
        g = _gen(50)
        x, y = torch.rand(n, 64, generator=g), torch.rand(n, 64, generator=g)
        a, b = _uniform((n,)), _uniform((n,))
        return [Problem(case, f"u64_50k/eps={e:g}", x, y, a, b, e) for e in (0.1, 0.01)]
    if case in ("u64", "unbalanced"):
        n = 2000 if quick else 10_000
        g = _gen(64)
        x, y = torch.rand(n, 64, generator=g), torch.rand(n, 64, generator=g)
        a, b = _uniform((n,)), _uniform((n,))
        if case == "unbalanced":
            return [Problem(case, "unbalanced/eps=0.01/rho=1", x, y, a, b, 0.01, 1.0)]
        return [Problem(case, f"u64/eps={e:g}", x, y, a, b, e) for e in (0.1, 0.01, 0.001)]
    if case == "shape3d":
        n = 2000 if quick else 50_000
        g = _gen(3)
        centres = torch.rand(8, 3, generator=g) * 2 - 1
        x = _mixture(g, n, centres, 0.1)
        s = torch.randn(n, 3, generator=g)
        s = s / s.norm(dim=1, keepdim=True)
        y = s * (1.0 + 0.05 * torch.randn(n, 1, generator=g))
        eps = (0.01 * bbox_diameter(x, y)) ** 2
        return [Problem(case, "shape3d", x, y, _uniform((n,)), _uniform((n,)), eps)]
    if case == "mix16":
        n = 2000 if quick else 20_000
        g = _gen(16)
        x = _mixture(g, n, torch.rand(10, 16, generator=g), 0.05)
        y = _mixture(g, n, torch.rand(10, 16, generator=g), 0.05)
        return [Problem(case, "mix16", x, y, _uniform((n,)), _uniform((n,)), 0.01)]
    if case == "batched":
        B, n = (8, 2000) if quick else (64, 1024)
        g = _gen(1024)
        x, y = torch.rand(B, n, 3, generator=g), torch.rand(B, n, 3, generator=g)
        return [Problem(case, "batched", x, y, _uniform((B, n)), _uniform((B, n)), 0.001)]
    raise ValueError(f"unknown case {case!r}")


def to_device(p: Problem, device):
    return tuple(t.to(device) for t in (p.x, p.y, p.a, p.b))
