"""mHC projection: torch backend, Triton kernels (interpreter on CPU), variants, bad input."""

import pytest
import torch

from flashsinkhorn import tuning
from flashsinkhorn.mhc import sinkhorn_knopp, sinkhorn_knopp_reference, sk_codegen, sk_triton
from flashsinkhorn.mhc.sinkhorn import _sk_op
from flashsinkhorn.tuning import TUNING

HAS_CUDA = torch.cuda.is_available()


def _logits(shape, scale=3.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def _ref_grad(m, g, n_iters, variant, eps=1e-6):
    m = m.detach().to(torch.float64).requires_grad_(True)
    p = sinkhorn_knopp_reference(m, n_iters, variant, eps)
    (dm,) = torch.autograd.grad(p, m, g.to(torch.float64))
    return p.detach(), dm


# ----------------------------------------------------------------------------- conventions


def test_log_variant_pinned_to_plain_loop():
    m = _logits((3, 4, 4), seed=1)
    p = torch.exp(m - m.amax(-1, keepdim=True))
    for _ in range(7):
        p = p / p.sum(-1, keepdim=True)
        p = p / p.sum(-2, keepdim=True)
    out = sinkhorn_knopp(m, 7, backend="torch")
    torch.testing.assert_close(out, p, rtol=0, atol=1e-13)
    # exactly column-stochastic, rows within the iteration error
    torch.testing.assert_close(out.sum(-2), torch.ones(3, 4, dtype=out.dtype), rtol=0, atol=1e-13)
    assert (out.sum(-1) - 1).abs().max() < 1e-2


def test_deepseek_variant_pinned_to_reference_formula():
    m, eps = _logits((2, 5, 4, 4), seed=2), 1e-3
    p = torch.softmax(m, -1) + eps
    p = p / (p.sum(-2, keepdim=True) + eps)
    for _ in range(9):
        p = p / (p.sum(-1, keepdim=True) + eps)
        p = p / (p.sum(-2, keepdim=True) + eps)
    out = sinkhorn_knopp(m, 10, variant="deepseek", eps=eps, backend="torch")
    torch.testing.assert_close(out, p, rtol=0, atol=1e-13)
    # the two conventions are different functions
    assert (out - sinkhorn_knopp(m, 10, backend="torch")).abs().max() > 1e-4


def test_deepseek_eps_zero_equals_log():
    m = _logits((4, 3, 3), seed=3)
    a = sinkhorn_knopp(m, 5, variant="deepseek", eps=0.0, backend="torch")
    torch.testing.assert_close(a, sinkhorn_knopp(m, 5, backend="torch"), rtol=0, atol=1e-14)


# ----------------------------------------------------------------------------- torch backend


@pytest.mark.parametrize("variant", ["log", "deepseek"])
@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_torch_backend_float64(n, variant):
    m = _logits((3, 5, n, n), scale=4.0, seed=n)
    g = torch.randn(m.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    p_ref, dm_ref = _ref_grad(m, g, 20, variant)
    x = m.clone().requires_grad_(True)
    p = sinkhorn_knopp(x, 20, variant=variant, backend="torch")
    (dm,) = torch.autograd.grad(p, x, g)
    torch.testing.assert_close(p, p_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(dm, dm_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", ["log", "deepseek"])
def test_torch_backend_large_logits(variant):
    m = _logits((64, 4, 4), scale=80.0, seed=11)
    g = torch.randn(m.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p_ref, dm_ref = _ref_grad(m, g, 20, variant)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        x = m.to(dtype).requires_grad_(True)
        p = sinkhorn_knopp(x, 20, variant=variant, backend="torch")
        (dm,) = torch.autograd.grad(p, x, g.to(dtype))
        assert torch.isfinite(p).all() and torch.isfinite(dm).all()
        torch.testing.assert_close(p.double(), p_ref, rtol=0, atol=tol)
        torch.testing.assert_close(dm.double(), dm_ref, rtol=0, atol=tol)


def test_gradcheck_torch_backend():
    m = _logits((2, 3, 3), seed=5).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn_knopp(t, 4, backend="torch"), (m,))
    assert torch.autograd.gradcheck(
        lambda t: sinkhorn_knopp(t, 4, variant="deepseek", eps=1e-2, backend="torch"), (m,)
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_returns_input_dtype(dtype):
    m = _logits((5, 4, 4), seed=4)
    out = sinkhorn_knopp(m.to(dtype), 20, backend="torch")
    assert out.dtype == dtype
    ref = sinkhorn_knopp(m.to(dtype).double(), 20, backend="torch")
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-2)


def test_does_not_modify_inputs():
    m = _logits((3, 4, 4), seed=6).requires_grad_(True)
    before = m.detach().clone()
    g = torch.randn(3, 4, 4, dtype=torch.float64)
    g_before = g.clone()
    p = sinkhorn_knopp(m, 5, backend="torch")
    p.backward(g)
    assert torch.equal(m.detach(), before) and torch.equal(g, g_before)


def test_torch_compile_fullgraph():
    m = _logits((6, 4, 4), seed=8).float()

    def f(t):
        return (sinkhorn_knopp(t, 5, backend="torch") * torch.arange(16.0).view(4, 4)).sum()

    x1 = m.clone().requires_grad_(True)
    x2 = m.clone().requires_grad_(True)
    f(x1).backward()
    torch.compile(f, backend="aot_eager", fullgraph=True)(x2).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-6)


def test_custom_op_registration():
    m = _logits((2, 3, 3), seed=9).float()
    torch.library.opcheck(_sk_op, (m, 3, "log", 1e-6, "torch"))


# ----------------------------------------------------------------------------- bad input


def test_bad_input():
    m = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="logits"):
        sinkhorn_knopp(m)
    with pytest.raises(ValueError, match="logits"):
        sinkhorn_knopp(torch.zeros(4))
    with pytest.raises(TypeError, match="logits"):
        sinkhorn_knopp(torch.zeros(2, 3, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="logits"):
        sinkhorn_knopp([[1.0]])
    for bad in (0, -1):
        with pytest.raises(ValueError, match="n_iters"):
            sinkhorn_knopp(torch.zeros(2, 3, 3), bad)
    for bad in (2.5, True):  # wrong types: TypeError, as everywhere in the library
        with pytest.raises(TypeError, match="n_iters"):
            sinkhorn_knopp(torch.zeros(2, 3, 3), bad)
    with pytest.raises(ValueError, match="variant"):
        sinkhorn_knopp(torch.zeros(2, 3, 3), variant="exp")
    with pytest.raises(ValueError, match="eps"):
        sinkhorn_knopp(torch.zeros(2, 3, 3), variant="deepseek", eps=-1.0)
    with pytest.raises(ValueError, match="backend"):
        sinkhorn_knopp(torch.zeros(2, 3, 3), backend="cuda")
    with pytest.raises(ValueError, match="n <= 32"):
        sinkhorn_knopp(torch.zeros(2, 33, 33), backend="triton")
    with pytest.raises(TypeError, match="float64"):
        sinkhorn_knopp(torch.zeros(2, 3, 3, dtype=torch.float64), backend="triton")
    # with "auto", n > 32 falls back to torch
    out = sinkhorn_knopp(torch.zeros(2, 33, 33), 2)
    torch.testing.assert_close(out, torch.full((2, 33, 33), 1 / 33))


# ----------------------------------------------------------------------------- Triton


def _check_triton(device, n, variant, bsz, n_iters, scale, path, tol=1e-5):
    m = _logits((bsz, n, n), scale=scale, seed=100 + n + bsz)
    g = torch.randn(m.shape, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    p_ref, dm_ref = _ref_grad(m, g, n_iters, variant)
    x = m.float().to(device)
    p = sk_triton.sk_forward_triton(x, n_iters, variant, 1e-6, path)
    dm = sk_triton.sk_backward_triton(x, g.float().to(device), n_iters, variant, 1e-6, path)
    assert torch.isfinite(p).all() and torch.isfinite(dm).all()
    torch.testing.assert_close(p.double().cpu(), p_ref, rtol=0, atol=tol)
    torch.testing.assert_close(dm.double().cpu(), dm_ref, rtol=0, atol=tol)


@pytest.mark.parametrize("variant", ["log", "deepseek"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_triton_small_path(device, n, variant):
    # 37 and 300 are not multiples of the packing (256 matrices per program)
    _check_triton(device, n, variant, 37, 20, 4.0, "small")
    if n == 4:
        _check_triton(device, n, variant, 300, 6, 4.0, "small")


@pytest.mark.parametrize("variant", ["log", "deepseek"])
def test_triton_small_path_large_logits(device, variant):
    _check_triton(device, 4, variant, 53, 20, 80.0, "small")


@pytest.mark.parametrize(
    "opts",
    [
        (0, True, False),
        (7, False, True),
        (20, True, False),
        (8, True, True),
        (20, True, True),
        (0, True, False, 2, True, True),
        (8, True, False, 3, False, True),
        (4, False, True, 2, True, False),
        (20, True, False, 4, False, True),
        (9, True, False, 2, False, True, True),
        (0, False, False, 3, True, True, True),
        (9, True, False, 2, False, True, True, 7),
        (20, False, False, 1, False, True, True, 1),
        (4, True, False, 2, True, True, False, 8),
    ],
)
def test_triton_small_path_generator_options(device, monkeypatch, opts):
    # the backward's register/recompute trade-offs (row scalings kept for the last keep_a
    # rounds, every ckpt-th column scaling kept and the others recomputed, the recomputation
    # issued a round ahead), the late load of the upstream gradient, the paired reciprocals and
    # the last gradient column taken from the zero row sums, the last row from the known
    # column sums, and the first rounds looped over shared memory must not change the result
    monkeypatch.setattr(TUNING, "mhc_small_bwd", opts)
    _check_triton(device, 4, "log", 53, 20, 80.0, "small")
    _check_triton(device, 4, "deepseek", 29, 20, 80.0, "small")
    if opts[2] or len(opts) > 3:
        _check_triton(device, 3, "log", 31, 20, 80.0, "small")
        _check_triton(device, 2, "log", 31, 7, 80.0, "small")
        _check_triton(device, 2, "deepseek", 31, 7, 80.0, "small")


_SM90_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashsinkhorn.mhc import sk_triton
out = {}
for n, n_iters, opts in json.loads(sys.argv[1]):
    _, bwd = sk_triton._small_kernels(n, n_iters, "log", tuple(opts))
    sig = {"p_x": "*fp32", "p_g": "*fp32", "p_out": "*fp32", "n_mat": "i32", "eps": "fp32",
           "BLOCK": "constexpr", "FAST": "constexpr"}
    # fusion pinned as the library's launches pin it (_triton_launch.FP_FUSION); left unset,
    # Triton >= 3.9 warns that its default is about to change
    try:  # older Triton releases key ASTSource's constants differently
        k = triton.compile(ASTSource(bwd, sig, {"BLOCK": 64, "FAST": True}),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 2, "enable_fp_fusion": True})
    except (TypeError, KeyError, AttributeError) as err:
        print(json.dumps({"skip": repr(err)}))
        sys.exit(0)
    assert k.asm["cubin"]
    out[str(n)] = k.asm["ptx"]
print(json.dumps(out))
"""


def _compile_sm90(cases):
    """PTX of generated small backward kernels compiled to sm_90 cubins without a GPU (in a
    fresh process: the interpreter and the compiler do not mix in one). The inline PTX of the
    shared-memory path only runs on the GPU, so this is where CI sees whether the ptxas
    that ships with Triton accepts it."""
    import json
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", _SM90_SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"this Triton's compile API: {out['skip']}")
    return out


@pytest.mark.parametrize("block", [32, 64, 128])
def test_small_backward_shared_memory_fits(block):
    # the looped rounds are capped so that a program's static shared memory stays under 48 KB
    import re

    for n_iters in (11, 20, 40, 100):
        src = sk_codegen.gen_small(4, n_iters, "log", *TUNING.mhc_small_bwd, block=block)
        (size,) = map(int, re.findall(r"fs_sh\[(\d+)\]", src))
        assert 0 < size <= sk_codegen.SH_BYTES_MAX
        assert f"tl.static_assert(BLOCK == {block})" in src


def test_small_kernel_cache_keyed_by_tuning():
    # the generator options in force are part of the kernel cache key
    default = sk_triton._small_kernels(4, 5, "log")
    assert sk_triton._small_kernels(4, 5, "log", TUNING.mhc_small_bwd) is default
    with tuning.override(mhc_small_bwd=(0, True, False)):
        other = sk_triton._small_kernels(4, 5, "log")
        assert other is not default
        assert other is sk_triton._small_kernels(4, 5, "log", (0, True, False))
    assert sk_triton._small_kernels(4, 5, "log") is default


@pytest.mark.slow  # a real sm_90 compile: minutes on a loaded 2-core CPU (up to its 600 s cap)
def test_small_backward_inline_ptx_assembles():
    opts = TUNING.mhc_small_bwd
    ptx = _compile_sm90([(4, 20, opts), (3, 20, opts)])
    # rounds 1..10 looped over per-lane shared memory (20 slots of 16 B per lane)
    assert ".shared .align 16 .b8 fs_sh[20480]" in ptx["4"]
    assert ptx["4"].count("st.volatile.shared.v4.f32") == 2
    assert ptx["4"].count("ld.volatile.shared.v4.f32") == 4  # two rounds per loop iteration
    # n = 3: a v2 and a scalar access per vector
    assert ".shared .align 16 .b8 fs_sh[20480]" in ptx["3"]
    for op, k in (("st.volatile.shared.v2.f32", 2), ("st.volatile.shared.f32", 2)):
        assert ptx["3"].count(op) == k, op
    for op, k in (("ld.volatile.shared.v2.f32", 4), ("ld.volatile.shared.f32", 4)):
        assert ptx["3"].count(op) == k, op


@pytest.mark.parametrize("variant", ["log", "deepseek"])
@pytest.mark.parametrize("n", [4, 5, 8, 16])
def test_triton_general_path(device, n, variant):
    _check_triton(device, n, variant, 3, 4, 4.0, "general")


def test_triton_general_path_large_logits_and_segments(device):
    _check_triton(device, 3, "log", 3, 6, 80.0, "general")
    # fewer on-chip slots than half-steps: the backward recomputes earlier segments
    with tuning.override(mhc_gen_hs_max=4):
        _check_triton(device, 3, "log", 2, 5, 4.0, "general")
        _check_triton(device, 3, "deepseek", 2, 5, 4.0, "general")


def test_triton_through_public_api(device):
    m = _logits((2, 3, 4, 4), seed=21)
    x = m.float().to(device).requires_grad_(True)
    p = sinkhorn_knopp(x, 20, backend="triton")
    g = torch.randn(m.shape, dtype=torch.float64)
    p.backward(g.float().to(device))
    p_ref, dm_ref = _ref_grad(m, g, 20, "log")
    torch.testing.assert_close(p.double().cpu(), p_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(x.grad.double().cpu(), dm_ref, rtol=0, atol=1e-5)
    ph = sinkhorn_knopp(x.detach().to(torch.bfloat16), 20, backend="triton")
    assert ph.dtype == torch.bfloat16
    torch.testing.assert_close(ph.double().cpu(), p_ref, rtol=0, atol=2e-2)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["log", "deepseek"])
def test_gpu_large_batch(variant):
    _check_triton("cuda", 4, variant, 65536 + 7, 20, 80.0, "small")
    _check_triton("cuda", 2, variant, 1000, 20, 5.0, "small")
    _check_triton("cuda", 3, variant, 1000, 20, 5.0, "small")
    for n in (4, 8, 16, 32):
        _check_triton("cuda", n, variant, 999, 20, 5.0, "general")


@pytest.mark.gpu
def test_gpu_auto_backend_and_compile():
    m = _logits((4097, 4, 4), seed=31).float().cuda()
    assert torch.equal(sinkhorn_knopp(m), sinkhorn_knopp(m, backend="triton"))
    x1 = m.clone().requires_grad_(True)
    x2 = m.clone().requires_grad_(True)
    w = torch.randn(4, 4, device="cuda")
    (sinkhorn_knopp(x1) * w).sum().backward()
    f = torch.compile(lambda t: (sinkhorn_knopp(t) * w).sum(), fullgraph=True)
    f(x2).backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-6)
