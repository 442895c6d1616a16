"""The projection's value check (``check_finite``): the Triton forward checks the logits in its
kernel and must refuse exactly what the torch backend refuses, with the same message, and
return bitwise the same result as without the check; on the GPU it must cost no more than a
synchronisation."""

import math
import statistics
import time

import pytest
import torch

from flashsinkhorn.mhc import sinkhorn as S
from flashsinkhorn.mhc import sinkhorn_knopp, sk_triton, value_check

from ..interpreter_versions import MASKED_SCALAR_STORE, OLD_INTERPRETER
from .test_host_path import best_per_call
from .test_sinkhorn import _logits

# (n, forward path): the small path (one matrix per lane, generated) for n <= 4, the general
# path (one matrix per program) above, and the general path forced at n = 4
PATHS = [(2, "auto"), (3, "auto"), (4, "auto"), (5, "auto"), (4, "general")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# bad-input classes: (name, where in a (B, n, n) batch of B = 5 as a function of n, value);
# the bad matrix is never the first, and every entry is in the last column or row
BAD = [
    ("nan", lambda n: (3, 0, n - 1), math.nan),
    ("+inf", lambda n: (4, n - 1, n - 1), math.inf),
    ("row", lambda n: (2, n - 1, slice(None)), -math.inf),
    ("column", lambda n: (4, slice(None), n - 1), -math.inf),
]

BYTE = {"nan": 0, "+inf": 0, "row": 1, "column": 2}  # the flag byte of each class


def _message(fn):
    with pytest.raises(ValueError) as err:
        fn()
    return str(err.value)


def _use_path(monkeypatch, path):
    """Routes the Triton forward of sinkhorn_knopp through one kernel path ("auto": as chosen
    by n)."""
    if path != "auto":
        real = sk_triton.sk_forward_triton

        def forced(m, n_iters, variant, eps, _path="auto", flag=None):
            return real(m, n_iters, variant, eps, path, flag)

        monkeypatch.setattr(S._SK, "sk_forward_triton", forced, raising=False)


def _forward(m, variant, check):
    eps = 1e-3 if variant == "deepseek" else 1e-6
    return sinkhorn_knopp(m, 2, variant=variant, eps=eps, backend="triton", check_finite=check)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["log", "deepseek"])
@pytest.mark.parametrize("n,path", PATHS)
def test_bad_logits_refused_as_by_torch(device, monkeypatch, n, path, variant, dtype):
    if OLD_INTERPRETER and (n > 4 or path == "general"):
        pytest.skip(MASKED_SCALAR_STORE)
    _use_path(monkeypatch, path)
    m = _logits((5, n, n), seed=n).to(dtype).to(device)
    for name, where, value in BAD:
        bad = m.clone()
        bad[where(n)] = value
        expect = _message(lambda b=bad: sinkhorn_knopp(b.cpu(), 3, backend="torch"))
        got = _message(lambda b=bad: _forward(b, variant, True))
        assert got == expect, (name, got, expect)
        # without the check the same logits run (NaN in, NaN out; "deepseek" adds eps to a
        # zero column of P0)
        if variant == "log" and dtype == torch.float32:
            assert bool(torch.isnan(_forward(bad, variant, False)).any()), name
    # several classes in one batch: the message of the first class, as the torch check's
    bad = m.clone()
    bad[(4, 0, slice(None))] = -math.inf
    bad[(1, slice(None), n - 1)] = -math.inf
    expect = _message(lambda: sinkhorn_knopp(bad.cpu(), 3, backend="torch"))
    assert "row" in expect
    assert _message(lambda: _forward(bad, variant, True)) == expect
    bad[(3, n - 1, 0)] = math.inf
    assert "NaN or +inf" in _message(lambda: _forward(bad, variant, True))
    # the good logits still pass after refusals, with the result of the unchecked kernel
    out = _forward(m, variant, True)
    assert torch.equal(out, _forward(m, variant, False))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,path", PATHS)
