"""flashsinkhorn.distributed keeps the single-process numerics guarantees (gloo, 2 and 4 ranks).

- large eps: the sharded value, gradients and divergence keep float32's digits (the soft-min
  expanded about the mean score, merged over shards in ring mode), against float64;
- the float32 plan floor: a solve with a tolerance, the marginal error and gradients below it
  raise on every rank, the value with ``tol=None`` does not;
- range checks: coordinates, masses and eps outside float32's range raise on every rank;
- ConvergenceWarning: once per call on every rank, never with ``tol=None``;
- the divergence's self terms are one-potential solves: fixed iterations give the
  single-process values and gradients;
- a bad input on one rank makes every rank raise the same error, naming the argument and
  the rank (4 ranks; a hang fails on gloo's timeout);
- 4 ranks, both modes and schedules, give the single-process potentials.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn import distributed as fsd
from flashsinkhorn import tuning

from .dist_harness import assert_each_below, entries, expect_error, run_job, shard

D = 3
SIZES = {2: ([9, 14], [12, 7]), 4: ([5, 1, 9, 8], [6, 7, 2, 5])}
TOL64 = 1e-9


def _data(seed: int, n: int, m: int, dtype=torch.float64, weighted=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    y = 0.8 * torch.randn(m, D, generator=gen, dtype=torch.float64) + 0.5
    a = b = None
    if weighted:
        a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.2
        b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.2
        a, b = (a / a.sum()).to(dtype), (b / b.sum()).to(dtype)
    return x.to(dtype), y.to(dtype), a, b


def _local(world, rank, *ts):
    sx, sy = SIZES[world]
    return [shard(t, s, rank) for t, s in zip(ts, (sx, sy, sx, sy), strict=True)]


def _rel(u, v) -> float:
    u, v = u.detach().double(), v.detach().double()
    return float((u - v).abs().max() / v.abs().max().clamp_min(1e-300))


# ------------------------------------------------------------------------------- large eps


def _large_eps(rank, world, *, mode, weighted, rho, loss):
    """float32 sharded vs float64 single process at eps = 1e6 · diameter²."""
    sx, sy = SIZES[world]
    x, y, a, b = _data(11, sum(sx), sum(sy), torch.float32, weighted)
    if rho is not None and weighted:
        b = 1.4 * b
    kw = dict(eps=3e6, tol=None, n_iters=5, rho_x=rho, rho_y=rho)
    d64 = [None if t is None else t.double() for t in (x, y, a, b)]
    leaves64 = [None if t is None else t.clone().requires_grad_(True) for t in d64]
    local = [
        None if t is None else t.clone().requires_grad_(True)
        for t in _local(world, rank, x, y, a, b)
    ]
    fn = fs.ot_cost if loss == "ot_cost" else fs.sinkhorn_divergence
    dfn = fsd.ot_cost if loss == "ot_cost" else fsd.sinkhorn_divergence
    ref = fn(*leaves64, backend="torch", **kw)
    ref.backward()
    val = dfn(*local, mode=mode, **kw)
    val.backward()
    # the scale of the loss: the mean cost for OT, the squared distance of the means for S
    scale = float(ref.detach().abs())
    out = {"value": abs(float(val.detach()) - float(ref.detach())) / scale}
    out["grad_x"] = _rel(local[0].grad, shard(leaves64[0].grad, sx, rank))
    if rho is None and not weighted:
        # The plain online LSE loses u·eps = 0.2 of a cost of size 4: the check can fail.
        # (Given weights put eps ln M in the potentials, M their float sum, which another
        # order of summation changes by u·M: such potentials are not compared.)
        res = fsd.sinkhorn(*_local(world, rank, x, y, a, b), mode=mode, **kw)
        out["potential"] = _rel(res.f, shard(fs.sinkhorn(*d64, **kw).f, sx, rank))
    return out


# ------------------------------------------------------------------------- range and floor


def _floor_and_range(rank, world):
    x, y, a, b = _local(world, rank, *_data(12, *map(sum, SIZES[world]), torch.float32))
    out = {}
    tiny = dict(eps=1e-8, n_iters=5)
    out["floor_tol"] = expect_error(lambda: fsd.sinkhorn(x, y, a, b, tol=1e-3, **tiny))
    out["floor_error"] = expect_error(lambda: fsd.sinkhorn(x, y, a, b, tol=None, **tiny))
    res = fsd.sinkhorn(x, y, a, b, tol=None, compute_error=False, mode="ring", **tiny)
    out["floor_value_finite"] = bool(torch.isfinite(res.value))
    xl = x.clone().requires_grad_(True)
    loss = fsd.ot_cost(xl, y, a, b, tol=None, **tiny)
    out["floor_grad"] = expect_error(loss.backward)
    x64 = x.double().requires_grad_(True)
    fsd.ot_cost(x64, y.double(), a.double(), b.double(), tol=None, **tiny).backward()
    out["floor_float64_grad_finite"] = bool(torch.isfinite(x64.grad).all())
    out["range_coords"] = expect_error(lambda: fsd.sinkhorn(x * 1e20, y, a, b, eps=0.1))
    out["range_mass"] = expect_error(lambda: fsd.sinkhorn(x, y, a * 1e19, b, eps=0.1, rho_x=1.0))
    out["range_eps"] = expect_error(lambda: fsd.sinkhorn(x, y, a, b, eps=1e38, mode="ring"))
    out["range_div"] = expect_error(lambda: fsd.sinkhorn_divergence(x * 1e20, y, a, b, eps=0.1))
    return out


# -------------------------------------------------------------------------------- warnings


def _warnings(rank, world):
    x, y, a, b = _local(world, rank, *_data(13, *map(sum, SIZES[world])))
    out = {}
    calls = {
        "ot_cost_unconverged": lambda: fsd.ot_cost(x, y, a, b, eps=0.05, tol=1e-12, n_iters=3),
        "divergence_unconverged": lambda: fsd.sinkhorn_divergence(
            x, y, a, b, eps=0.05, tol=1e-12, n_iters=3, mode="ring"
        ),
        "fixed_iterations": lambda: fsd.ot_cost(x, y, a, b, eps=0.05, tol=None, n_iters=3),
        "converged": lambda: fsd.sinkhorn_divergence(x, y, a, b, eps=0.5, tol=1e-4),
        "sinkhorn_result": lambda: fsd.sinkhorn(x, y, a, b, eps=0.05, tol=1e-12, n_iters=3),
    }
    for name, call in calls.items():
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            call()
        conv = [w for w in got if issubclass(w.category, fs.ConvergenceWarning)]
        out[name] = len(conv)
        out[name + "_message"] = str(conv[0].message) if conv else ""
    out["sinkhorn_converged_flag"] = int(
        fsd.sinkhorn(x, y, a, b, eps=0.05, tol=1e-12, n_iters=3).converged
    )
    return out


# ------------------------------------------------------------------------------ divergence


def _divergence(rank, world, *, mode, rho, weighted):
    """Fixed iterations: the one-potential self terms give the single-process values."""
    sx, sy = SIZES[world]
    x, y, a, b = _data(14, sum(sx), sum(sy), weighted=weighted)
    if rho is not None and weighted:
        b = 1.3 * b
    kw = dict(eps=0.3, tol=None, n_iters=6, rho_x=rho, rho_y=rho, scaling=0.6)
    leaves = [None if t is None else t.clone().requires_grad_(True) for t in (x, y, a, b)]
    local = [
        None if t is None else t.clone().requires_grad_(True)
        for t in _local(world, rank, x, y, a, b)
    ]
    ref = fs.sinkhorn_divergence(*leaves, backend="torch", **kw)
    ref.backward()
    val = fsd.sinkhorn_divergence(*local, mode=mode, **kw)
    val.backward()
    out = {"value": abs(float(val.detach()) - float(ref.detach()))}
    for name, lt, gt, s in zip("xyab", local, leaves, (sx, sy, sx, sy), strict=True):
        if lt is not None:
            out["grad_" + name] = float((lt.grad - shard(gt.grad, s, rank)).abs().max())
    return out


# -------------------------------------------------------------------------------- failures


def _failures(rank, world):
    """Each call has a bad argument on one rank only."""
    x, y, a, b = _local(world, rank, *_data(15, *map(sum, SIZES[world])))
    nan_x = x.clone()
    nan_x[0, 1] = float("nan")
    nan_y = y.clone()
    nan_y[-1, 0] = float("inf")
    nan_a = a.clone()
    nan_a[0] = float("nan")

    def on(r, bad, good):
        return bad if rank == r else good

    calls = {
        "nan_x_gather": lambda: fsd.sinkhorn(on(2, nan_x, x), y, a, b, eps=0.3),
        "nan_y_divergence_ring": lambda: fsd.sinkhorn_divergence(
            x, on(1, nan_y, y), a, b, eps=0.3, mode="ring"
        ),
        "nan_y_divergence_scaling": lambda: fsd.sinkhorn_divergence(
            x, on(3, nan_y, y), a, b, eps=0.3, scaling=0.5
        ),
        "batched_x_ot_cost": lambda: fsd.ot_cost(on(1, x[None], x), y, a, b, eps=0.3),
        "negative_b_ring": lambda: fsd.sinkhorn(x, y, a, on(3, -b, b), eps=0.3, mode="ring"),
        "nan_a_divergence": lambda: fsd.sinkhorn_divergence(x, y, on(0, nan_a, a), b, eps=0.3),
        "a_wrong_length": lambda: fsd.sinkhorn(x, y, on(2, torch.cat([a, a[:1]]), a), b, eps=0.3),
        "semi_relaxed_divergence_one_rank": lambda: fsd.sinkhorn_divergence(
            x, y, a, b, eps=0.3, rho_x=on(3, 1.0, None)
        ),
        "eps_type_one_rank": lambda: fsd.ot_cost(x, y, a, b, eps=on(1, "big", 0.3)),
        "compute_error_type_one_rank": lambda: fsd.sinkhorn(
            x, y, a, b, eps=0.3, compute_error=on(2, "yes", True)
        ),
        # valid on each rank, different across ranks: the comparison of the options
        "compute_error_differs": lambda: fsd.sinkhorn(
            x, y, a, b, eps=0.3, tol=None, n_iters=2, compute_error=on(1, False, True)
        ),
    }
    out = {name: expect_error(call) for name, call in calls.items()}
    # A failure other than an argument error in one rank's checks (here a RuntimeError
    # raised in place of its shard checks) and a backend that resolves differently on one
    # rank (here its precision): every rank must raise, none may wait in a collective.
    from flashsinkhorn.distributed import _checks, _engine

    def broken(*args, **kw):
        raise RuntimeError("the shard checks broke")

    for name, module, attr, stand_in in (
        ("runtime_error_one_rank", _checks, "check_local", broken),
        ("resolved_precision_differs", _engine, "resolve_precision", lambda *a: "tf32x3"),
    ):
        real = getattr(module, attr)
        setattr(module, attr, on(2, stand_in, real))
        try:
            out[name] = expect_error(lambda: fsd.sinkhorn(x, y, a, b, eps=0.3))
        finally:
            setattr(module, attr, real)
    x1, y1, a1, b1 = _data(15, *map(sum, SIZES[world]))
    res = fsd.sinkhorn(x, y, a, b, eps=0.3, tol=None, n_iters=4, mode="ring")
    ref = fs.sinkhorn(x1, y1, a1, b1, eps=0.3, tol=None, n_iters=4)
    out["after_errors"] = f"{abs(float(res.value) - float(ref.value)):.3e}"
    return out


# --------------------------------------------------------------------------- four ranks


def _solve(rank, world, *, mode, schedule, rho):
    sx, sy = SIZES[world]
    x, y, a, b = _data(16, sum(sx), sum(sy))
    kw = dict(eps=0.2, tol=None, n_iters=12, schedule=schedule, rho_x=rho, rho_y=rho)
    ref = fs.sinkhorn(x, y, a, b, backend="torch", **kw)
    res = fsd.sinkhorn(*_local(world, rank, x, y, a, b), mode=mode, **kw)
    return {
        "f": float((res.f - shard(ref.f, sx, rank)).abs().max()),
        "g": float((res.g - shard(ref.g, sy, rank)).abs().max()),
        "value": abs(float(res.value) - float(ref.value)),
    }


def _triton(rank, world, *, mode, precision, eps):
    """The Triton kernels (the interpreter on the CPU) on the shards' wire formats: float16
    grid copies, hi/lo parts, the paired launch, against the single-process Triton solve."""
    # 16 points on a 1/8 grid, uniform weights: every sum of the joint mean is exact in any
    # order, so the shards and the single process round the same centred points to the
    # float16 grid, and the results differ by the order of float32 sums only.
    sx, sy = [5, 11], [9, 7]
    gen = torch.Generator().manual_seed(17)
    x = (8 * torch.randn(16, D, generator=gen)).round() / 8
    y = (6 * torch.randn(16, D, generator=gen)).round() / 8 + 0.5
    kw = dict(eps=eps, tol=None, n_iters=3, backend="triton", precision=precision)
    leaves = [t.clone().requires_grad_(True) for t in (x, y)]
    local = [shard(t, s, rank).clone().requires_grad_(True) for t, s in ((x, sx), (y, sy))]
    # The two-sweep step on both sides (TUNING.plan_step off: the shards' paired launch), so
    # that the potentials agree to the last bits and the "tf32" transport rounds the same
    # plan tiles to float16; the plan sums' kernels are checked in
    # tests/test_distributed_accelerated.py.
    with tuning.override(plan_step=False):
        ref = fs.sinkhorn(x, y, **kw)
        fs.ot_cost(*leaves, **kw).backward()
        res = fsd.sinkhorn(shard(x, sx, rank), shard(y, sy, rank), mode=mode, **kw)
        fsd.ot_cost(*local, mode=mode, **kw).backward()
    return {
        "f": _rel(res.f, shard(ref.f, sx, rank)),
        "g": _rel(res.g, shard(ref.g, sy, rank)),
        "value": _rel(res.value, ref.value),
        "grad_x": _rel(local[0].grad, shard(leaves[0].grad, sx, rank)),
        "grad_y": _rel(local[1].grad, shard(leaves[1].grad, sy, rank)),
    }


def _partial_grads(rank, world, *, mode, loss):
    """Different gradients on different ranks (x on rank 0, y elsewhere, a on the last rank):
    the backward sweeps are collectives, so the ranks agree on the gradients some rank needs
    and all run the same sweeps."""
    sx, sy = SIZES[world]
    x, y, a, b = _data(18, sum(sx), sum(sy))
    kw = dict(eps=0.3, tol=None, n_iters=5, rho_x=1.0, rho_y=1.0)
    ref = [t.clone().requires_grad_(True) for t in (x, y, a)]
    fn = fs.ot_cost if loss == "ot_cost" else fs.sinkhorn_divergence
    fn(*ref, b, backend="torch", **kw).backward()
    xl, yl, al, bl = _local(world, rank, x, y, a, b)
    xl = xl.clone().requires_grad_(rank == 0)
    yl = yl.clone().requires_grad_(rank != 0)
    al = al.clone().requires_grad_(rank == world - 1)
    dfn = fsd.ot_cost if loss == "ot_cost" else fsd.sinkhorn_divergence
    dfn(xl, yl, al, bl, mode=mode, **kw).backward()
    out = {}
    for name, t, full, sizes in (
        ("x", xl, ref[0], sx),
        ("y", yl, ref[1], sy),
        ("a", al, ref[2], sx),
    ):
        if t.requires_grad:
            out["grad_" + name] = float((t.grad - shard(full.grad, sizes, rank)).abs().max())
    return out


def _checks(world):
    checks = {}
    for mode in ("gather", "ring"):
        for loss in ("ot_cost", "divergence"):
            checks[f"partial_{mode}_{loss}"] = dict(fn=_partial_grads, mode=mode, loss=loss)
    if world == 2:
        for mode in ("gather", "ring"):
            for precision in ("ieee", "tf32", "tf32x3"):
                checks[f"triton_{mode}_{precision}"] = dict(
                    fn=_triton, mode=mode, precision=precision, eps=0.4
                )
            checks[f"triton_{mode}_large"] = dict(fn=_triton, mode=mode, precision="tf32", eps=3e6)
    for mode in ("gather", "ring"):
        for weighted in (False, True):
            for rho in (None, 4e6):
                for loss in ("ot_cost", "divergence"):
                    checks[f"large_{mode}_{weighted}_{rho}_{loss}"] = dict(
                        fn=_large_eps, mode=mode, weighted=weighted, rho=rho, loss=loss
                    )
        for rho, weighted in ((None, True), (None, False), (2.0, True)):
            checks[f"divergence_{mode}_{rho}_{weighted}"] = dict(
                fn=_divergence, mode=mode, rho=rho, weighted=weighted
            )
        for schedule in ("symmetric", "alternating"):
            for rho in (None, 1.5):
                checks[f"solve_{mode}_{schedule}_{rho}"] = dict(
                    fn=_solve, mode=mode, schedule=schedule, rho=rho
                )
    checks["floor_and_range"] = dict(fn=_floor_and_range)
    checks["warnings"] = dict(fn=_warnings)
    if world == 4:
        checks["failures"] = dict(fn=_failures)
    return checks


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def job(request):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The ranks hold CPU tensors (gloo): their Triton checks run under the interpreter, on a
    # machine with a GPU too (two GPUs and NCCL: tests/test_gpu_distributed.py). The spawned
    # ranks read the variable when they start, before they import Triton's kernels.
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return request.param, run_job(request.param, _checks)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _names(prefix):
    return [k for k in _checks(2) if k.startswith(prefix)]


@pytest.mark.parametrize("name", _names("large_"))
def test_large_eps_keeps_float32_digits(job, name):
    for r in entries(job, name):
        assert r["value"] < 2e-6, r
        assert r["grad_x"] < 1e-4, r
        if "potential" in r:
            assert r["potential"] < 1e-6, r


@pytest.mark.parametrize("name", _names("triton_"))
def test_triton_kernels_on_shards_match_single_process(job, name):
    world, _ = job
    if world != 2:
        pytest.skip("the Triton checks run on 2 ranks (interpreter)")
    # The "tf32" transport gradient multiplies float16 roundings of the plan's tiles by the
    # grid points (backends/triton/transport.py): 2^-11 = 4.9e-4 per tile, 1.1e-4 from
    # float64 on these points. The ring sums it over other tiles (one column shard at a
    # time) than the single process, so its gradients agree to that rounding only;
    # everything else agrees to the order of float32 sums.
    grad_tol = 2.0**-11 if name in ("triton_ring_tf32", "triton_ring_large") else 2e-6
    for r in entries(job, name):
        assert r["f"] < 2e-6 and r["g"] < 2e-6 and r["value"] < 2e-6, r
        assert r["grad_x"] < grad_tol and r["grad_y"] < grad_tol, r


@pytest.mark.parametrize("name", _names("partial_"))
def test_backward_with_different_gradients_on_different_ranks(job, name):
    for r in entries(job, name):
        assert r and all(v < TOL64 for v in r.values()), r


@pytest.mark.parametrize("name", _names("divergence_"))
def test_divergence_self_terms_match_single_process(job, name):
    assert_each_below(job, name, TOL64)


@pytest.mark.parametrize("name", _names("solve_"))
def test_solves_match_single_process(job, name):
    for r in entries(job, name):
        assert r["f"] < TOL64 and r["g"] < TOL64 and r["value"] < TOL64, r


def test_plan_floor_and_range_raise_on_every_rank(job):
    for r in entries(job, "floor_and_range"):
        assert r["floor_tol"].startswith(
            "ValueError: eps=1e-08 is too small for the convergence test (tol=0.001) in float32"
        ), r
        assert "pass a larger eps or pass float64 points" in r["floor_tol"], r
        assert "too small for the marginal error (compute_error=True" in r["floor_error"], r
        assert r["floor_value_finite"], r
        assert r["floor_grad"].startswith("ValueError: eps=1e-08 is too small for gradients"), r
        assert r["floor_float64_grad_finite"], r
        assert r["range_coords"].startswith("ValueError: x and y are too large for float32"), r
        assert r["range_mass"].startswith("ValueError: a and b are too large for float32"), r
        assert r["range_eps"].startswith("ValueError: eps=1e+38 is too large for float32"), r
        assert r["range_div"].startswith("ValueError: x and y are too large for float32"), r


def test_convergence_warning_once_per_call_on_every_rank(job):
    for r in entries(job, "warnings"):
        assert r["ot_cost_unconverged"] == 1, r
        assert (
            "ot_cost: the Sinkhorn solve stopped at n_iters=3" in r["ot_cost_unconverged_message"]
        )
        assert r["divergence_unconverged"] == 1, r
        assert "3 of its 3 Sinkhorn solves" in r["divergence_unconverged_message"], r
        assert r["fixed_iterations"] == 0 and r["converged"] == 0, r
        # like flashsinkhorn.sinkhorn: the result says it, no warning
        assert r["sinkhorn_result"] == 0 and r["sinkhorn_converged_flag"] == 0, r


FAILING_RANK = {
    "nan_x_gather": (2, "ValueError: x_local must not contain NaN or inf"),
    "nan_y_divergence_ring": (1, "ValueError: y_local must not contain NaN or inf"),
    "nan_y_divergence_scaling": (3, "ValueError: y_local must not contain NaN or inf"),
    "batched_x_ot_cost": (1, "ValueError: x_local must be 2-D (n_local, d)"),
    "negative_b_ring": (3, "ValueError: b_local must be non-negative"),
    "nan_a_divergence": (0, "ValueError: a_local must be finite"),
    "a_wrong_length": (2, "ValueError: a_local must have shape"),
    "semi_relaxed_divergence_one_rank": (3, "ValueError: a Sinkhorn divergence needs rho_x =="),
    "eps_type_one_rank": (1, "TypeError: eps"),
    "compute_error_type_one_rank": (2, "TypeError: compute_error must be a bool"),
    "runtime_error_one_rank": (2, "RuntimeError: RuntimeError: the shard checks broke"),
}


def test_options_that_differ_across_ranks_raise_on_every_rank(job):
    world, _ = job
    if world != 4:
        pytest.skip("the failure checks run on 4 ranks")
    rows = entries(job, "failures")
    messages = {r["compute_error_differs"] for r in rows}
    assert messages == {"ValueError: compute_error must be the same on every rank"}, messages
    messages = {r["resolved_precision_differs"] for r in rows}
    want = "ValueError: the precision (as resolved on each rank) must be the same on every rank"
    assert messages == {want}, messages


@pytest.mark.parametrize("name", sorted(FAILING_RANK))
def test_bad_input_on_one_rank_raises_on_every_rank(job, name):
    world, _ = job
    if world != 4:
        pytest.skip("the failure checks run on 4 ranks")
    rank, start = FAILING_RANK[name]
    rows = entries(job, "failures")
    messages = {r[name] for r in rows}
    assert len(messages) == 1, messages  # the same error on every rank
    msg = messages.pop()
    assert msg.startswith(start), msg
    assert f"(on rank {rank} of the 4 ranks of the process group" in msg, msg
    assert "every rank raises this error" in msg, msg
    for r in rows:
        assert float(r["after_errors"]) < TOL64, r
