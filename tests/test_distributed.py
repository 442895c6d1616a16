"""flashsinkhorn.distributed against the single-process solver, on 2 and 3 gloo CPU processes.

Process start-up dominates (torch import, gloo rendezvous), so one spawned job per world
size runs every check and sends back a table of results; the tests below read that table.
Shards are uneven (one rank holds a single point of x). Everything is float64 on the torch
backend, so the sharded solve must give the single-process potentials, value and gradients
to 1e-9: only the order of a few floating-point sums differs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import flashsinkhorn as fs
from flashsinkhorn import distributed as fsd

from .dist_harness import entries, expect_error, run_job, shard

TOL = 1e-9
SIZES = {2: ([1, 22], [15, 10]), 3: ([9, 1, 13], [8, 12, 6])}
D = 3


def _data(seed: int, n: int, m: int, weighted: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    y = 0.8 * torch.randn(m, D, generator=gen, dtype=torch.float64) + 0.5
    if not weighted:
        return x, y, None, None
    a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.2
    b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.2
    return x, y, a / a.sum(), b / b.sum()


def _max_err(u: torch.Tensor, v: torch.Tensor) -> float:
    return float((u.detach() - v.detach()).abs().max())


# ----------------------------------------------------------------------------------- checks
# Each check runs on every rank and returns a dict of numbers (errors, counts) or strings.


def _solve_check(rank, world, *, seed, weighted=True, unbalanced_scale=1.0, **kw):
    sx, sy = SIZES[world]
    x, y, a, b = _data(seed, sum(sx), sum(sy), weighted)
    if unbalanced_scale != 1.0:
        b = b * unbalanced_scale
    mode = kw.pop("mode")
    ref = fs.sinkhorn(x, y, a, b, backend="torch", **kw)
    xl, yl = shard(x, sx, rank), shard(y, sy, rank)
    res = fsd.sinkhorn(xl, yl, shard(a, sx, rank), shard(b, sy, rank), mode=mode, **kw)
    out = {
        "f": _max_err(res.f, shard(ref.f, sx, rank)),
        "g": _max_err(res.g, shard(ref.g, sy, rank)),
        "value": abs(float(res.value) - float(ref.value)),
        "marginal_error": abs(float(res.marginal_error) - float(ref.marginal_error)),
        "n_iters": res.n_iters - ref.n_iters,
        "converged": int(res.converged) - int(ref.converged),
        "ref_converged": int(ref.converged),
        "errors": max(
            (abs(u - v) for (_, u), (_, v) in zip(res.errors, ref.errors, strict=False)),
            default=0,
        ),
        "n_errors": len(res.errors) - len(ref.errors),
        "offset": res.offset_x - sum(sx[:rank]),
        "n": res.n - sum(sx),
    }
    return out


def _grad_check(rank, world, *, seed, loss="ot_cost", unbalanced=False, **kw):
    sx, sy = SIZES[world]
    x, y, a, b = _data(seed, sum(sx), sum(sy))
    if unbalanced:
        b = 1.5 * b
        # A divergence needs the same relaxation on both sides.
        kw.update(rho_x=1.0, rho_y=2.0 if loss == "ot_cost" else 1.0)
    leaves = [t.clone().requires_grad_(True) for t in (x, y, a, b)]
    local = [
        shard(t, s, rank).clone().requires_grad_(True)
        for t, s in zip((x, y, a, b), (sx, sy, sx, sy), strict=True)
    ]
    mode = kw.pop("mode")
    ref = getattr(fs, loss)(*leaves, backend="torch", **kw)
    ref.backward()
    val = getattr(fsd, loss)(*local, mode=mode, **kw)
    val.backward()
    out = {"value": abs(float(val.detach()) - float(ref.detach()))}
    for name, lt, gt, s in zip("xyab", local, leaves, (sx, sy, sx, sy), strict=True):
        out["grad_" + name] = _max_err(lt.grad, shard(gt.grad, s, rank))
    return out


def _bad_inputs(rank, world):
    sx, sy = SIZES[world]
    x, y, a, b = _data(5, sum(sx), sum(sy))
    xl, yl, al, bl = (
        shard(x, sx, rank),
        shard(y, sy, rank),
        shard(a, sx, rank),
        shard(b, sy, rank),
    )
    out = {}
    xd = torch.cat([xl, xl[:, :1]], 1) if rank == 1 else xl
    yd = torch.cat([yl, yl[:, :1]], 1) if rank == 1 else yl
    out["mismatched_d"] = expect_error(lambda: fsd.sinkhorn(xd, yd, al, bl, eps=0.5))
    out["mismatched_eps"] = expect_error(lambda: fsd.sinkhorn(xl, yl, al, bl, eps=0.5 + rank))
    xe = xl[:0] if rank == 0 else xl
    out["empty_shard"] = expect_error(lambda: fsd.sinkhorn(xe, yl, None, None, eps=0.5))
    out["bad_mode"] = expect_error(lambda: fsd.sinkhorn(xl, yl, al, bl, eps=0.5, mode="tree"))
    a1 = al if rank == 0 else None
    out["a_on_one_rank"] = expect_error(lambda: fsd.sinkhorn(xl, yl, a1, bl, eps=0.5))
    out["mass_gap"] = expect_error(lambda: fsd.sinkhorn(xl, yl, al, 2 * bl, eps=0.5))
    out["negative_weight"] = expect_error(
        lambda: fsd.sinkhorn(xl, yl, -al if rank == world - 1 else al, bl, eps=0.5)
    )
    out["batched"] = expect_error(lambda: fsd.sinkhorn(xl[None], yl[None], eps=0.5))
    out["float_eps_type"] = expect_error(lambda: fsd.sinkhorn(xl, yl, eps="big"))
    out["semi_unbalanced_divergence"] = expect_error(
        lambda: fsd.sinkhorn_divergence(xl, yl, al, bl, eps=0.5, rho_x=1.0)
    )
    # The group is still in step after all those errors: a plain solve works.
    res = fsd.sinkhorn(xl, yl, al, bl, eps=0.5, tol=None, n_iters=3)
    ref = fs.sinkhorn(x, y, a, b, eps=0.5, tol=None, n_iters=3)
    out["after_errors"] = abs(float(res.value) - float(ref.value))
    return out


def _checks(world):
    """name -> callable(rank, world) returning a dict."""
    checks = {}
    for mode in ("gather", "ring"):
        for schedule in ("symmetric", "alternating"):
            checks[f"solve_{mode}_{schedule}"] = dict(
                fn=_solve_check, seed=1, eps=0.3, tol=None, n_iters=25, mode=mode,
                schedule=schedule,
            )  # fmt: skip
            checks[f"tol_{mode}_{schedule}"] = dict(
                fn=_solve_check, seed=2, eps=0.5, tol=1e-7, check_every=4, n_iters=400,
                mode=mode, schedule=schedule,
            )  # fmt: skip
        checks[f"unbalanced_anneal_{mode}"] = dict(
            fn=_solve_check, seed=3, eps=0.2, tol=1e-5, check_every=5, n_iters=300, mode=mode,
            scaling=0.6, rho_x=1.0, rho_y=2.0, unbalanced_scale=1.7,
        )  # fmt: skip
        checks[f"grad_{mode}"] = dict(
            fn=_grad_check, seed=6, eps=0.4, tol=1e-6, mode=mode, schedule="alternating"
        )
        # Both solve the self terms as one-potential problems of the joint problem's sides.
        checks[f"grad_divergence_{mode}"] = dict(
            fn=_grad_check, seed=7, eps=0.4, tol=1e-11, mode=mode, loss="sinkhorn_divergence",
            scaling=0.7, schedule="symmetric", acceleration="none",
        )  # fmt: skip
    checks["semi_unbalanced_uniform_ring"] = dict(
        fn=_solve_check, seed=4, weighted=False, eps=0.2, tol=None, n_iters=40, mode="ring",
        rho_y=0.5, schedule="alternating", scaling=0.5,
    )  # fmt: skip
    checks["semi_unbalanced_uniform_gather"] = dict(
        fn=_solve_check, seed=4, weighted=False, eps=0.2, tol=None, n_iters=40, mode="gather",
        rho_x=0.5,
    )  # fmt: skip
    checks["grad_unbalanced_ring"] = dict(
        fn=_grad_check, seed=8, eps=0.3, tol=1e-6, mode="ring", unbalanced=True
    )
    checks["grad_divergence_unbalanced_gather"] = dict(
        fn=_grad_check, seed=9, eps=0.3, tol=1e-11, mode="gather", unbalanced=True,
        loss="sinkhorn_divergence",
    )  # fmt: skip
    checks["bad_inputs"] = dict(fn=_bad_inputs)
    return checks


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def job(request):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return request.param, run_job(request.param, _checks)


SOLVES = [
    f"{kind}_{mode}_{schedule}"
    for kind in ("solve", "tol")
    for mode in ("gather", "ring")
    for schedule in ("symmetric", "alternating")
] + [
    "unbalanced_anneal_gather",
    "unbalanced_anneal_ring",
    "semi_unbalanced_uniform_ring",
    "semi_unbalanced_uniform_gather",
]


@pytest.mark.parametrize("name", SOLVES)
def test_solve_matches_single_process(job, name):
    for r in entries(job, name):
        assert r["f"] < TOL and r["g"] < TOL, r
        assert r["value"] < TOL and r["marginal_error"] < TOL, r
        assert r["n_iters"] == 0 and r["converged"] == 0 and r["n_errors"] == 0, r
        assert r["errors"] < TOL, r
        assert r["offset"] == 0 and r["n"] == 0, r
        if name.startswith(("tol", "unbalanced")):
            assert r["ref_converged"] == 1, r  # the tol cases do exercise convergence


GRADS = [
    "grad_gather",
    "grad_ring",
    "grad_divergence_gather",
    "grad_divergence_ring",
    "grad_unbalanced_ring",
    "grad_divergence_unbalanced_gather",
]


@pytest.mark.parametrize("name", GRADS)
def test_gradients_match_single_process(job, name):
    for r in entries(job, name):
        assert r["value"] < TOL, r
        for k in ("grad_x", "grad_y", "grad_a", "grad_b"):
            assert r[k] < TOL, (k, r)


def test_bad_inputs_raise_on_every_rank(job):
    rows = entries(job, "bad_inputs")
    for r in rows:
        assert r["mismatched_d"].startswith("ValueError"), r
        assert "same feature dimension d on every rank" in r["mismatched_d"], r
        assert "eps must be the same on every rank" in r["mismatched_eps"], r
        # every rank raises the failing rank's error, naming that rank
        assert r["empty_shard"].startswith("ValueError: x_local must not be empty"), r
        assert "(on rank 0 of the" in r["empty_shard"], r
        assert r["bad_mode"].startswith("ValueError: mode must be one of"), r
        assert "a_local must be given on every rank or on none" in r["a_on_one_rank"], r
        assert "equal total mass" in r["mass_gap"], r
        assert "a_local must be non-negative" in r["negative_weight"], r
        assert "2-D (n_local, d)" in r["batched"], r
        assert r["float_eps_type"].startswith("TypeError: eps"), r
        assert "needs rho_x == rho_y" in r["semi_unbalanced_divergence"], r
        assert r["after_errors"] < TOL, r


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    x = torch.randn(5, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsd.sinkhorn(x, x, eps=0.1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsd.ot_cost(x, x, eps=0.1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsd.sinkhorn_divergence(x, x, eps=0.1)


def test_import_initialises_nothing():
    import importlib

    importlib.reload(fsd)
    assert not dist.is_initialized()
    assert set(fsd.__all__) >= {"sinkhorn", "ot_cost", "sinkhorn_divergence"}
