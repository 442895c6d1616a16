"""Each streaming kernel against its floor, on the GPU it runs on.

The floor of a kernel call at one shape is the largest of three times, each from a rate
measured in the same process:

- products: the multiply-add flops of its dot products at the matrix-product rate of their
  operands (torch.matmul at a large square size): "f16" (float16 operands, fp32
  accumulation: the score dot at the default precision "tf32" on float32 points, which reads
  float16 copies on the TF32 grid, docs/kernels.md), "tf32" (float32 tiles with TF32 inputs:
  the P V and Hadamard dots) and "ieee" (fp32 on the CUDA cores: precision "ieee", the
  one-column row sums and the block-sparse kernels' three FMAs per score). "tf32x3" counts
  three float16 products per score and three TF32 products per value dot;
- exp2: the exponentials it evaluates at the exp2 rate of a Triton kernel (``tl.exp2``,
  several independent chains per element, bound by the special-function units);
- bytes: each input read once and each output written once, at the device-to-device copy
  rate (bytes read + written per second).

Counts per call (n rows, m columns, d features; scores = x·y pairs formed):

========================  ===============  ==========================================
kernel                    scores           products (flops)
========================  ===============  ==========================================
softmin (half-step)       n m              2 n m d score
plan_half (half-step)     n m              2 n m d score
symmetric_lse (2 sweeps)  2 n m            2 · 2 n m d score
plan_step                 n m              2 n m d score
pair_step                 2 n m            2 · 2 n m d score
self_triangle             n (n + 1) / 2    2 d per pair, score
transport_pv (width p)    n m              2 n m d score + 2 n m p value
transport_marginal        n m              2 n m d score
transport_grad            n m              2 n m d score + 2 n m d gradient dot
hvp_schur (P v, Pᵀ u)     2 n m            2 · 2 n m d score + 2 · 2 n m row sums
hvp_hadamard (r = 2d)     n m              2 n m d score + 2 n m r (A Bᵀ) + 2 n m d (P V)
sparse_shift/exact        visited T² each  6 per score (three fp32 FMAs)
========================  ===============  ==========================================

Every kernel evaluates one exp2 per score (the online LSE's per-tile rescaling, one per row
and tile, is left out). The self triangle counts each unordered pair once (its diagonal
blocks form both orders of their pairs: BLOCK_M / n more, under 1 % at n >= 20k).

Problems: x, y ~ U[0, 1]^d with random weights (bench/cases.py), eps = 0.1, float32 points,
precision "tf32" unless ``--precision``, prepared and iterated by the library's own solve
(``flashsinkhorn.sinkhorn``, 10 symmetric iterations, ``path="streaming"``) so that the
plan-based kernels run from iterates (a row reports ``fallback`` when the plan step's range
check sent it to the guarded online-LSE sweep anyway). ``plan_half`` is the half-step the
alternating schedule takes from an iterate at B·n·m >= 1e9 scores (plan.half_step: the row
sums of the plan, no running max); ``softmin`` is the online-LSE half-step. The self
triangle iterates the self problem of x the same way. The block-sparse kernels take the
pattern, layouts and potentials of a multiscale solve (mixture onto shell,
bench/bench_multiscale.py, eps = (0.01 · diameter)², tol 1e-3) and run the fine soft-min of
the x side as the backend does: the shift kernel with the guarded exact recompute
(``sparse_shift``), and the exact kernel alone (``sparse_exact``).

Timing: each kernel call is queued behind a ~2 ms GPU sleep, so that CUDA events around it
time the kernels rather than the host's launches; two warm-up calls (compilation), then the
median of ``--reps`` calls (default 15). ``host_ms`` is the host time to queue one call.

Output: a table and ``<out>/kernels_<gpu-name>.json`` (``--quick``: ``kernels_cpu_quick.json``).

Usage::

    python bench/bench_kernels.py                       # GPU: 20k and 50k at d = 3, 64, 128;
                                                        # sparse at 20k, 50k and 1M
    python bench/bench_kernels.py --kernels plan_step,transport_grad --sizes 50000 --dims 64
    python bench/bench_kernels.py --quick --out /tmp/k  # CPU, TRITON_INTERPRET=1, tiny sizes
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    # the Triton kernels run under the interpreter on CPU tensors (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (ROOT, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

EPS = 0.1
SOLVE_ITERS = 10
#: eps of the block-sparse rows, as a fraction of the diameter: eps = (f · D)²
SPARSE_EPS_FACTOR = 0.01
SPARSE_SHAPE = "gmm_shell"

#: every kernel the benchmark times, in table order
KERNELS = (
    "softmin",
    "plan_half",
    "symmetric_lse",
    "plan_step",
    "pair_step",
    "self_triangle",
    "transport_pv",
    "transport_marginal",
    "transport_grad",
    "hvp_schur",
    "hvp_hadamard",
    "sparse_shift",
    "sparse_exact",
)
SPARSE_KERNELS = ("sparse_shift", "sparse_exact")
#: the kernels' product rates
RATE_KEYS = ("f16", "tf32", "ieee")


# ----- work model: counts per call and the floor -----


@dataclass
class Work:
    """What one kernel call must do at the least.

    Attributes:
        scores: score pairs formed.
        exp2: exponentials evaluated.
        products: multiply-add flops per rate key (:data:`RATE_KEYS`).
        bytes: inputs read once plus outputs written once.
    """

    scores: float
    exp2: float
    products: dict = field(default_factory=dict)
    bytes: float = 0.0


def _add(*parts: dict) -> dict:
    out: dict = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


def dot_products(precision: str, flops: float, half: bool) -> dict:
    """{rate key: flops} of a dot at ``precision``. ``half``: the score dot x·yᵀ of float32
    points, which at "tf32" multiplies float16 grid copies (fp32 accumulation) and at
    "tf32x3" three float16 products (hi·hi + hi·lo + lo·hi); otherwise a dot of float32 tiles
    (P V, the Hadamard weights A Bᵀ): TF32 inputs, or Triton's three TF32 products. "ieee":
    fp32 on the CUDA cores either way."""
    if precision == "ieee":
        return {"ieee": flops}
    return {"f16" if half else "tf32": (3.0 if precision == "tf32x3" else 1.0) * flops}


def score_products(precision: str, flops: float) -> dict:
    return dot_products(precision, flops, True)


def value_products(precision: str, flops: float) -> dict:
    return dot_products(precision, flops, False)


def operand_bytes(precision: str, d: int) -> int:
    """Bytes per point of the score operand: a float16 copy ("tf32"), float16 hi/lo parts
    ("tf32x3") or the float32 point ("ieee")."""
    return {"tf32": 2 * d, "tf32x3": 4 * d}.get(precision, 4 * d)


def count(kernel: str, n: int, m: int, d: int, precision: str = "tf32", fp16_grad: bool = True,
          sparse: dict | None = None) -> Work:  # fmt: skip
    """The :class:`Work` of one call of ``kernel`` (one of :data:`KERNELS`).

    Args:
        kernel: the kernel's name.
        n, m: rows and columns (the self triangle uses n only).
        d: features.
        precision: "tf32", "tf32x3" or "ieee".
        fp16_grad: the gradient's P·y dot multiplies float16 tiles at "tf32"
            (``TUNING.fp16_grad``).
        sparse: for the block-sparse kernels, ``{"pairs", "tile", "rows", "cols"}``: visited
            tile pairs, points per tile, padded row and column points.
    """
    if kernel in SPARSE_KERNELS:
        t, pairs, rows = sparse["tile"], sparse["pairs"], sparse["rows"]
        scores = float(pairs) * t * t
        # row points, column points and bias, CSR, the shift (shift kernel); the LSE out
        nbytes = rows * 12 + sparse["cols"] * 16 + (rows // t + 1 + pairs) * 4 + rows * 4
        nbytes += rows * 4 if kernel == "sparse_shift" else 0
        return Work(scores, scores, {"ieee": 6.0 * scores}, nbytes)
    nm, f4 = float(n) * m, 4
    tri = n * (n + 1) / 2.0
    dot = 2.0 * nm * d
    grad = score_products if (fp16_grad and precision == "tf32") else value_products
    # operands, squared norms, log-weights and potentials of both sides; then each kernel's
    # (scores, products, bytes): its other inputs and its outputs
    both = (n + m) * (operand_bytes(precision, d) + 3 * f4)
    table = {
        # (the rows read the old potential, not their log-weights, and write one vector)
        "softmin": (nm, {}, both),
        "plan_half": (nm, {}, both),
        "symmetric_lse": (2 * nm, {}, both + (n + m) * f4),
        "plan_step": (nm, {}, both + (n + m) * f4),
        "pair_step": (2 * nm, {}, both + (n + m) * f4),
        "self_triangle": (tri, {}, n * (operand_bytes(precision, d) + 4 * f4)),
        "transport_pv": (nm, value_products(precision, dot), both + (m + n) * d * f4 + n * f4),
        "transport_marginal": (nm, {}, both + n * f4),
        "transport_grad": (nm, grad(precision, dot), both + n * d * f4 + n * f4),
        # P v then Pᵀ u: two one-column transports, each a row sum (one FMA per score)
        "hvp_schur": (2 * nm, {"ieee": 4 * nm}, both + 2 * m * f4),
        # weights A Bᵀ of rank 2d, then P V with V of width d
        "hvp_hadamard": (nm, _add(value_products(precision, 4 * nm * d),
                                  value_products(precision, dot)),
                         both + (n + m) * 2 * d * f4 + (m + n) * d * f4 + n * f4),
    }  # fmt: skip
    if kernel not in table:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    scores, extra, nbytes = table[kernel]
    return Work(scores, scores, _add(score_products(precision, 2.0 * scores * d), extra), nbytes)


def floor(work: Work, rates: dict) -> dict:
    """Seconds of each term at the measured ``rates`` ({"copy": B/s, "exp2": 1/s, and flop/s
    per :data:`RATE_KEYS`}), their maximum and the term that binds."""
    prod = sum(flops / rates[k] for k, flops in work.products.items())
    terms = {
        "products": prod,
        "exp2": work.exp2 / rates["exp2"],
        "bytes": work.bytes / rates["copy"],
    }
    bound = max(terms, key=terms.get)
    return {**{f"{k}_s": v for k, v in terms.items()}, "floor_s": terms[bound], "bound": bound}


# ----- ceilings -----


@triton.jit
def _exp2_kernel(X, Out, n, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    # Four independent chains per element, an FMA and an exp2 per step: the special-function
    # units bind, not the latency of one chain.
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    a = tl.load(X + o, mask=m, other=0.0)
    b = a + 0.25
    c = a + 0.5
    e = a + 0.75
    for _ in range(ITERS):
        a = tl.exp2(a * -0.5 - 0.25)
        b = tl.exp2(b * -0.5 - 0.25)
        c = tl.exp2(c * -0.5 - 0.25)
        e = tl.exp2(e * -0.5 - 0.25)
    tl.store(Out + o, a + b + c + e, mask=m)


EXP2_CHAINS = 4


#: GPU sleep before each timed call (cycles): long enough for the host to queue the call.
SLEEP_CYCLES = 4_000_000


def time_call(fn, device: torch.device, reps: int, warmup: int = 2) -> dict:
    """Median and minimum ms of ``fn()`` after ``warmup`` calls; on CUDA each call is queued
    behind a GPU sleep and timed by events (kernel time, not launch time), and ``host_ms`` is
    the host's time to queue it."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times, host = [], []
    if device.type == "cuda":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]  # fmt: skip
        for s, e in ev:
            torch.cuda._sleep(SLEEP_CYCLES)
            t0 = time.perf_counter()
            s.record()
            fn()
            e.record()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in ev]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            host.append(times[-1] / 1e3)
    return {"ms": statistics.median(times), "ms_min": min(times), "reps": reps,
            "host_ms": 1e3 * statistics.median(host)}  # fmt: skip


