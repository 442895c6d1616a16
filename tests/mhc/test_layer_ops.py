"""The layer's custom ops: registration (opcheck), torch.compile(fullgraph=True) of models that
use the layer, autocast dtypes. On the CPU the kernels run under the Triton interpreter and
the compiled graphs use the aot_eager backend (the ops are opaque nodes either way)."""

import pytest
import torch
from torch import nn

from flashsinkhorn.mhc import HyperConnection, HyperConnectionReference, SplitHyperConnection
from flashsinkhorn.mhc import layer_ops as L

from .test_layer import _compare, _pair


def _params(n, C, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = n * n + 2 * n
    phi = (0.3 * torch.randn(n * C, N, generator=gen)).requires_grad_(True)
    alphas = [torch.full((1,), v, requires_grad=True) for v in (0.7, -0.4, 0.9)]
    bias = torch.randn(N, generator=gen).requires_grad_(True)
    return phi, alphas, bias


@pytest.mark.parametrize(
    "variant, softmax, mix, fused",
    [("log", False, True, True), ("log", True, True, False), ("deepseek", False, False, True)],
)
def test_opcheck_pre(device, variant, softmax, mix, fused):
    n, C = 4, 8
    phi, alphas, bias = _params(n, C)
    x = torch.randn(3, n, C).requires_grad_(True)
    args = (x, phi, *alphas, bias)
    args = tuple(a.detach().to(device).requires_grad_(True) for a in args)
    torch.library.opcheck(L.pre_op, (*args, 3, variant, 1e-3, 1e-6, "ieee", softmax, mix, fused))


def test_opcheck_post_mix_add(device):
    n, C, T = 3, 8, 3
    gen = torch.Generator().manual_seed(1)

    def leaf(*shape):
        return torch.rand(*shape, generator=gen).to(device).requires_grad_(True)

    x, f, hp, hr = leaf(T, n, C), leaf(T, C), leaf(T, n), leaf(T, n, n)
    torch.library.opcheck(L.post_op, (x, f, hp, hr, L._sink(x.detach()), True))
    torch.library.opcheck(L.post_op, (x, f, hp, hr, leaf(T, n, C), False))
    torch.library.opcheck(L.mix_op, (x, hp, hr, True))
    torch.library.opcheck(L.mix_op, (x, hp, hr, False))
    torch.library.opcheck(L.add_op, (x, f, hp))


@pytest.mark.parametrize("mix, fused", [(True, True), (True, False), (False, True)])
def test_opcheck_backward_ops(device, mix, fused):
    # the backward ops' fakes must promise the layouts the implementations return (inductor
    # asserts them: a column slice of the dφ partial sums once broke that)
    n, C, T = 4, 8, 3
    phi, alphas, bias = (t.detach() if isinstance(t, torch.Tensor) else [a.detach() for a in t]
                         for t in _params(n, C))  # fmt: skip
    x = torch.randn(T, n, C, device=device)
    phi, bias = phi.to(device), bias.to(device)
    alphas = [a.to(device) for a in alphas]
    out = L.pre_op(x, phi, *alphas, bias, 3, "log", 0.0, 1e-6, "ieee", False, mix, fused)
    u, h_pre, h_post, h_res, sink, y_raw, r = out
    du, dsink = torch.randn_like(u), torch.randn(sink.shape, device=device)
    grads = (du, torch.randn_like(h_pre), torch.randn_like(h_post), torch.randn_like(h_res), dsink)
    saved = (x, phi, *alphas, bias, y_raw, r)
    torch.library.opcheck(L._pre_bwd_op, (*grads, *saved, 3, "log", 0.0, "ieee", False, mix, fused))
    f = torch.randn(T, C, device=device)
    dout = torch.randn_like(x)
    torch.library.opcheck(L._post_bwd_op, (dout, x, f, h_post, h_res, fused, mix))
    torch.library.opcheck(L._mix_bwd_op, (du if mix else f, dout, x, h_pre, h_res, mix))


def test_fake_shapes_and_dtypes():
    # meta tensors go through the fake implementations only
    n, C, T = 4, 16, 7
    x = torch.empty(T, n, C, device="meta", dtype=torch.bfloat16)
    phi = torch.empty(n * C, 24, device="meta")
    a = torch.empty(1, device="meta")
    bias = torch.empty(24, device="meta")
    out = L.pre_op(x, phi, a, a, a, bias, 20, "log", 0.0, 1e-6, "tf32", False, True, True)
    u, h_pre, h_post, h_res, sink = out[:5]
    assert u.shape == (T, C) and u.dtype == torch.bfloat16
    assert h_pre.shape == h_post.shape == (T, n) and h_res.shape == (T, n, n)
    assert {t.dtype for t in (h_pre, h_post, h_res)} == {torch.float32}
    assert sink.shape == x.shape and sink.dtype == x.dtype and sink.stride() == (0, 0, 0)
    y_raw, r = out[5:]
    assert y_raw.shape == (T, 24) and r.shape == (T,)
    f = torch.empty(T, C, device="meta", dtype=torch.float32)
    out = L.post_op(x, f, h_post, h_res, sink, True)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    u2, r = L.mix_op(x, h_pre, h_res, True)
    assert u2.dtype == r.dtype == torch.bfloat16 and r.shape == x.shape
    assert L.add_op(r, f, h_post).dtype == torch.bfloat16


class _Block(nn.Module):
    """Two hyper-connected sub-layers, the second through the split interface."""

    def __init__(self, C, n, **kw):
        super().__init__()
        self.hc1 = HyperConnection(C, n, **kw)
        self.hc2 = HyperConnection(C, n, **kw)
        self.lin1 = nn.Linear(C, C)
        self.lin2 = nn.Linear(C, C)

    def forward(self, x):
        x = self.hc1(x, lambda u: torch.tanh(self.lin1(u)))
        u, add_residual, h_res = self.hc2.split(x)
        return add_residual(self.lin2(u)), h_res


def _train_step(block, x):
    out, h_res = block(x)
    (out.square().sum() + h_res.square().sum()).backward()
    return out.detach(), [p.grad for p in block.parameters()]


@pytest.mark.parametrize(
    "kw",
    [{}, {"dynamic": False}, {"pre_activation": "softmax", "variant": "deepseek", "eps": 1e-3}],
)
def test_compile_fullgraph_matches_eager(device, kw):
    torch.manual_seed(0)
    n, C = 4, 24
    block = _Block(C, n, n_iters=3, backend="triton", gemm_precision="ieee", **kw).to(device)
    x = torch.randn(2, 5, n, C, device=device)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    o1, g1 = _train_step(block, x1)
    g1 = [g.clone() for g in g1]
    block.zero_grad()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    o2, g2 = _train_step(compiled, x2)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-6)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-6)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_compile_fullgraph_matches_float64_reference(device):
    # the compiled Triton path against the float64 reference module (values and all grads)
    hc, ref = _pair(40, 3, 4, "log", "triton", seed=11)
    compiled = torch.compile(hc.to(device), backend="aot_eager", fullgraph=True)
    _compare(compiled, ref, (2, 3), 3, 40, device, 1e-4)


