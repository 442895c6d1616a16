"""The accelerated solve of one process, sharded over 4 gloo ranks: same numbers, same counts.

Every check runs a sharded solve and the single-process solve of the concatenated clouds with
the same options, and compares potentials, values, marginal errors, the errors of every
convergence test and the iteration counts (float64, torch backend: 1e-9), or gradients.
Covered: Anderson mixing (its inner products and marginal error reduced over the ranks, one
all-reduce per iteration) on both schedules, over-relaxation, annealing, the "auto" default,
balanced and unbalanced marginals, both modes; the symmetric step from plan sums (row sums
local, column sums all-reduced or carried around the ring) and its recompute when a sum
leaves the trusted range; the Triton kernels of that step under the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import distributed as fsd
from flashsinkhorn.backends.base import Backend
from flashsinkhorn.backends.torch_ref import TorchBackend

from .dist_harness import assert_each_below, entries, run_job, shard

WORLD = 4
SX, SY = [5, 1, 9, 8], [6, 7, 2, 5]
D = 3
TOL = 1e-9


def _data(seed: int, spread: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(SX), D, generator=gen, dtype=torch.float64) * spread
    y = 0.8 * torch.randn(sum(SY), D, generator=gen, dtype=torch.float64) * spread + 0.5
    a = torch.rand(sum(SX), generator=gen, dtype=torch.float64) + 0.2
    b = torch.rand(sum(SY), generator=gen, dtype=torch.float64) + 0.2
    return x, y, a / a.sum(), b / b.sum()


def _err(u, v) -> float:
    return float((u.detach() - v.detach()).abs().max())


class _Count:
    """Counts calls of some backend methods in this process (restored on exit)."""

    def __init__(self, *names, cls=TorchBackend):
        self.names, self.cls, self.calls, self.saved = names, cls, dict.fromkeys(names, 0), {}

    def __enter__(self):
        for name in self.names:
            orig = self.saved[name] = getattr(self.cls, name)

            def counted(*args, _orig=orig, _name=name, **kw):
                self.calls[_name] += 1
                return _orig(*args, **kw)

            setattr(self.cls, name, counted)
        return self.calls

    def __exit__(self, *exc):
        for name, orig in self.saved.items():
            setattr(self.cls, name, orig)


def _solve(rank, world, *, seed, mode, weighted=True, spread=1.0, **kw):
    x, y, a, b = _data(seed, spread)
    if not weighted:
        a = b = None
    if kw.get("rho_y") is not None and b is not None:
        b = 1.6 * b
    ref = fs.sinkhorn(x, y, a, b, backend="torch", **kw)
    local = [shard(x, SX, rank), shard(y, SY, rank), shard(a, SX, rank), shard(b, SY, rank)]
    with (
        _Count("plan_sums", "softmin_pair", "softmin") as torch_calls,
        _Count("sums_step", cls=Backend) as base_calls,
    ):
        res = fsd.sinkhorn(*local, mode=mode, backend="torch", **kw)
    errs = [abs(u - v) for (_, u), (_, v) in zip(res.errors, ref.errors, strict=False)]
    return {
        "f": _err(res.f, shard(ref.f, SX, rank)),
        "g": _err(res.g, shard(ref.g, SY, rank)),
        "value": abs(float(res.value) - float(ref.value)),
        "marginal_error": abs(float(res.marginal_error) - float(ref.marginal_error)),
        "n_iters": (res.n_iters, ref.n_iters),
        "converged": (res.converged, ref.converged),
        "errors": max(errs, default=0.0),
        "n_errors": (len(res.errors), len(ref.errors)),
        "schedule": (res.schedule, ref.route.schedule),
        "plan_sums": torch_calls["plan_sums"],
        "sums_step": base_calls["sums_step"],
        "pair": torch_calls["softmin_pair"],
        "softmin": torch_calls["softmin"],
    }


def _grad(rank, world, *, seed, mode, loss, **kw):
    x, y, a, b = _data(seed)
    leaves = [t.clone().requires_grad_(True) for t in (x, y, a, b)]
    local = [
        shard(t, s, rank).clone().requires_grad_(True)
        for t, s in zip((x, y, a, b), (SX, SY, SX, SY), strict=True)
    ]
    ref = getattr(fs, loss)(*leaves, backend="torch", **kw)
    ref.backward()
    val = getattr(fsd, loss)(*local, mode=mode, backend="torch", **kw)
    val.backward()
    out = {"value": abs(float(val.detach()) - float(ref.detach()))}
    for name, lt, gt, s in zip("xyab", local, leaves, (SX, SY, SX, SY), strict=True):
        out["grad_" + name] = _err(lt.grad, shard(gt.grad, s, rank))
    return out


def _triton(rank, world, *, mode, schedule, **kw):
    """float32 under the Triton interpreter: the plan-sum kernels (block sweep, finishing from
    summed sums, the guarded recompute) against the single-process Triton solve."""
    # points on a 1/8 grid, uniform weights: every sum of the joint mean is exact in any
    # order, so the shards and the single process round the same points to the float16 grid
    gen = torch.Generator().manual_seed(21)
    x = (8 * torch.randn(sum(SX), 5, generator=gen)).round() / 8
    y = (6 * torch.randn(sum(SY), 5, generator=gen)).round() / 8 + 0.5
    opts = dict(eps=0.6, backend="triton", schedule=schedule, **kw)
    ref = fs.sinkhorn(x, y, **opts)
    from flashsinkhorn.backends.triton import TritonBackend, plan

    # plan.sweep: the plan kernels of the block sums and of the backend's own half-step
    with _Count("sums_step", cls=TritonBackend) as calls, _Count("sweep", cls=plan) as kernels:
        res = fsd.sinkhorn(shard(x, SX, rank), shard(y, SY, rank), mode=mode, **opts)
    scale = float(ref.f.abs().max())
    return {
        "f": _err(res.f, shard(ref.f, SX, rank)) / scale,
        "g": _err(res.g, shard(ref.g, SY, rank)) / scale,
        "value": abs(float(res.value) - float(ref.value)) / abs(float(ref.value)),
        "n_iters": (res.n_iters, ref.n_iters),
        "sweeps": kernels["sweep"],
        "sums_step": calls["sums_step"],
    }


def _centre(rank, world, *, prepare_path):
    """float32 points off any grid, random weights, d = 16: masses and weighted sums are formed
    in float64 on every path (Triton or torch prepare, the ranks' all-reduce), so the shards'
    float32 centre is the single process's bit for bit, and so is the float16 operand grid of
    precision "tf32" (in float32 sums, one ulp of the centre moved a few coordinates of a
    40k-point cloud to the next grid step)."""
    from flashsinkhorn.distributed._engine import Sharded
    from flashsinkhorn.tuning import override

    gen = torch.Generator().manual_seed(29)
    x = torch.randn(sum(SX), 16, generator=gen) * 3.0 + 1.7
    y = torch.randn(sum(SY), 16, generator=gen) * 2.0 - 0.4
    a = torch.rand(sum(SX), generator=gen) + 0.1
    b = torch.rand(sum(SY), generator=gen) + 0.1
    a, b = a / a.sum(), b / b.sum()
    opts = dict(eps=0.6, backend="triton", precision="tf32", tol=None, n_iters=1)
    with override(prepare_path=prepare_path):
        ref = fs.sinkhorn(x, y, a, b, **opts)
    local = [shard(t, s, rank) for t, s in ((x, SX), (y, SY), (a, SX), (b, SY))]
    sh = Sharded(*local, group=None, mode="gather", **opts)
    p = ref.solution.problem
    return {
        "centre": torch.equal(sh.centre.reshape(-1), p.centre.reshape(-1)),
        "grid_x": torch.equal(sh.problem.X.xk[0], shard(p.X.xk[0], SX, rank)),
        "grid_y": torch.equal(sh.problem.Y.xk[0], shard(p.Y.xk[0], SY, rank)),
    }


def _checks(world):
    checks = {}
    for path in ("triton", "torch"):
        checks[f"centre_{path}"] = dict(fn=_centre, prepare_path=path)
    for mode in ("gather", "ring"):
        # the fused symmetric step from plan sums, fixed iterations
        checks[f"fixed_{mode}"] = dict(
            fn=_solve, seed=1, mode=mode, eps=0.3, tol=None, n_iters=15, schedule="symmetric"
        )
        for schedule in ("alternating", "symmetric"):
            checks[f"anderson_{mode}_{schedule}"] = dict(
                fn=_solve, seed=2, mode=mode, eps=0.1 if schedule == "alternating" else 0.3,
                tol=1e-8, check_every=3, n_iters=300, schedule=schedule,
                acceleration="anderson",
            )  # fmt: skip
        checks[f"anderson_anneal_{mode}"] = dict(
            fn=_solve, seed=3, mode=mode, eps=0.05, tol=1e-6, n_iters=400, scaling=0.5,
            acceleration="anderson", weighted=False,
        )  # fmt: skip
        checks[f"anderson_unbalanced_{mode}"] = dict(
            fn=_solve, seed=4, mode=mode, eps=0.2, tol=1e-8, check_every=4, n_iters=300,
            rho_x=1.0, rho_y=2.0, acceleration="anderson",
        )  # fmt: skip
        checks[f"default_{mode}"] = dict(fn=_solve, seed=5, mode=mode, eps=0.05, tol=1e-6)
        checks[f"overrelax_{mode}"] = dict(
            fn=_solve, seed=6, mode=mode, eps=0.3, tol=1e-5, n_iters=400,
            acceleration="overrelax", schedule="symmetric",
        )  # fmt: skip
        # far clouds at small eps: from zero potentials the plan's sums underflow, and the
        # soft-min redoes those steps
        checks[f"recompute_{mode}"] = dict(
            fn=_solve, seed=7, mode=mode, spread=4.0, eps=0.05, tol=None, n_iters=8,
            schedule="symmetric",
        )  # fmt: skip
        checks[f"grad_{mode}"] = dict(
            fn=_grad, seed=8, mode=mode, loss="ot_cost", eps=0.2, tol=1e-9,
            acceleration="anderson",
        )  # fmt: skip
        checks[f"grad_divergence_{mode}"] = dict(
            fn=_grad, seed=9, mode=mode, loss="sinkhorn_divergence", eps=0.2, tol=1e-10,
            acceleration="anderson",
        )  # fmt: skip
        checks[f"triton_{mode}_fixed"] = dict(
            fn=_triton, mode=mode, schedule="symmetric", tol=None, n_iters=4
        )
    # (gather mode's half-steps are the backend's own, tested with one process)
    checks["triton_ring_anderson"] = dict(
        fn=_triton, mode="ring", schedule="alternating", tol=1e-4, check_every=2, n_iters=30,
        acceleration="anderson",
    )  # fmt: skip
    return checks


@pytest.fixture(scope="module")
def job():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the ranks read the variable when they start, before they import Triton's kernels
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return WORLD, run_job(WORLD, _checks)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _names(prefix):
    return [k for k in _checks(WORLD) if k.startswith(prefix)]


SOLVES = _names("fixed_") + _names("anderson_") + _names("default_") + _names("overrelax_")


@pytest.mark.parametrize("name", SOLVES + _names("recompute_"))
def test_sharded_solve_matches_one_process(job, name):
    for r in entries(job, name):
        assert r["f"] < TOL and r["g"] < TOL, r
        assert r["value"] < TOL and r["marginal_error"] < TOL and r["errors"] < TOL, r
        (n, n_ref), (c, c_ref) = r["n_iters"], r["converged"]
        assert n == n_ref and c == c_ref and r["schedule"][0] == r["schedule"][1], r
        assert r["n_errors"][0] == r["n_errors"][1], r
        if not name.startswith(("fixed", "recompute")):
            assert c_ref, r  # the cases with a tolerance do converge


# gather mode's half-steps (the alternating schedule) are the backend's own: the torch
# backend's soft-min
PLAN_SUMS = ["fixed_gather", "anderson_gather_symmetric"]
PLAN_SUMS += [k for k in _names("fixed_") + _names("anderson_") if "ring" in k]


@pytest.mark.parametrize("name", PLAN_SUMS)
def test_symmetric_and_ring_half_steps_read_plan_sums(job, name):
    for r in entries(job, name):
        assert r["plan_sums"] > 0 and r["sums_step"] > 0, r
        if name == "fixed_gather":
            # a symmetric step is one plan sweep: the one pair sweep is the marginal error
            # of the returned plan
            assert r["plan_sums"] == 15 and r["pair"] == 1, r


@pytest.mark.parametrize("name", _names("recompute_"))
def test_out_of_range_sums_are_recomputed(job, name):
    for r in entries(job, name):
        assert r["plan_sums"] > 0, r
        # gather: the soft-min of the flagged side on its rank; ring: a pair sweep of the step
        assert r["softmin"] + r["pair"] > 2, r


@pytest.mark.parametrize("name", _names("grad_"))
def test_gradients_match_one_process(job, name):
    assert_each_below(job, name, TOL)


@pytest.mark.parametrize("name", _names("triton_"))
def test_triton_plan_sums_match_one_process(job, name):
    for r in entries(job, name):
        # float32 sums in another order (columns summed over ranks)
        assert r["f"] < 2e-6 and r["g"] < 2e-6 and r["value"] < 2e-6, r
        assert r["n_iters"][0] == r["n_iters"][1], r
        assert r["sweeps"] > 0 and r["sums_step"] > 0, r


@pytest.mark.parametrize("name", _names("centre_"))
def test_sharded_centre_and_grid_are_one_process(job, name):
    for r in entries(job, name):
        assert r == {"centre": True, "grid_x": True, "grid_y": True}, r