def copy_rate(device: torch.device, quick: bool, reps: int) -> float:
    """Device-to-device copy, bytes read + written per second (1 GiB buffers)."""
    n = (1 << 20) if quick else (1 << 28)
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device, reps)["ms"] / 1e3
    return 2.0 * n * 4 / t


def exp2_rate(device: torch.device, quick: bool, reps: int) -> float:
    """exp2 evaluations per second of :func:`_exp2_kernel`."""
    n, iters, block = ((1 << 12), 8, 1024) if quick else ((1 << 24), 256, 1024)
    x = torch.rand(n, device=device)
    out = torch.empty_like(x)
    grid = (triton.cdiv(n, block),)
    fn = lambda: _exp2_kernel[grid](x, out, n, ITERS=iters, BLOCK=block, num_warps=8)  # noqa: E731
    t = time_call(fn, device, reps)["ms"] / 1e3
    return n * iters * EXP2_CHAINS / t


@contextlib.contextmanager
def _fp16_full_accumulation():
    flags = torch.backends.cuda.matmul
    saved = flags.allow_fp16_reduced_precision_reduction
    flags.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_fp16_reduced_precision_reduction = saved


def matmul_rates(device: torch.device, quick: bool, reps: int) -> dict:
    """flop/s of torch.matmul at a large square size for each of :data:`RATE_KEYS`: float16
    operands with fp32 accumulation, float32 with TF32, float32 in full fp32. Global flags are
    restored afterwards."""
    from flashsinkhorn.backends.torch_ref import matmul_precision

    size = 256 if quick else 8192
    out = {}
    for key in RATE_KEYS:
        dtype = torch.float16 if key == "f16" else torch.float32
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        ctx = _fp16_full_accumulation() if key == "f16" else matmul_precision(key, device)
        with ctx:
            t = time_call(lambda a=a, b=b: a @ b, device, max(3, reps // 3))["ms"] / 1e3
        out[key] = 2.0 * size**3 / t
        del a, b
    return out


def measure_rates(device: torch.device, quick: bool, reps: int) -> dict:
    rates = {"copy": copy_rate(device, quick, reps), "exp2": exp2_rate(device, quick, reps)}
    rates.update(matmul_rates(device, quick, reps))
    return rates


# ----- problems and kernel calls -----


@contextlib.contextmanager
def _spy(module, name: str, record):
    """Replaces ``module.name`` by a wrapper that calls it and then ``record(args, kwargs)``."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        record(args, kwargs)
        return out

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, real)


def _self_potential(X, precision: str):
    """f after SOLVE_ITERS steps of the self problem of side X: the plain update from zero,
    then averaged triangular steps."""
    from flashsinkhorn.backends.triton import plan_self, softmin

    f0 = torch.zeros_like(X.sq)
    f = softmin.symmetric_step(X, X, f0, f0, EPS, 0.0, 1.0, 1.0, False, precision,
                               x_only=True)[0]  # fmt: skip
    for k in range(SOLVE_ITERS - 1):
        phase = "second" if k == 0 else "iterate"
        f, _ = plan_self.self_step(X, f, EPS, 0.5, 0.5, False, precision, phase=phase)
    return f


def dense_calls(n: int, d: int, device: torch.device, precision: str, wanted) -> dict:
    """{kernel: (call, note)} for the streaming kernels at n = m, d; ``note`` says whether a
    plan kernel fell back (checked on one call). The problem is prepared and iterated by the
    library's own solve."""
    from cases import Size, make_inputs

    import flashsinkhorn as fs
    from flashsinkhorn.backends.triton import pair, plan, plan_self, softmin, transport
    from flashsinkhorn.hessian.joint import TransportHessian

    x, y, a, b = make_inputs(Size(n, n, d), device)
    res = fs.sinkhorn(x, y, a, b, eps=EPS, n_iters=SOLVE_ITERS, tol=None, scaling=None,
                      schedule="symmetric", backend="triton", path="streaming",
                      precision=precision)  # fmt: skip
    sol = res.solution
    X, Y, f, g = sol.problem.X, sol.problem.Y, sol.f, sol.g
    prec = sol.problem.precision
    gen = torch.Generator(device="cpu").manual_seed(n + d)
    B = f.shape[0]
    V = torch.randn(B, Y.n, d, generator=gen).to(device)
    calls = {
        "softmin": lambda: softmin.softmin(X, Y, g, EPS, f, 0.0, 1.0, False, prec),
        "plan_half": lambda: plan.half_step(X, Y, g, EPS, f, 0.0, 1.0, False, prec),
        "symmetric_lse": lambda: softmin.symmetric_step(
            X, Y, f, g, EPS, 0.5, 0.5, 0.5, False, prec
        ),  # fmt: skip
        "plan_step": lambda: plan.symmetric_step(
            X, Y, f, g, EPS, 0.5, 0.5, 0.5, False, prec, phase="iterate"
        ),  # fmt: skip
        "pair_step": lambda: pair.pair_step(
            (X, Y, g, f, 1.0), (Y, X, f, g, 1.0), EPS, 0.0, False, prec
        ),  # fmt: skip
        "transport_pv": lambda: transport.transport(X, Y, f, g, EPS, V, None, None, prec),
        "transport_marginal": lambda: transport.transport(
            X, Y, f, g, EPS, None, None, None, prec
        ),  # fmt: skip
        "transport_grad": lambda: transport.transport_grad(X, Y, f, g, EPS, prec),
    }
    out = {k: (c, "") for k, c in calls.items() if k in wanted}
    # The range checks are read on a call after the first: a kind's first call also runs once
    # with its launches only recorded (parallel compilation), flag unset.
    for name in ("plan_step", "plan_half"):
        if name in wanted:
            calls[name]()
            flags = []
            record = lambda a, kw, flags=flags: flags.append(float(kw["guard"]))  # noqa: E731
            with _spy(softmin, "symmetric_step", record):
                calls[name]()
            out[name] = (calls[name], "fallback" if any(flags) else "")
    if "self_triangle" in wanted:
        fs_ = _self_potential(X, prec)
        call = lambda: plan_self.self_step(X, fs_, EPS, 0.5, 0.5, False, prec)  # noqa: E731
        call()
        flags = []
        with _spy(plan_self, "guarded_softmin", lambda a, kw: flags.append(float(a[-1]))):
            call()
        out["self_triangle"] = (call, "fallback" if any(flags) else "")
    if "hvp_schur" in wanted or "hvp_hadamard" in wanted:
        H = TransportHessian(res)
        v = torch.randn(B, Y.n, generator=gen).to(device)
        out["hvp_schur"] = (lambda: H.schur(v, 1e-5), "")
        Ax = torch.randn(B, X.n, d, generator=gen).to(device)
        Ay = torch.randn(B, Y.n, d, generator=gen).to(device)
        A = torch.cat([Ax, H.x], -1).contiguous()
        Bw = torch.cat([H.y, Ay], -1).contiguous()
        out["hvp_hadamard"] = (lambda: transport.transport(X, Y, f, g, EPS, H.y, A, Bw, prec), "")
    return {k: v for k, v in out.items() if k in wanted}


def _bench_multiscale():
    spec = importlib.util.spec_from_file_location(
        "_bench_multiscale", BENCH / "bench_multiscale.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sparse_calls(n: int, device: torch.device, wanted) -> tuple[dict, dict]:
    """({kernel: (call, note)}, counts for :func:`count`) of the fine block-sparse soft-min
    of the x side from a converged multiscale solve at n = m."""
    import flashsinkhorn as fs
    from flashsinkhorn.backends.triton import sparse
    from flashsinkhorn.multiscale.clustering import TILE

    x, y, diam = _bench_multiscale().make(SPARSE_SHAPE, n)
    eps = (SPARSE_EPS_FACTOR * diam) ** 2
    # On the CPU (the quick mode) a few iterations on the torch backend give a pattern: the
    # converged solve took minutes there; the timed kernels are the Triton ones either way.
    cuda = device.type == "cuda"
    res = fs.sinkhorn(x.to(device), y.to(device), eps=eps, tol=1e-3 if cuda else None,
                      n_iters=1000 if cuda else 3, path="multiscale",
                      backend="triton" if cuda else "torch")  # fmt: skip
    sol = res.solution
    be, p = sol.backend, sol.problem
    lr, lc = be.layout(p.X), be.layout(p.Y)
    rowptr, cols = be.state.pattern.csr["xy"]
    hc = (lc.sort(sol.g) / sol.eps + lc.logw).reshape(-1).contiguous()
    xr, xc = lr.x.reshape(-1, 3).contiguous(), lc.x.reshape(-1, 3).contiguous()
    axes = xc.t().contiguous()
    # the alternating half-step's shift (alpha = 0, beta = 1): -f / eps, as the backend's
    shift = (lr.sort(sol.f, fill=None) * (-1.0 / sol.eps)).reshape(-1).contiguous()
    args = (xr, xc, hc, rowptr, cols, sol.eps, False, TILE)
    shift_call = lambda: sparse.sparse_lse(*args, xc_axes=axes, shift=shift)  # noqa: E731
    exact_call = lambda: sparse.sparse_lse(*args, xc_axes=axes)  # noqa: E731
    redo = []

    def record(a, kw):
        if kw.get("GUARDED"):
            redo.append(float(a[9].float().mean()))  # (kernel, grid, ..., FLAG): tiles redone

    shift_call()
    with _spy(sparse, "launch", record):
        shift_call()
    R, C = xr.shape[0], xc.shape[0]
    info = {"pairs": int(cols.numel()), "tile": TILE, "rows": R, "cols": C,
            "n_iters": res.n_iters, "eps": sol.eps,
            "pair_fraction": cols.numel() / ((R // TILE) * (C // TILE))}  # fmt: skip
    note = f"redone {100 * redo[0]:.1f}% tiles" if redo else ""
    calls = {"sparse_shift": (shift_call, note), "sparse_exact": (exact_call, "")}
    return {k: v for k, v in calls.items() if k in wanted}, info


# ----- driver -----


def _row(kernel, n, d, work: Work, fl: dict, timing: dict, note: str, extra=None) -> dict:
    t = timing["ms"] / 1e3
    row = {
        "kernel": kernel, "n": n, "m": n, "d": d, **timing,
        "scores": work.scores, "exp2": work.exp2, "products": work.products, "bytes": work.bytes,
        "products_floor_ms": 1e3 * fl["products_s"], "exp2_floor_ms": 1e3 * fl["exp2_s"],
        "bytes_floor_ms": 1e3 * fl["bytes_s"], "floor_ms": 1e3 * fl["floor_s"],
        "achieved_of_floor": fl["floor_s"] / t, "bound": fl["bound"],
        "scores_per_s": work.scores / t, "note": note,
    }  # fmt: skip
    if extra:
        row.update(extra)
    return row


HEAD = (f"{'kernel':<19}{'n':>8}{'d':>5}{'ms':>9}{'prod ms':>9}{'exp2 ms':>9}{'bytes ms':>9}"
        f"{'floor ms':>9}{'of floor':>9}  bound     note")  # fmt: skip


def format_row(r: dict) -> str:
    return (f"{r['kernel']:<19}{r['n']:>8}{r['d']:>5}{r['ms']:>9.3f}{r['products_floor_ms']:>9.3f}"
            f"{r['exp2_floor_ms']:>9.3f}{r['bytes_floor_ms']:>9.4f}{r['floor_ms']:>9.3f}"
            f"{100 * r['achieved_of_floor']:>8.1f}%  {r['bound']:<9} {r['note']}")  # fmt: skip


def _ints(spec: str) -> list[int]:
    return [int(float(t)) for t in spec.split(",") if t.strip()]


def _guarded(rows, label: dict, fn):
    """``fn()``, or None with an error row (``label`` + the exception) when it raises: one
    failing kernel or shape does not cost the rest of the run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        rows.append({**label, "error": f"{type(exc).__name__}: {exc}"})
        print(f"{label}: {rows[-1]['error']}", flush=True)
        return None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, CPU, TRITON_INTERPRET=1")
    ap.add_argument("--sizes", default=None, help="n = m of the dense kernels (20000,50000)")
    ap.add_argument("--dims", default=None, help="d of the dense kernels (3,64,128)")
    ap.add_argument("--sparse-sizes", default=None, help="n = m of the sparse kernels")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--precision", default="tf32", choices=("tf32", "tf32x3", "ieee"))
    ap.add_argument("--reps", type=int, default=None, help="timed calls per row (15; quick 2)")
    args = ap.parse_args(argv)
    quick = args.quick
    device = torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("without CUDA run with TRITON_INTERPRET=1 (and --quick)")
    sizes = _ints(args.sizes or ("96" if quick else "20000,50000"))
    dims = _ints(args.dims or ("3,40" if quick else "3,64,128"))
    sparse_sizes = _ints(args.sparse_sizes or ("300" if quick else "20000,50000,1000000"))
    reps = args.reps or (2 if quick else 15)
    wanted = [k for k in args.kernels.split(",") if k]
    if set(wanted) - set(KERNELS):
        raise SystemExit(f"--kernels: choose from {', '.join(KERNELS)}")
    from flashsinkhorn.tuning import TUNING

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    t_start = time.perf_counter()
    rates = measure_rates(device, quick, reps)
    mm = ", ".join(f"{k} {rates[k] / 1e12:.1f} TFLOP/s" for k in RATE_KEYS)
    print(f"{name}: copy {rates['copy'] / 1e12:.2f} TB/s, exp2 {rates['exp2']:.3g}/s, {mm}")
    print(HEAD, flush=True)
    rows: list = []

    def run(kernel, n, d, call, note, work, extra=None):
        timing = _guarded(rows, {"kernel": kernel, "n": n, "d": d},
                          lambda: time_call(call, device, reps))  # fmt: skip
        if timing is not None:
            rows.append(_row(kernel, n, d, work, floor(work, rates), timing, note, extra))
            print(format_row(rows[-1]), flush=True)

    dense = [k for k in wanted if k not in SPARSE_KERNELS]
    for n, d in [(n, d) for n in sizes for d in dims] if dense else []:
        label = {"kernel": "setup", "n": n, "d": d}
        calls = _guarded(rows, label, lambda n=n, d=d: dense_calls(n, d, device, args.precision,
                                                                  dense))  # fmt: skip
        for k in dense if calls else []:
            run(k, n, d, *calls[k], count(k, n, n, d, args.precision, TUNING.fp16_grad))
        calls = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sparse = [k for k in wanted if k in SPARSE_KERNELS]
    for n in sparse_sizes if sparse else []:
        got = _guarded(rows, {"kernel": "setup", "n": n, "d": 3},
                       lambda n=n: sparse_calls(n, device, sparse))  # fmt: skip
        for k in sparse if got else []:
            run(k, n, 3, *got[0][k], count(k, n, n, 3, sparse=got[1]), {"sparse": got[1]})
    meta = {
        "device": name, "torch": torch.__version__, "triton": triton.__version__,
        "date": _dt.date.today().isoformat(), "quick": quick, "eps": EPS,
        "precision": args.precision, "reps": reps, "solve_iters": SOLVE_ITERS,
        "sparse": {"shape": SPARSE_SHAPE, "eps": f"({SPARSE_EPS_FACTOR} * diameter)^2",
                   "tol": 1e-3},
        "command": " ".join(["python bench/bench_kernels.py", *(sys.argv[1:] if argv is None
                                                                else argv)]),
        "wall_s": round(time.perf_counter() - t_start, 1),
    }  # fmt: skip
    result = {"meta": meta, "rates": rates, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    path = out / f"kernels_{slug}{'_quick' if quick else ''}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path} ({meta['wall_s']} s)")
    return result


if __name__ == "__main__":
    main()
