"""Safety: caller tensors untouched, global flags restored (also after an exception),
bit-identical results for identical inputs, solves and kernel caches safe across threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends.torch_ref import matmul_precision
from flashsinkhorn.mhc import sinkhorn_knopp

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _inputs(batched=False, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    lead = (2,) if batched else ()
    x = torch.rand(*lead, 9, 3, generator=g)
    y = torch.rand(*lead, 7, 3, generator=g) + 0.5
    a = torch.rand(*lead, 9, generator=g) + 0.1
    b = torch.rand(*lead, 7, generator=g) + 0.1
    a = a / a.sum(-1, keepdim=True)
    b = b / b.sum(-1, keepdim=True)
    return [t.requires_grad_(requires_grad) for t in (x, y, a, b)]


def _calls():
    """Every public entry point, as (name, fn(x, y, a, b) -> tensor or tuple)."""
    opts = dict(eps=0.1, backend="torch")

    def result_methods(x, y, a, b):
        r = fs.sinkhorn(x, y, a, b, **opts)
        return (
            r.value, r.apply(y.detach()), r.apply_T(x.detach()), r.barycentric_map(), r.plan(),
            *r.marginals(), r.marginal_error,
        )  # fmt: skip

    return [
        ("sinkhorn", result_methods),
        ("ot_cost", lambda x, y, a, b: fs.ot_cost(x, y, a, b, **opts)),
        ("ot_cost_unbalanced", lambda x, y, a, b: fs.ot_cost(x, y, a, b, rho_x=1.0, **opts)),
        ("sinkhorn_divergence", lambda x, y, a, b: fs.sinkhorn_divergence(x, y, a, b, **opts)),
        ("SinkhornDivergence", lambda x, y, a, b: fs.SinkhornDivergence(**opts)(x, y, a, b)),
        ("SamplesLoss", lambda x, y, a, b: fs.SamplesLoss(blur=0.3, backend="torch")(a, x, b, y)),
        (
            "SamplesLoss_potentials",
            lambda x, y, a, b: fs.SamplesLoss(blur=0.3, potentials=True, backend="torch")(
                a, x, b, y
            ),
        ),
    ]


def _sum(out) -> torch.Tensor:
    outs = out if isinstance(out, tuple) else (out,)
    return sum(o.sum() for o in outs if o.requires_grad)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("name,fn", _calls(), ids=[c[0] for c in _calls()])
def test_caller_tensors_not_modified(name, fn, batched):
    inputs = _inputs(batched, requires_grad=True)
    before = [t.detach().clone() for t in inputs]
    versions = [t._version for t in inputs]
    out = fn(*inputs)
    total = _sum(out)
    if isinstance(total, torch.Tensor):
        total.backward()
    for t, b0, v0 in zip(inputs, before, versions, strict=True):
        assert t._version == v0  # no in-place op, not even one that restores the values
        assert torch.equal(t.detach(), b0)


def test_mhc_logits_not_modified():
    m = torch.randn(5, 4, 4, requires_grad=True)
    before, v0 = m.detach().clone(), m._version
    sinkhorn_knopp(m, 10, backend="torch").sum().backward()
    assert m._version == v0 and torch.equal(m.detach(), before)


# ----- global state -----


def _flags():
    return (
        torch.is_grad_enabled(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )


@pytest.mark.parametrize("grad_mode", [False, True])
@pytest.mark.parametrize("name,fn", _calls(), ids=[c[0] for c in _calls()])
def test_grad_mode_and_tf32_flags_restored(name, fn, grad_mode):
    with torch.set_grad_enabled(grad_mode):
        before = _flags()
        out = fn(*_inputs(requires_grad=True))
        assert _flags() == before
        outs = out if isinstance(out, tuple) else (out,)
        # No graph is built under no_grad (GeomLoss re-enables grad mode here).
        assert all(not o.requires_grad for o in outs) or grad_mode


@pytest.mark.parametrize("name,fn", _calls(), ids=[c[0] for c in _calls()])
def test_flags_restored_after_exception(name, fn):
    x, y, a, b = _inputs()
    a = a.clone()
    a[0] = -1.0  # rejected inside the solve's preparation, after the entry checks
    for grad_mode in (False, True):
        with torch.set_grad_enabled(grad_mode):
            before = _flags()
            with pytest.raises(ValueError, match="non-negative"):
                fn(x, y, a, b)
            assert _flags() == before


@pytest.mark.parametrize("allow", [False, True])
def test_matmul_precision_restores_tf32_flag_after_exception(allow):
    # The CUDA branch of the context manager only flips Python-visible flags: testable here.
    flags = torch.backends.cuda.matmul
    new_api = hasattr(flags, "fp32_precision")
    saved = flags.allow_tf32
    flags.allow_tf32 = allow
    try:
        with pytest.raises(RuntimeError, match="boom"):
            with matmul_precision("tf32" if not allow else "ieee", torch.device("cuda")):
                if new_api:  # a legacy read would raise in here: the block used the new API
                    assert flags.fp32_precision == ("ieee" if allow else "tf32")
                else:
                    assert flags.allow_tf32 is (not allow)
                raise RuntimeError("boom")
        assert flags.allow_tf32 is allow
    finally:
        flags.allow_tf32 = saved


_TF32_SCRIPT = """
import json
import os
import sys
import traceback

import torch
from flashsinkhorn.backends.torch_ref import matmul_precision

flags = torch.backends.cuda.matmul


def observe():
    try:
        legacy = flags.allow_tf32
    except RuntimeError:
        legacy = "raises"
    return [flags.fp32_precision, legacy]