def test_allowed_logits_pass_bitwise_equal(device, monkeypatch, n, path, dtype):
    # -inf entries that leave every row and column one finite entry are zeros of P0; logits at
    # the ends of the float32 range make -inf differences (m - rowmax) in a column whose own
    # maximum is finite: neither may raise
    _use_path(monkeypatch, path)
    m = _logits((7, n, n), seed=10 + n).to(dtype).to(device)
    m[1, 0, : n - 1] = -math.inf
    m[2, : n - 1, n - 1] = -math.inf
    m[6, n - 1, 0] = -math.inf
    for variant in ("log", "deepseek"):
        a = _forward(m, variant, True)
        b = _forward(m, variant, False)
        assert torch.equal(a, b), variant
        assert bool(torch.isfinite(a).all())
        if variant == "log":  # ("deepseek" adds eps to every entry of P0)
            assert a[1, 0, 0] == 0 and a[6, n - 1, 0] == 0
    if dtype == torch.float32:
        big = _logits((3, n, n), seed=n).float().to(device)
        big[1, :, 0] = 3e38
        big[1, :, 1:] = -3e38
        a = _forward(big, "log", True)
        torch.testing.assert_close(a, _forward(big, "log", False), rtol=0, atol=0, equal_nan=True)
        sinkhorn_knopp(big.cpu(), 3, backend="torch")  # the reference check passes it too


def test_flag_bytes_per_condition(device):
    # the bytes each kernel sets, for one bad matrix at a time: in the second program of the
    # small path (BLOCK = 256 matrices per program), and in the general path
    n = 4
    paths = (("small", 259),) if OLD_INTERPRETER else (("small", 259), ("general", 3))
    for path, bsz in paths:
        m = _logits((bsz, n, n), seed=3).float().to(device)
        for name, where, value in BAD:
            bad = m.clone()
            bad[(bsz - 2, *where(n)[1:])] = value
            flag = torch.zeros(4, dtype=torch.int8, device=device)
            sk_triton.sk_forward_triton(bad, 1, "log", 0.0, path, flag=flag)
            expect = [0, 0, 0, 0]
            expect[BYTE[name]] = 1
            assert flag.tolist() == expect, (path, name, flag.tolist())
        flag = torch.zeros(4, dtype=torch.int8, device=device)
        out = sk_triton.sk_forward_triton(m, 1, "log", 0.0, path, flag=flag)
        assert flag.tolist() == [0, 0, 0, 0]
        assert torch.equal(out, sk_triton.sk_forward_triton(m, 1, "log", 0.0, path))


def test_flags_reused_only_when_zero(device, monkeypatch):
    monkeypatch.setattr(value_check, "_FREE", {})
    m = _logits((5, 4, 4), seed=4).float().to(device)
    sinkhorn_knopp(m, 3, backend="triton")
    (free,) = value_check._FREE.values()
    assert len(free) == 1
    first = free[0]
    sinkhorn_knopp(m, 3, backend="triton")
    assert free == [first]  # the same flag, taken and given back
    bad = m.clone()
    bad[2, 1, 3] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        sinkhorn_knopp(bad, 3, backend="triton")
    assert free == []  # the flag that reported is dropped, not zeroed and reused
    out = sinkhorn_knopp(m, 3, backend="triton")  # a new flag: the good logits pass
    assert len(free) == 1 and free[0] is not first
    assert torch.equal(out, sinkhorn_knopp(m, 3, backend="triton", check_finite=False))


def test_checked_autograd_and_strided_paths(device):
    m = _logits((2, 3, 4, 4), seed=6).float().to(device)
    g = torch.randn(m.shape, generator=torch.Generator().manual_seed(0)).to(device)
    x1, x2 = m.clone().requires_grad_(True), m.clone().requires_grad_(True)
    p1 = sinkhorn_knopp(x1, 5, backend="triton")
    p2 = sinkhorn_knopp(x2, 5, backend="triton", check_finite=False)
    (p1 * g).sum().backward()
    (p2 * g).sum().backward()
    assert torch.equal(p1, p2) and torch.equal(x1.grad, x2.grad)
    bad = m.clone()
    bad[1, 2, 3, 3] = math.inf
    with pytest.raises(ValueError, match=r"NaN or \+inf"):
        sinkhorn_knopp(bad.requires_grad_(True), 5, backend="triton")
    # a strided view (copied to a contiguous batch before the launch)
    view = bad.detach().transpose(0, 1)
    assert not view.is_contiguous()
    with pytest.raises(ValueError, match=r"NaN or \+inf"):
        sinkhorn_knopp(view, 5, backend="triton")
    good = m.transpose(0, 1)
    assert torch.equal(
        sinkhorn_knopp(good, 5, backend="triton"),
        sinkhorn_knopp(good, 5, backend="triton", check_finite=False),
    )


