"""HyperConnection layer: Triton path (interpreter on CPU) and torch path vs the reference."""

import pytest
import torch

from flashsinkhorn.mhc import HyperConnection, HyperConnectionReference
from flashsinkhorn.tuning import TUNING


def _pair(C, n, n_iters, variant, backend, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    hc = HyperConnection(
        C,
        n,
        n_iters=n_iters,
        variant=variant,
        eps=1e-3,
        gemm_precision="ieee",
        backend=backend,
        dtype=dtype,
    )
    with torch.no_grad():
        hc.phi.normal_(0, 0.5)
        hc.bias.normal_()
        hc.alpha_pre.fill_(0.7)
        hc.alpha_post.fill_(-0.4)
        hc.alpha_res.fill_(0.9)
    ref = HyperConnectionReference(C, n, n_iters=n_iters, variant=variant, eps=1e-3).double()
    ref.load_state_dict({k: v.double() for k, v in hc.state_dict().items()})
    return hc, ref


def _run(module, x, f0, w, g):
    """X_next for branch(u) = tanh(u)·w + f0; returns output and grads of x, f0, params."""
    x = x.clone().requires_grad_(True)
    f0 = f0.clone().requires_grad_(True)
    out = module(x, lambda u: torch.tanh(u) * w + f0)
    params = [p for _, p in module.named_parameters()]
    grads = torch.autograd.grad((out * g).sum(), [x, f0, *params])
    return out.detach(), grads


def _compare(hc, ref, lead, n, C, device, tol):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*lead, n, C, generator=gen, dtype=torch.float64)
    f0 = torch.randn(*lead, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, generator=gen, dtype=torch.float64)
    g = torch.randn(*lead, n, C, generator=gen, dtype=torch.float64)
    o_ref, g_ref = _run(ref, x, f0, w, g)
    dt = hc.bias.dtype
    hc = hc.to(device)
    o, gr = _run(hc, x.to(device, dt), f0.to(device, dt), w.to(device, dt), g.to(device, dt))
    names = ["X", "F_out", *(name for name, _ in hc.named_parameters())]
    # errors relative to each tensor's largest entry (tf32 rounding of x·φ moves single
    # entries near zero by a large relative amount)
    err = (o.double().cpu() - o_ref).abs().max().item() / max(1.0, o_ref.abs().max().item())
    assert err < tol, f"output: relative error {err:.3g}"
    for name, a, b in zip(names, gr, g_ref, strict=True):
        scale = max(1.0, b.abs().max().item())
        err = (a.double().cpu() - b).abs().max().item() / scale
        assert err < tol, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("variant", ["log", "deepseek"])
def test_triton_layer_matches_reference(device, variant, fused, monkeypatch):
    # both backward schedules (dX_res fused into the dX pass, or written and read back)
    monkeypatch.setattr(TUNING, "mhc_fused_dx", fused)
    hc, ref = _pair(48, 4, 5, variant, "triton")
    _compare(hc, ref, (37,), 4, 48, device, 1e-4)


@pytest.mark.parametrize("fused", [True, False])
def test_triton_layer_dx_in_slices_of_token_blocks(device, fused, monkeypatch):
    # The dX pass keeps its token blocks on grid axis 1 (at most 65,535 on CUDA) and launches
    # more tokens in slices: here 3 token blocks of 32 (ieee) in slices of 2, then 1.
    from flashsinkhorn.mhc import layer_ops

    monkeypatch.setattr(TUNING, "mhc_fused_dx", fused)
    monkeypatch.setattr(layer_ops, "MAX_GRID_Y", 2)
    hc, ref = _pair(24, 4, 5, "log", "triton", seed=3)
    _compare(hc, ref, (70,), 4, 24, device, 1e-4)