def run(scenario, use_block):
    if scenario.startswith("legacy_"):
        flags.allow_tf32 = scenario == "legacy_tf32"
    elif scenario.startswith("global_"):
        torch.backends.fp32_precision = scenario[len("global_"):]
    elif scenario.startswith("new_"):
        flags.fp32_precision = scenario[len("new_"):]
    seen = []
    if use_block:
        for prec in ("tf32", "ieee"):
            with matmul_precision(prec, torch.device("cuda")):
                assert flags.fp32_precision == prec, (prec, flags.fp32_precision)
                other = "ieee" if prec == "tf32" else "tf32"
                with matmul_precision(other, torch.device("cuda")):
                    assert flags.fp32_precision == other
                assert flags.fp32_precision == prec
    seen += observe()
    # whether the matmul flag still follows the global setting
    torch.backends.fp32_precision = "ieee" if flags.fp32_precision == "tf32" else "tf32"
    seen += observe()
    return seen


def run_in_child(scenario, use_block):
    # a forked child starts from this process's untouched flags, as a fresh interpreter would
    # (torch's import is the cost of a fresh one: 3 s, against milliseconds for a fork)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out = {"seen": run(scenario, use_block)}
        except BaseException:
            out = {"error": traceback.format_exc()}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(data)


runs = [(scenario, use_block == "1") for scenario, use_block in json.loads(sys.argv[1])]
if len(runs) == 1:
    try:
        out = [{"seen": run(*runs[0])}]
    except BaseException:
        out = [{"error": traceback.format_exc()}]
else:
    out = [run_in_child(*r) for r in runs]
print(json.dumps(out))
"""

TF32_SCENARIOS = [
    "fresh", "legacy_tf32", "legacy_ieee", "global_tf32", "global_ieee", "new_tf32", "new_ieee",
]  # fmt: skip


@pytest.fixture(scope="module")
def tf32_observations():
    """(scenario, with the block) -> what each API reads afterwards, or the error, each from a
    process of its own: forked children of one interpreter where os.fork exists, else one
    interpreter per observation."""
    runs = [(s, str(int(b))) for s in TF32_SCENARIOS for b in (False, True)]
    batches = [runs] if hasattr(os, "fork") else [[r] for r in runs]
    seen = {}
    for batch in batches:
        args = [sys.executable, "-c", _TF32_SCRIPT, json.dumps(batch)]
        done = subprocess.run(args, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        for (scenario, use_block), out in zip(batch, json.loads(done.stdout), strict=True):
            seen[scenario, use_block == "1"] = out
    return seen


@pytest.mark.skipif(
    not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9: one API"
)
@pytest.mark.parametrize("scenario", TF32_SCENARIOS)
def test_matmul_precision_leaves_no_trace_in_either_tf32_api(tf32_observations, scenario):
    # torch >= 2.9 keeps the TF32 flag in two APIs and raises on a legacy read once the new one
    # was used; the block must restore the value, the inheritance from the global setting and
    # whether a legacy read works, whichever API the caller used. Processes of their own,
    # because the flags are process-wide state: the same observations with and without the
    # block.
    with_block, without = tf32_observations[scenario, True], tf32_observations[scenario, False]
    for out in (with_block, without):
        assert "error" not in out, out["error"][-2000:]
    assert with_block["seen"] == without["seen"]


# ----- determinism -----


@pytest.mark.parametrize("schedule", ["symmetric", "alternating"])
def test_deterministic_torch(schedule):
    runs = []
    for _ in range(2):
        x, y, a, b = _inputs(batched=True, requires_grad=True)
        v = fs.ot_cost(x, y, a, b, eps=0.05, schedule=schedule, backend="torch")
        v.sum().backward()
        runs.append((v.detach(), x.grad, y.grad, a.grad, b.grad))
    for t0, t1 in zip(*runs, strict=True):
        assert torch.equal(t0, t1)


def test_deterministic_triton(device):
    runs = []
    for _ in range(2):
        x, y, _, _ = (t.to(device) for t in _inputs(batched=True))
        x.requires_grad_(True)
        v = fs.ot_cost(x, y, eps=0.1, tol=None, n_iters=3, backend="triton")
        v.sum().backward()
        runs.append((v.detach(), x.grad))
    for t0, t1 in zip(*runs, strict=True):
        assert torch.equal(t0, t1)


# ----- threads -----


def test_solves_from_several_threads_match_serial():
    problems = [_inputs(batched=bool(i % 2), seed=i) for i in range(8)]

    def run(p):
        x, y, a, b = (t.detach().clone().requires_grad_(True) for t in p)
        v = fs.sinkhorn_divergence(x, y, a, b, eps=0.05, backend="torch")
        v.sum().backward()
        return v.detach(), x.grad

    serial = [run(p) for p in problems]
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(run, problems * 3))
    for i, (v, gx) in enumerate(threaded):
        v0, g0 = serial[i % len(problems)]
        assert torch.equal(v, v0) and torch.equal(gx, g0)


def test_mhc_kernel_cache_thread_safe():
    # Generated Triton kernels are cached per (n, n_iters, variant): concurrent first calls
    # must build one kernel object, not race and compile several.
    from flashsinkhorn.mhc import sk_triton
    from flashsinkhorn.tuning import TUNING

    # the cache key: (n, n_iters, variant, generator options, block)
    key = (3, 7, "log", tuple(TUNING.mhc_small_bwd), sk_triton.SMALL_CONFIG["bwd"][0])
    sk_triton._SMALL_CACHE.pop(key, None)
    barrier = threading.Barrier(6)

    def get(_):
        barrier.wait()
        return sk_triton._small_kernels(*key)

    with ThreadPoolExecutor(max_workers=6) as pool:
        kernels = list(pool.map(get, range(6)))
    assert all(k is kernels[0] for k in kernels)
