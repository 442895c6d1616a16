"""The fixed row reference of the transport sweep (backends/triton/transport.py, FIXED_REF):
near a fixed point the sums are in range and the results match float64 and the running max;
far from it the guarded running-max launch redoes the sweep, bit for bit."""

import pytest
import torch

from flashsinkhorn.backends import TorchBackend, resolve_backend
from flashsinkhorn.backends.triton import transport as T

from .test_transport import _pots, _problem, _rel


def _with_flag(monkeypatch, fn):
    """fn()'s result and the values of the fallback flags its transports allocated."""
    flags = []
    real = T._new_flag

    def spy(device):
        flags.append(real(device))
        return flags[-1]

    with monkeypatch.context() as mp:
        mp.setattr(T, "_new_flag", spy)
        out = fn()
    return out, [int(f.item()) for f in flags]


def _running_max(monkeypatch, fn):
    with monkeypatch.context() as mp:
        mp.setattr(T, "FIXED_REFERENCE", False)
        return fn()


CASES = [  # (B, n, m, d, what, split)
    (1, 37, 53, 1, "apply", None),
    (2, 45, 29, 3, "vec", None),
    (1, 33, 70, 17, "grad", None),
    (2, 21, 38, 130, "grad", None),
    (1, 37, 101, 3, "hadamard", 3),
    (1, 45, 83, 17, "grad", 2),
    (2, 29, 75, 5, "vec", 3),
]


def _run(p, f, g, what, eps=0.3):
    tri = resolve_backend("triton", p.device, torch.float32)
    B, m = p.Y.sq.shape
    n = p.X.sq.shape[1]
    gen = torch.Generator().manual_seed(1)
    if what == "grad":
        return lambda be=tri: be.transport_grad(p.X, p.Y, f, g, eps, "ieee")
    V = torch.randn(B, m, 1 if what == "vec" else 4, generator=gen).to(p.device)
    A = Bw = None
    if what == "hadamard":
        A = torch.randn(B, n, 2, generator=gen).to(p.device)
        Bw = torch.randn(B, m, 2, generator=gen).to(p.device)
    return lambda be=tri: be.transport(p.X, p.Y, f, g, eps, V, A, Bw, "ieee")


@pytest.mark.parametrize("B,n,m,d,what,split", CASES)
@pytest.mark.parametrize("cost", ["sqeuclidean", "euclidean"])
def test_fixed_reference_near_a_fixed_point(device, monkeypatch, B, n, m, d, what, split, cost):
    monkeypatch.setattr(T, "FORCE_SPLIT", split)
    p = _problem(B, n, m, d, device, cost=cost, zero_weight=what == "vec")
    f, g = _pots(p, 3)
    fn = _run(p, f, g, what)
    (out, marg), flags = _with_flag(monkeypatch, fn)
    cfg = T.transport_config(d, 4, 0)
    wide = cfg.d_tiles > 1 if what == "grad" else False  # accumulates in the output
    assert flags == ([] if wide else [0])  # the fixed reference served every row: no redo
    ref_out, ref_marg = _running_max(monkeypatch, fn)
    p64 = _problem(B, n, m, d, "cpu", dtype=torch.float64, cost=cost, zero_weight=what == "vec")
    want_out, want_marg = _run(p64, f.double().cpu(), g.double().cpu(), what)(TorchBackend())
    # fp32 accuracy (the transport tests' bound), and not worse than the running max's beyond
    # rounding
    for got, ref, want in ((out, ref_out, want_out), (marg, ref_marg, want_marg)):
        assert _rel(got, want) < 2e-5
        assert _rel(got, want) <= max(2 * _rel(ref, want), 2e-6)


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("shift", [27.0, -27.0])
def test_far_from_a_fixed_point_redoes_with_the_running_max(device, monkeypatch, split, shift):
    """Row potentials moved by ±27 (eps = 0.3) scale the sums by 2^(±130): above 3e38 or
    below 2^-64, while the plan's own marginals stay finite. The guarded launch redoes the
    sweep, and the result is the running max's, bit for bit."""
    monkeypatch.setattr(T, "FORCE_SPLIT", split)
    p = _problem(1, 41, 67, 17, device)
    f, g = _pots(p, 4)
    f = f + shift
    for what in ("grad", "apply"):
        fn = _run(p, f, g, what)
        (out, marg), flags = _with_flag(monkeypatch, fn)
        assert flags == [1]
        ref_out, ref_marg = _running_max(monkeypatch, fn)
        assert torch.equal(out, ref_out) and torch.equal(marg, ref_marg)
        assert torch.isfinite(out).all()


def test_wide_values_keep_the_running_max(device, monkeypatch):
    """V wider than the register accumulator accumulates in the output: no fixed reference
    (a redo would have to clear it), so no flag is allocated."""
    p = _problem(1, 33, 40, 3, device)
    f, g = _pots(p, 5)
    V = torch.randn(1, 40, 70).to(device)
    tri = resolve_backend("triton", p.device, torch.float32)
    cfg = T.transport_config(3, 70, 0)
    assert cfg.p_tiles > 1
    (out, _), flags = _with_flag(
        monkeypatch, lambda: tri.transport(p.X, p.Y, f, g, 0.3, V, None, None, "ieee")
    )
    assert flags == []
    want, _ = TorchBackend().transport(p.X, p.Y, f, g, 0.3, V, None, None, "ieee")
    assert _rel(out, want) < 3e-6