def test_compile_inductor(device):
    # the default backend: inductor generates code around the ops and asserts their layouts
    torch.manual_seed(13)
    block = _Block(24, 4, n_iters=3, backend="triton", gemm_precision="ieee").to(device)
    x = torch.randn(2, 5, 4, 24, device=device)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    o1, g1 = _train_step(block, x1)
    g1 = [g.clone() for g in g1]
    block.zero_grad()
    o2, g2 = _train_step(torch.compile(block, fullgraph=True), x2)
    # inductor's generated code for the linear layers sums in another order (fp32 rounding)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compile_torch_path_float64():
    hc, ref = _pair(16, 4, 20, "log", "torch", dtype=torch.float64, seed=12)
    hc.pre_activation = ref.pre_activation = "softmax"
    compiled = torch.compile(hc, backend="aot_eager", fullgraph=True)
    _compare(compiled, ref, (5,), 4, 16, "cpu", 1e-10)


def test_compile_split_interface():
    torch.manual_seed(3)
    hc = SplitHyperConnection(16, 4, sinkhorn_iters=5, layer_idx=2, backend="torch")
    lin = nn.Linear(16, 16)

    def step(h):
        u, add_residual, h_res = hc(h)
        return add_residual(lin(u)).sum() + h_res.sum()

    h = torch.randn(3, 4, 16, dtype=torch.float32)
    h1, h2 = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    step(h1).backward()
    torch.compile(step, backend="aot_eager", fullgraph=True)(h2).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_autocast_dtypes(device, backend):
    # fp32 X under autocast: u, F and X_next in bf16, coefficients and parameter grads fp32
    torch.manual_seed(4)
    n, C = 4, 24
    hc = HyperConnection(C, n, n_iters=4, backend=backend, gemm_precision="ieee").to(device)
    lin = nn.Linear(C, C).to(device)
    x = torch.randn(3, n, C, device=device, requires_grad=True)
    seen = {}

    def branch(u):
        seen["u"] = u.dtype
        f = lin(u)
        seen["f"] = f.dtype
        return f

    with torch.autocast(torch.device(device).type, torch.bfloat16):
        out = hc(x, branch)
        _, _, h_res = hc.split(x)
    assert seen == {"u": torch.bfloat16, "f": torch.bfloat16}
    assert out.dtype == torch.bfloat16 and h_res.dtype == torch.float32
    out.float().square().sum().backward()
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in hc.parameters())
    # same values as float64 math on the bf16-rounded input, to bf16 accuracy
    ref = HyperConnectionReference(C, n, n_iters=4).double()
    ref.load_state_dict({k: v.double().cpu() for k, v in hc.state_dict().items()})
    lin64 = nn.Linear(C, C).double()
    lin64.load_state_dict({k: v.double().cpu() for k, v in lin.state_dict().items()})
    xr = x.detach().cpu().to(torch.bfloat16).double()
    expect = ref(xr, lambda u: lin64(u.to(torch.bfloat16).double()))
    err = (out.detach().double().cpu() - expect).abs().max() / expect.abs().max()
    assert err < 2e-2, err


