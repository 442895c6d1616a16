"""The Hopper sweep of the plan half-step (backends/triton/half_hopper.py, ``TUNING.hopper_half``)
against the plain Triton sweep, on the GPU: the same row sums to fp32 round-off, the same
solves. On the CPU (interpreter) the Gluon kernel is never chosen, which is checked here too."""

import pytest
import torch

import flashsinkhorn as fs
from flashsinkhorn.backends.triton import half_hopper, plan
from flashsinkhorn.problem import prepare
from flashsinkhorn.tuning import TUNING, override

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the Gluon sweep runs on Hopper GPUs only")


def _problem(B, n, m, d, seed=0, precision="tf32"):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(B, n, d, generator=g) * 2.0
    y = torch.rand(B, m, d, generator=g) * 1.5 + 0.3
    a = torch.rand(B, n, generator=g) + 0.05
    b = torch.rand(B, m, generator=g) + 0.05
    a, b = a / a.sum(1, keepdim=True), b / b.sum(1, keepdim=True)
    dev = torch.device("cuda")
    args = [t.to(dev) for t in (x, y, a, b)]
    return prepare(*args, rho_x=None, rho_y=None, precision=precision)


def _iterate(p, eps, steps=8):
    """Potentials a few online-LSE half-steps from zero: an iterate, as the loop passes them."""
    from flashsinkhorn.backends.triton import softmin

    f = torch.zeros_like(p.X.sq)
    g = torch.zeros_like(p.Y.sq)
    for _ in range(steps):
        f, _ = softmin.softmin(p.X, p.Y, g, eps, f, 0.0, 1.0, False, "tf32")
        g, _ = softmin.softmin(p.Y, p.X, f, eps, g, 0.0, 1.0, False, "tf32")
    return f, g


def _spy(monkeypatch):
    calls = []
    real = half_hopper.launch_sweep

    def spy(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(half_hopper, "launch_sweep", spy)
    return calls


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "B,n,m,d",
    [
        (1, 1000, 1337, 64),
        (2, 517, 3001, 32),
        (1, 2049, 777, 128),
        (3, 301, 499, 16),
        (1, 12000, 9001, 64),
    ],  # fmt: skip
)
def test_hopper_half_step_matches_plain_sweep(monkeypatch, B, n, m, d):
    p = _problem(B, n, m, d)
    eps = 0.05 * d
    f, g = _iterate(p, eps)
    f0, g0 = f.clone(), g.clone()
    for R, C, pot, old in ((p.X, p.Y, g, f), (p.Y, p.X, f, g)):
        with monkeypatch.context() as mp, override(hopper_half=True):
            calls = _spy(mp)
            got, raw = plan.half_step(R, C, pot, eps, old, 0.3, 0.7, True, "tf32")
        assert calls, "the Hopper sweep was not taken"
        want, want_raw = plan.half_step(R, C, pot, eps, old, 0.3, 0.7, True, "tf32")
        scale = float(want_raw.abs().max())
        assert float((raw - want_raw).abs().max()) <= 4e-6 * scale
        assert float((got - want).abs().max()) <= 4e-6 * scale
    assert torch.equal(f, f0) and torch.equal(g, g0)


@pytest.mark.gpu
@needs_hopper
def test_hopper_half_step_flags_out_of_range_sums(monkeypatch):
    """Potentials far from an iterate: the Hopper sweep's sums leave the trusted range and the
    guarded online-LSE sweep redoes the half-step, as for the plain sweep."""
    p = _problem(1, 700, 900, 64)
    z = torch.zeros_like(p.X.sq)
    with monkeypatch.context() as mp, override(hopper_half=True):
        calls = _spy(mp)
        got, _ = plan.half_step(p.X, p.Y, torch.zeros_like(p.Y.sq), 1e-3, z, 0.0, 1.0, False,
                                "tf32")  # fmt: skip
    assert calls
    want, _ = plan.half_step(p.X, p.Y, torch.zeros_like(p.Y.sq), 1e-3, z, 0.0, 1.0, False,
                             "tf32")  # fmt: skip
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


@pytest.mark.gpu
@needs_hopper
def test_alternating_solve_with_hopper_sweep(monkeypatch):
    """A default alternating solve with the Hopper sweep: same iterations and potentials to
    fp32 round-off as with the plain sweep."""
    g = torch.Generator().manual_seed(11)
    x = torch.rand(3000, 64, generator=g).cuda()
    y = torch.rand(2500, 64, generator=g).cuda() + 0.1
    monkeypatch.setattr(plan, "HALF_MIN_SCORES", 0)
    kw = dict(eps=0.5, schedule="alternating", tol=1e-5)
    calls = _spy(monkeypatch)
    with override(hopper_half=True):
        res = fs.sinkhorn(x, y, **kw)
    assert calls
    ref = fs.sinkhorn(x, y, **kw)
    assert not TUNING.hopper_half  # restored; off by default
    assert res.n_iters == ref.n_iters
    scale = float(ref.f.abs().max())
    assert float((res.f - ref.f).abs().max()) <= 2e-5 * scale
    assert float((res.g - ref.g).abs().max()) <= 2e-5 * scale
    assert abs(float(res.value) - float(ref.value)) <= 1e-5 * abs(float(ref.value))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_other_operands_keep_the_plain_sweep(monkeypatch, precision):
    p = _problem(1, 300, 400, 64, precision=precision)
    f, g = torch.zeros_like(p.X.sq), torch.zeros_like(p.Y.sq)
    calls = _spy(monkeypatch)
    with override(hopper_half=True):
        plan.half_step(p.X, p.Y, g, 1.0, f, 0.0, 1.0, False, precision)
    assert not calls


def test_interpreter_never_takes_the_gluon_sweep():
    assert not half_hopper.available(torch.device("cpu"))
    assert half_hopper.supports(64, torch.float16, True, True)
    assert not half_hopper.supports(64, torch.bfloat16, True, True)
    assert not half_hopper.supports(48, torch.float16, True, True)
    assert not half_hopper.supports(64, torch.float16, False, True)
    assert not half_hopper.supports(64, torch.float16, True, False)