def test_torch_backend_keeps_reductions(monkeypatch):
    # the torch backend checks with its reductions and never takes a flag
    def no_flag(_):
        raise AssertionError("the torch backend took a flag")

    monkeypatch.setattr(S, "take_flag", no_flag)
    m = _logits((3, 4, 4), seed=7).float()
    sinkhorn_knopp(m, 3, backend="torch")
    m[1, 2, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        sinkhorn_knopp(m, 3, backend="torch")


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_bad_logits_refused(dtype):
    # through the zero-copy flag (or its device-memory fallback) at B = 1 and a large batch
    for bsz in (1, 2**16 + 3):
        m = _logits((bsz, 4, 4), seed=bsz).to(dtype).cuda()
        out = sinkhorn_knopp(m)
        assert torch.equal(out, sinkhorn_knopp(m, check_finite=False))
        for name, where, value in BAD:
            bad = m.clone()
            idx = where(4)
            bad[(bsz - 1, *idx[1:])] = value
            expect = _message(lambda b=bad: sinkhorn_knopp(b.cpu(), backend="torch"))
            assert _message(lambda b=bad: sinkhorn_knopp(b)) == expect, (bsz, name)
        assert torch.equal(sinkhorn_knopp(m), out)  # good logits pass after the refusals
    flag = value_check.take_flag(m)
    print("flag in pinned host memory:", flag._word is not None)
    value_check.give_back(flag)


@pytest.mark.gpu
def test_gpu_capture_skips_the_check():
    # a CUDA graph capture cannot wait for the device: the captured call does not check
    m = _logits((33, 4, 4), seed=1).float().cuda()
    expect = sinkhorn_knopp(m)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sinkhorn_knopp(m)  # warm-up outside the capture (compiles the unchecked kernel too)
        sinkhorn_knopp(m, check_finite=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sinkhorn_knopp(m)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expect)


@pytest.mark.gpu
def test_gpu_checked_host_time_per_call():
    # B = 1 with the default check: each call launches the checking kernel and waits for it
    # (one stream synchronisation). It costs the unchecked call followed by that
    # synchronisation, plus the flag's bookkeeping (2-5 µs on an H200 host), which must stay
    # below a second launch (a bare one-element add_, 6-10 µs there). Compared in the same
    # rounds rather than in microseconds, which moved by half between processes on one host.
    m = torch.randn(1, 4, 4, device="cuda")
    z = torch.zeros(1, device="cuda")
    stream = torch.cuda.current_stream()

    def unchecked_then_sync():
        sinkhorn_knopp(m, 20, check_finite=False)
        stream.synchronize()

    t = best_per_call(
        {
            "checked": lambda: sinkhorn_knopp(m, 20),
            "sync": unchecked_then_sync,
            "add_": lambda: z.add_(1),
        }
    )
    print(
        f"check_finite=True, B = 1: {t['checked'] * 1e6:.1f} µs per call; unchecked and "
        f"synchronised: {t['sync'] * 1e6:.1f} µs; a bare add_: {t['add_'] * 1e6:.1f} µs"
    )
    assert t["checked"] <= t["sync"] + t["add_"], t


@pytest.mark.gpu
def test_gpu_check_costs_nothing_at_large_batch():
    # B = 2^24: the checked call (kernel + one synchronisation) within 1.1x of the unchecked
    # kernel, both timed with the synchronisation, calls interleaved, medians of 15
    m = torch.randn(2**24, 4, 4, device="cuda")

    def timed(check):
        torch.cuda.synchronize()
        t = time.perf_counter()
        sinkhorn_knopp(m, 20, check_finite=check)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for check in (True, False):
        timed(check)
    on, off = [], []
    for _ in range(15):
        on.append(timed(True))
        off.append(timed(False))
    t_on, t_off = statistics.median(on), statistics.median(off)
    print(f"B = 2^24: check_finite=True {t_on * 1e3:.3f} ms, False {t_off * 1e3:.3f} ms")
    assert t_on <= 1.1 * t_off, (t_on, t_off)