@pytest.mark.parametrize("fused", [True, False])
def test_triton_layer_schedule_read_once_per_forward(device, fused, monkeypatch):
    # the branch runs between the two autograd Functions of the layer: a schedule switch that
    # it flips must not leave them with different backward schedules
    monkeypatch.setattr(TUNING, "mhc_fused_dx", fused)
    hc, ref = _pair(16, 2, 3, "log", "triton", seed=5)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2, 16, generator=gen, dtype=torch.float64)
    g = torch.randn(5, 2, 16, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    o_ref = ref(xr, torch.tanh)
    (dx_ref,) = torch.autograd.grad((o_ref * g).sum(), xr)

    def branch(u):
        TUNING.mhc_fused_dx = not fused
        return torch.tanh(u)

    hc = hc.to(device)
    xt = x.to(device, torch.float32).requires_grad_(True)
    o = hc(xt, branch)
    assert TUNING.mhc_fused_dx is (not fused)
    (dx,) = torch.autograd.grad((o * g.to(device, torch.float32)).sum(), xt)
    torch.testing.assert_close(o.double().cpu(), o_ref.detach(), rtol=0, atol=1e-4)
    torch.testing.assert_close(dx.double().cpu(), dx_ref, rtol=0, atol=1e-4)


def test_triton_layer_odd_shapes(device):
    # n = 2 and 3 (padded stream axis), C not a multiple of any block, leading dims (2, 3)
    hc, ref = _pair(40, 3, 3, "log", "triton", seed=3)
    _compare(hc, ref, (2, 3), 3, 40, device, 1e-4)
    hc, ref = _pair(24, 2, 3, "log", "triton", seed=4)
    _compare(hc, ref, (3,), 2, 24, device, 1e-4)


@pytest.mark.parametrize("variant", ["log", "deepseek"])
def test_torch_layer_float64_matches_reference(variant):
    hc, ref = _pair(16, 4, 20, variant, "torch", dtype=torch.float64)
    _compare(hc, ref, (2, 3), 4, 16, "cpu", 1e-10)


def test_layer_does_not_modify_input(device):
    hc, _ = _pair(32, 4, 3, "log", "triton")
    hc = hc.to(device)
    x = torch.randn(3, 4, 32, device=device)
    x0 = x.clone()
    hc(x).sum().backward()
    assert torch.equal(x, x0)


def test_layer_identity_init_is_near_identity():
    # default init: H_res ≈ I-ish bistochastic, H_post ≈ 1 → X_next ≈ X + F
    hc = HyperConnection(8, 4, backend="torch")
    x = torch.randn(2, 4, 8)
    out = hc(x, lambda u: torch.zeros_like(u))
    assert (out - x).abs().max() < 0.2 * x.abs().max()


def test_layer_bad_input():
    with pytest.raises(ValueError, match="n_streams"):
        HyperConnection(8, 0)
    with pytest.raises(ValueError, match="n_iters"):
        HyperConnection(8, 4, n_iters=0)
    with pytest.raises(ValueError, match="gemm_precision"):
        HyperConnection(8, 4, gemm_precision="fp8")
    with pytest.raises(ValueError, match="n_streams <= 7"):
        HyperConnection(8, 8, backend="triton")
    hc = HyperConnection(8, 4, backend="torch")
    with pytest.raises(ValueError, match="shape"):
        hc(torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match="floating"):
        hc(torch.ones(2, 4, 8, dtype=torch.int32))


def test_example_runs():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "mhc_transformer.py"
    spec = importlib.util.spec_from_file_location("mhc_transformer_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    main = mod.main

    losses = main(steps=3, dim=32, seq=8, batch=2, layers=2, verbose=False)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("variant", ["log", "deepseek"])
def test_gpu_layer_matches_reference(variant, fused, monkeypatch):
    monkeypatch.setattr(TUNING, "mhc_fused_dx", fused)
    hc, ref = _pair(1000, 4, 20, variant, "triton", seed=7)
    _compare(hc, ref, (3, 67), 4, 1000, "cuda", 1e-4)
    hc.gemm_precision = "tf32"
    _compare(hc, ref, (3, 67), 4, 1000, "cuda", 5e-2)
