"""The split interface (``hc(H)`` → branch input, add_residual, H_res), the static mode, the
softmax H_pre, the layer-index initialisation and the public step functions, against the
float64 reference layer."""

import pytest
import torch

from flashsinkhorn.mhc import (
    HyperConnection,
    HyperConnectionReference,
    SplitHyperConnection,
    fused_add_residual,
    fused_dynamic_weights,
    fused_stream_mix,
)
from flashsinkhorn.mhc.reference import PRE_INIT_LOGIT
from flashsinkhorn.tuning import TUNING

from .test_layer import _compare

OPTIONS = [
    {"dynamic": False},
    {"pre_activation": "softmax"},
    {"dynamic": False, "pre_activation": "softmax", "layer_idx": 5},
    {"layer_idx": 2, "variant": "deepseek", "eps": 1e-3},
]


def _pair(C, n, n_iters, backend, seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    hc = HyperConnection(
        C, n, n_iters=n_iters, gemm_precision="ieee", backend=backend, dtype=dtype, **kw
    )
    with torch.no_grad():
        for name, p in hc.named_parameters():
            if name == "phi":
                p.normal_(0, 0.5)
            elif name == "bias":
                p.add_(torch.randn_like(p))
            else:
                p.fill_({"alpha_pre": 0.7, "alpha_post": -0.4, "alpha_res": 0.9}[name])
    ref_kw = {k: v for k, v in kw.items() if k not in ("variant", "eps")}
    ref = HyperConnectionReference(
        C, n, n_iters=n_iters, variant=kw.get("variant", "log"), eps=kw.get("eps", 1e-6),
        **ref_kw,
    ).double()  # fmt: skip
    ref.load_state_dict({k: v.double() for k, v in hc.state_dict().items()})
    return hc, ref


@pytest.mark.parametrize("kw", OPTIONS)
def test_torch_layer_options_float64(kw):
    hc, ref = _pair(16, 4, 20, "torch", dtype=torch.float64, seed=1, **kw)
    _compare(hc, ref, (2, 3), 4, 16, "cpu", 1e-10)


@pytest.mark.parametrize("kw", OPTIONS)
def test_triton_layer_options(device, kw):
    hc, ref = _pair(40, 3, 5, "triton", seed=2, **kw)
    _compare(hc, ref, (13,), 3, 40, device, 1e-4)


def _split_run(module, h, f0, w, g):
    h = h.clone().requires_grad_(True)
    f0 = f0.clone().requires_grad_(True)
    u, add_residual, h_res = module(h) if isinstance(module, SplitHyperConnection) else (
        module.split(h)
    )  # fmt: skip
    out = add_residual(torch.tanh(u) * w + f0)
    k = torch.arange(h_res.shape[-1], device=out.device)
    loss = (out * g).sum() + (h_res.to(out.dtype) * k).sum()
    loss = loss + u.square().sum()
    grads = torch.autograd.grad(loss, [h, f0, *module.parameters()])
    return [t.detach() for t in (u, out, h_res)], grads


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_split_interface_matches_reference(device, backend, dynamic):
    # hc(H) -> (branch_input, add_residual, H_res): values and gradients through all three
    torch.manual_seed(3)
    n, C = 4, 24
    dt = torch.float64 if backend == "torch" else torch.float32
    dev = "cpu" if backend == "torch" else device
    hc = SplitHyperConnection(
        C, n, dynamic=dynamic, sinkhorn_iters=6, layer_idx=1, backend=backend,
        gemm_precision="ieee", dtype=dt,
    ).to(dev)  # fmt: skip
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ref = HyperConnectionReference(
        C, n, n_iters=6, dynamic=dynamic, pre_activation="softmax", layer_idx=1
    ).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in hc.state_dict().items()})
    gen = torch.Generator().manual_seed(4)
    h, g = (torch.randn(2, 5, n, C, generator=gen, dtype=torch.float64) for _ in range(2))
    f0, w = torch.randn(2, 5, C, generator=gen, dtype=torch.float64), torch.randn(C).double()
    vals, grads = _split_run(hc, *(t.to(dev, dt) for t in (h, f0, w, g)))
    vals_ref, grads_ref = _split_run(ref, h, f0, w, g)
    tol = 1e-10 if backend == "torch" else 1e-4
    for a, b in zip([*vals, *grads], [*vals_ref, *grads_ref], strict=True):
        assert a.shape == b.shape
        err = (a.double().cpu() - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert err < tol, err


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dynamic", [True, False])
def test_add_residual_called_twice(device, monkeypatch, fused, dynamic):
    # two residual updates from one split: the gradients of X add up through the sink
    monkeypatch.setattr(TUNING, "mhc_fused_dx", fused)
    hc, ref = _pair(24, 3, 4, "triton", seed=10, dynamic=dynamic)
    gen = torch.Generator().manual_seed(11)
    h, g1, g2 = (torch.randn(6, 3, 24, generator=gen, dtype=torch.float64) for _ in range(3))

    def run(module, h, g1, g2):
        h = h.clone().requires_grad_(True)
        u, add_residual, _ = module.split(h)
        loss = (add_residual(torch.tanh(u)) * g1).sum() + (add_residual(u * 2) * g2).sum()
        return torch.autograd.grad(loss, [h, *module.parameters()])

    expect = run(ref, h, g1, g2)
    got = run(hc.to(device), *(t.to(device, torch.float32) for t in (h, g1, g2)))
    for a, b in zip(got, expect, strict=True):
        err = (a.double().cpu() - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert err < 1e-4, err


def test_static_mode_has_bias_only():
    hc = HyperConnection(8, 4, dynamic=False)
    assert [name for name, _ in hc.named_parameters()] == ["bias"]
    x = torch.randn(3, 4, 8)
    pre, post, res = hc.coefficients(x.reshape(-1, 4, 8))
    assert torch.equal(pre[0], pre[2]) and torch.equal(res[0], res[1])


@pytest.mark.parametrize("pre_activation", ["sigmoid", "softmax"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_layer_idx_init_favours_one_stream(pre_activation, dynamic):
    n = 4
    for layer_idx in (0, 1, 6):
        hc = HyperConnection(
            32, n, layer_idx=layer_idx, pre_activation=pre_activation, dynamic=dynamic
        )
        pre, _, _ = hc.coefficients(torch.randn(64, n, 32))
        k = layer_idx % n
        assert (pre.argmax(-1) == k).all()
        other = torch.cat([pre[:, :k], pre[:, k + 1 :]], 1)
        assert (pre[:, k] > 0.9).all() and (other < 0.05).all()
    z = torch.tensor(PRE_INIT_LOGIT)
    hc = HyperConnection(8, n, layer_idx=3, dynamic=False)
    pre, _, _ = hc.coefficients(torch.randn(1, n, 8))
    torch.testing.assert_close(pre[0, 3], torch.sigmoid(z)), pre
    hc = HyperConnection(8, n, dynamic=False)
    pre, _, _ = hc.coefficients(torch.randn(1, n, 8))
    assert torch.equal(pre, torch.full_like(pre, 0.5))


def test_softmax_pre_sums_to_one():
    hc, _ = _pair(16, 4, 5, "torch", seed=5, pre_activation="softmax")
    pre, _, _ = hc.coefficients(torch.randn(7, 4, 16))
    torch.testing.assert_close(pre.sum(-1), torch.ones(7))


# ----------------------------------------------------------------------------- step functions


def _grads(fn, inputs, g):
    inputs = [t.clone().requires_grad_(True) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * gi).sum() for o, gi in zip(outs, g, strict=True))
    return [o.detach() for o in outs], torch.autograd.grad(loss, inputs)


def _check(fn, inputs64, g64, device, tol):
    o_ref, g_ref = _grads(lambda *a: fn(*a, backend="torch"), inputs64, g64)
    dev_in = [t.to(device, torch.float32) for t in inputs64]
    dev_g = [t.to(device, torch.float32) for t in g64]
    o, gr = _grads(lambda *a: fn(*a, backend="triton"), dev_in, dev_g)
    for a, b in zip([*o, *gr], [*o_ref, *g_ref], strict=True):
        assert a.shape == b.shape
        err = (a.double().cpu() - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert err < tol, err


def test_fused_stream_mix(device):
    gen = torch.Generator().manual_seed(6)
    h = torch.randn(3, 5, 3, 40, generator=gen, dtype=torch.float64)
    pre = torch.rand(3, 5, 3, generator=gen, dtype=torch.float64)
    res = torch.rand(3, 5, 3, 3, generator=gen, dtype=torch.float64)
    g = [torch.randn(3, 5, 40, generator=gen).double(), torch.randn_like(h)]
    _check(fused_stream_mix, [h, pre, res], g, device, 1e-5)
    u, r = fused_stream_mix(h, pre, res, backend="torch")
    torch.testing.assert_close(u[1, 2], pre[1, 2] @ h[1, 2])
    torch.testing.assert_close(r[1, 2], res[1, 2] @ h[1, 2])


def test_fused_add_residual(device):
    gen = torch.Generator().manual_seed(7)
    r = torch.randn(4, 3, 40, generator=gen, dtype=torch.float64)
    f = torch.randn(4, 40, generator=gen, dtype=torch.float64)
    post = torch.rand(4, 3, generator=gen, dtype=torch.float64)
    _check(fused_add_residual, [r, f, post], [torch.randn_like(r)], device, 1e-5)
    out = fused_add_residual(r, f, post, backend="torch")
    torch.testing.assert_close(out[2, 1], r[2, 1] + post[2, 1] * f[2])


@pytest.mark.parametrize("pre_activation", ["sigmoid", "softmax"])
def test_fused_dynamic_weights(device, pre_activation):
    hc, ref = _pair(24, 4, 5, "torch", seed=8, dtype=torch.float64, pre_activation=pre_activation)
    x = torch.randn(2, 3, 4, 24, dtype=torch.float64)
    params = [hc.phi, hc.bias, hc.alpha_pre, hc.alpha_post, hc.alpha_res]
    params = [p.detach() for p in params]

    def fn(x, phi, bias, a1, a2, a3, backend):
        return fused_dynamic_weights(
            x, phi, bias, a1, a2, a3, n_iters=5, pre_activation=pre_activation,
            gemm_precision="ieee", backend=backend,
        )  # fmt: skip

    g = [torch.randn(2, 3, 4).double(), torch.randn(2, 3, 4).double(), torch.randn(2, 3, 4, 4)]
    _check(fn, [x, *params], [t.double() for t in g], device, 1e-4)
    pre, post, res = fn(x, *params, backend="torch")
    pre_r, post_r, res_r = ref.coefficients(x.reshape(-1, 4, 24))
    for a, b in ((pre, pre_r), (post, post_r), (res, res_r)):
        torch.testing.assert_close(a.reshape(b.shape), b.detach(), rtol=0, atol=1e-12)


def test_step_functions_compose_to_the_layer():
    hc, _ = _pair(16, 4, 6, "torch", seed=9, dtype=torch.float64)
    x = torch.randn(5, 4, 16, dtype=torch.float64)
    pre, post, res = fused_dynamic_weights(
        x, hc.phi, hc.bias, hc.alpha_pre, hc.alpha_post, hc.alpha_res, n_iters=6
    )
    u, r = fused_stream_mix(x, pre, res)
    out = fused_add_residual(r, torch.tanh(u), post)
    torch.testing.assert_close(out, hc(x, torch.tanh), rtol=0, atol=1e-12)


def test_step_functions_bad_input():
    h = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="H_pre must have shape"):
        fused_stream_mix(h, torch.rand(2, 3), torch.rand(2, 4, 4))
    with pytest.raises(TypeError, match="H_res must be a floating"):
        fused_stream_mix(h, torch.rand(2, 4), [[1.0]])
    with pytest.raises(ValueError, match="branch_output must have shape"):
        fused_add_residual(h, torch.rand(2, 7), torch.rand(2, 4))
    with pytest.raises(ValueError, match="backend must be one of"):
        fused_add_residual(h, torch.rand(2, 8), torch.rand(2, 4), backend="cuda")
    with pytest.raises(ValueError, match="phi must have shape"):
        fused_dynamic_weights(h, torch.rand(32, 23), *[torch.rand(1)] * 4)
    with pytest.raises(ValueError, match="x must have shape"):
        fused_dynamic_weights(h, torch.rand(36, 24), *[torch.rand(1)] * 4)
    with pytest.raises(ValueError, match="alpha_post must have one element"):
        fused_dynamic_weights(h, torch.rand(32, 24), torch.rand(24), torch.rand(1),
                              torch.rand(2), torch.rand(1))  # fmt: skip
    with pytest.raises(ValueError, match="bias must have shape"):
        fused_dynamic_weights(h, torch.rand(32, 24), *[torch.rand(1)] * 4)
    wide = torch.randn(2, 9, 8)
    with pytest.raises(ValueError, match="at most 8 streams"):
        fused_stream_mix(wide, torch.rand(2, 9), torch.rand(2, 9, 9), backend="triton")
    u, _ = fused_stream_mix(wide, torch.rand(2, 9), torch.rand(2, 9, 9))  # auto: torch path
    assert u.shape == (2, 8)
    x8 = torch.randn(3, 8, 4)
    w8 = [torch.rand(32, 80), torch.rand(80), torch.rand(1), torch.rand(1), torch.rand(1)]
    with pytest.raises(ValueError, match="at most 7 streams"):
        fused_dynamic_weights(x8, *w8, backend="triton")
    assert fused_dynamic_weights(x8, *w8)[2].shape == (3, 8, 8)
    # the device error names the argument of the streams
    meta = [torch.empty(2, 4, 8, device="meta"), torch.empty(2, 8, device="meta")]
    post = torch.empty(2, 4, device="meta")
    with pytest.raises(ValueError, match="got H_residual on device meta"):
        fused_add_residual(*meta, post, backend="triton")
    with pytest.raises(ValueError, match="got H on device meta"):
        fused_stream_mix(meta[0], post, torch.empty(2, 4, 4, device="meta"), backend="triton")
    w = [torch.empty(32, 24, device="meta"), torch.empty(24, device="meta")]
    w += [torch.empty(1, device="meta")] * 3
    with pytest.raises(ValueError, match="got x on device meta"):
        fused_dynamic_weights(meta[0], *w, backend="triton")


def test_layer_options_bad_input():
    with pytest.raises(TypeError, match="dynamic must be a bool"):
        HyperConnection(8, 4, dynamic=1)
    with pytest.raises(ValueError, match="pre_activation must be one of"):
        HyperConnection(8, 4, pre_activation="relu")
    with pytest.raises(ValueError, match="layer_idx must be >= 0"):
        HyperConnection(8, 4, layer_idx=-1)
    with pytest.raises(TypeError, match="layer_idx must be an int"):
        SplitHyperConnection(8, layer_idx=1.0)
    hc = SplitHyperConnection(8, backend="torch")
    _, add_residual, _ = hc(torch.randn(3, 4, 8))
    with pytest.raises(ValueError, match="branch output must have shape"):
        add_residual(torch.randn(3, 4, 8))


def _grads_of(fn, inputs, seed):
    """Outputs and input gradients of ``fn(*inputs)`` for a random weighting of its outputs."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen).to(o)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in inputs]


@pytest.mark.parametrize("layout", ["slice", "transpose"])
def test_non_contiguous_branch_output(device, layout):
    # F as a slice of a wider output (chunked projections) or a transposed view: the
    # backward reads the F it saved, which must be taken row-major like in the forward
    gen = torch.Generator().manual_seed(11)
    r = torch.randn(6, 3, 16, generator=gen).to(device)
    wide = torch.randn(6, 32, generator=gen).to(device)
    post = torch.rand(6, 3, generator=gen).to(device)

    def fn(r, wide, post, backend):
        f = wide[:, :16]
        return fused_add_residual(
            r, f if layout == "slice" else f.t().contiguous().t(), post, backend=backend
        )

    o, g = _grads_of(lambda *a: fn(*a, "triton"), [r, wide, post], 1)
    o_ref, g_ref = _grads_of(lambda *a: fn(*a, "torch"), [r, wide, post], 1)
    for a, b in zip([*o, *g], [*o_ref, *g_ref], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    hc, _ = _pair(16, 3, 4, "triton", seed=12)
    hc = hc.to(device)
    x = torch.randn(6, 3, 16, generator=gen).to(device)

    def layer(x, wide, hc=hc):
        out = hc(x, lambda u: u * (wide[:, :16] if layout == "slice" else wide[:, ::2]))
        return out, *(p * 1 for p in hc.parameters())

    grads = []
    for backend in ("triton", "torch"):
        hc.backend = backend
        for p in hc.parameters():
            p.grad = None
        o, g = _grads_of(layer, [x, wide], 2)
        grads.append([*o[:1], *g, *(p.grad for p in hc.parameters())])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fused_dynamic_weights_transposed_phi(device):
    # φ as the transpose of a (n² + 2n, n·C) weight: the backward reads it as (n·C, n² + 2n)
    hc, _ = _pair(8, 2, 4, "torch", seed=13)
    w = hc.phi.detach().t().contiguous().to(device)
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(14)).to(device)
    rest = [p.detach().to(device) for p in (hc.bias, hc.alpha_pre, hc.alpha_post, hc.alpha_res)]

    def fn(backend):
        return lambda x, w, *rest: fused_dynamic_weights(
            x, w.t(), *rest, n_iters=4, gemm_precision="ieee", backend=backend
        )

    o, g = _grads_of(fn("triton"), [x, w, *rest], 3)
    o_ref, g_ref = _grads_of(fn("torch"), [x, w, *rest], 3)
    for a, b in zip([*o, *g], [*o_ref, *g_ref], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dynamic", [True, False])
def test_double_backward_raises(device, dynamic):
    # the kernels' gradients carry no graph: differentiating them again must raise rather
    # than return the second derivative of the few torch ops between the kernels
    hc, _ = _pair(8, 2, 3, "triton", seed=15, dynamic=dynamic)
    hc = hc.to(device)
    x = torch.randn(4, 2, 8, device=device, requires_grad=True)
    (g,) = torch.autograd.grad(hc(x, torch.tanh).square().sum(), hc.bias, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.square().sum().backward()