def test_compile_under_autocast(device):
    # the autocast state is read while tracing: the compiled call casts like the eager one
    torch.manual_seed(5)
    hc = HyperConnection(24, 4, n_iters=3, backend="triton", gemm_precision="ieee").to(device)
    lin = nn.Linear(24, 24).to(device)

    def f(x):
        with torch.autocast(torch.device(device).type, torch.bfloat16):
            return hc(x, lin)

    x = torch.randn(2, 5, 4, 24, device=device)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    o1 = f(x1)
    o1.float().sum().backward()
    o2 = torch.compile(f, backend="aot_eager", fullgraph=True)(x2)
    o2.float().sum().backward()
    assert o1.dtype == o2.dtype == torch.bfloat16
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)


def test_torch_func_grad():
    # the eager Functions use setup_context, so torch.func transforms can differentiate them
    from flashsinkhorn.mhc import sinkhorn_knopp

    m = torch.randn(3, 4, 4, dtype=torch.float64)
    w = torch.randn(4, 4, dtype=torch.float64)
    g = torch.func.grad(lambda t: (sinkhorn_knopp(t, 5, backend="torch") * w).sum())(m)
    m2 = m.clone().requires_grad_(True)
    (sinkhorn_knopp(m2, 5, backend="torch") * w).sum().backward()
    torch.testing.assert_close(g, m2.grad, rtol=0, atol=0)


def test_bf16_input_stays_bf16(device):
    hc, ref = _pair(24, 4, 4, "log", "triton", seed=6)
    hc = hc.to(device)
    x = torch.randn(5, 4, 24, dtype=torch.float64)
    xb = x.to(device, torch.bfloat16).requires_grad_(True)
    out = hc(xb, lambda u: torch.tanh(u))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16
    expect = ref(xb.detach().cpu().double(), torch.tanh)
    err = (out.detach().double().cpu() - expect).abs().max() / expect.abs().max()
    assert err < 2e-2, err


@pytest.mark.gpu
def test_gpu_compile_inductor_training_step():
    # inductor on the GPU: a two-block model trains under torch.compile(fullgraph=True) in bf16
    torch.manual_seed(0)
    n, C = 4, 256
    block = _Block(C, n, n_iters=20).cuda()
    x = torch.randn(4, 64, n, C, device="cuda")
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with torch.autocast("cuda", torch.bfloat16):
        o1, g1 = _train_step(block, x1)
    g1 = [g.clone() for g in g1]
    block.zero_grad()
    compiled = torch.compile(block, fullgraph=True)
    with torch.autocast("cuda", torch.bfloat16):
        o2, g2 = _train_step(compiled, x2)
    assert o2.dtype == torch.bfloat16
    scale = o1.float().abs().max()
    assert (o1.float() - o2.float()).abs().max() / scale < 2e-2
    for a, b in zip(g1, g2, strict=True):
        assert (a - b).abs().max() / a.abs().max().clamp_min(1e-6) < 5e-2


@pytest.mark.slow  # real sm_90 compiles of every variant: minutes on a loaded 2-core CPU
def test_layer_kernels_compile_for_sm90():
    # every variant of the layer's kernels (and the 16-bit paired forward) through Triton's
    # compiler down to an sm_90 cubin, without a GPU: the interpreter runs Python semantics
    # and would not see a kernel that fails to compile
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the checkout under test, not whichever flashsinkhorn the interpreter would find first
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    script = Path(__file__).with_name("sm90_layer_kernels.py")
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"this Triton's compile API: {out['skip']}")
    assert out == {"ok": True}


def test_dynamic_layer_keeps_few_fp32_values_per_token(device):
    # What one dynamic layer keeps alive for its backward besides X and the branch output: the
    # GEMM output y (24 fp32 per token for n = 4), r (1) and H_post (4, for dF). H_pre, H_res
    # and the projection's logits are recomputed in the backward; keeping them, and y padded
    # to 32 columns, made it 73.
    torch.manual_seed(0)
    n, C, T = 4, 16, 9
    hc = HyperConnection(C, n, n_iters=3, backend="triton", gemm_precision="ieee").to(device)
    x = torch.randn(T, n, C, device=device, requires_grad=True)
    saved, own = {}, set()

    def pack(t):
        st = t.untyped_storage()
        per_tok = t.dim() >= 1 and t.shape[0] == T  # not φ, the alphas or the bias
        if per_tok and t.dtype == torch.float32 and st.data_ptr() not in own:
            saved[st.data_ptr()] = st.nbytes() // 4
        return t

    own.add(x.untyped_storage().data_ptr())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        u, add_residual, _ = hc.split(x)
        f = 2.0 * u  # a branch that saves nothing
        own.add(f.untyped_storage().data_ptr())
        out = add_residual(f)
    per_token = sum(saved.values()) / T
    assert per_token == 24 + 1 + 4, sorted(saved.values())
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
