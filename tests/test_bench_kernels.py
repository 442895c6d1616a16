"""bench/bench_kernels.py: the work counts and floors of the streaming kernels (CPU, no
kernel launched), and, marked slow, its quick mode end to end under the interpreter."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "bench" / "bench_kernels.py"


def _bench():
    spec = importlib.util.spec_from_file_location("_bench_kernels", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


BK = _bench()

#: round numbers, so that the floors can be checked by hand
RATES = {"copy": 1e12, "exp2": 1e12, "f16": 4e14, "tf32": 2e14, "ieee": 5e13}


def test_softmin_counts_and_floor_by_hand():
    # n = m = 1000, d = 64, "tf32": 1e6 scores, 1e6 exp2, 2·1e6·64 = 1.28e8 float16 flops;
    # bytes: float16 operands 2·1000·128 B, norms/weights/potentials (2n + 3m)·4, output n·4
    w = BK.count("softmin", 1000, 1000, 64, "tf32")
    assert (w.scores, w.exp2) == (1e6, 1e6)
    assert w.products == {"f16": 1.28e8}
    assert w.bytes == 256_000 + 20_000 + 4_000
    fl = BK.floor(w, RATES)
    assert fl["exp2_s"] == pytest.approx(1e-6)
    assert fl["products_s"] == pytest.approx(3.2e-7)
    assert fl["bytes_s"] == pytest.approx(2.8e-7)
    assert fl["floor_s"] == pytest.approx(1e-6) and fl["bound"] == "exp2"
    # d = 128 at "tf32x3": three float16 products per score, 7.68e8 flops -> 1.92 µs, binds
    fl = BK.floor(BK.count("softmin", 1000, 1000, 128, "tf32x3"), RATES)
    assert fl["products_s"] == pytest.approx(1.92e-6) and fl["bound"] == "products"


def test_products_and_exp2_per_kernel():
    n, d, nm = 100, 8, 1e4
    dot = 2 * nm * d
    c = lambda k, **kw: BK.count(k, n, n, d, "tf32", **kw)  # noqa: E731
    # the online-LSE symmetric step and the pair step form every score twice, the plan step once
    assert c("symmetric_lse").exp2 == c("pair_step").exp2 == 2 * c("plan_step").exp2 == 2 * nm
    # the alternating schedule's two half-steps: one score and one exp2 per pair each
    assert c("softmin") == c("plan_half") and c("plan_half").exp2 == nm
    assert c("symmetric_lse").products == {"f16": 2 * dot}
    assert c("self_triangle").exp2 == n * (n + 1) / 2
    # P V of width d: a TF32 value dot next to the float16 score dot
    assert c("transport_pv").products == {"f16": dot, "tf32": dot}
    assert c("transport_marginal").products == {"f16": dot}
    assert c("transport_grad").products == {"f16": 2 * dot}
    assert c("transport_grad", fp16_grad=False).products == {"f16": dot, "tf32": dot}
    assert c("hvp_schur").products == {"f16": 2 * dot, "ieee": 4 * nm}
    assert c("hvp_hadamard").products == {"f16": dot, "tf32": 2 * nm * 2 * d + dot}
    assert BK.count("plan_step", n, n, d, "ieee").products == {"ieee": dot}
    sp = {"pairs": 10, "tile": 64, "rows": 640, "cols": 1280}
    w = BK.count("sparse_shift", 640, 1280, 3, sparse=sp)
    assert w.exp2 == 10 * 64 * 64 and w.products == {"ieee": 6 * 10 * 64 * 64}
    assert w.bytes - BK.count("sparse_exact", 640, 1280, 3, sparse=sp).bytes == 640 * 4


def test_every_kernel_of_the_list_has_a_row():
    # softmin half-step, fused symmetric step, pair step, self triangle, transport and
    # envelope gradient, HVP operators, block-sparse multiscale soft-min
    listed = {"softmin", "plan_half", "symmetric_lse", "plan_step", "pair_step", "self_triangle",
              "transport_pv", "transport_marginal", "transport_grad", "hvp_schur",
              "hvp_hadamard", "sparse_shift"}  # fmt: skip
    assert listed <= set(BK.KERNELS)
    sp = {"pairs": 1, "tile": 64, "rows": 64, "cols": 64}
    for k in BK.KERNELS:
        w = BK.count(k, 64, 64, 3, sparse=sp)
        fl = BK.floor(w, RATES)
        assert fl["floor_s"] > 0 and fl["bound"] in ("products", "exp2", "bytes")
    with pytest.raises(ValueError, match="kernel"):
        BK.count("nope", 1, 1, 1)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the quick mode runs on the CPU")
def test_quick_mode_writes_a_row_per_kernel_and_shape(tmp_path):
    res = BK.main(["--quick", "--out", str(tmp_path), "--sizes", "64", "--dims", "3",
                   "--sparse-sizes", "1000", "--reps", "1"])  # fmt: skip
    rows = json.loads((tmp_path / "kernels_cpu_quick.json").read_text())["rows"]
    assert [r["kernel"] for r in rows] == list(BK.KERNELS) == [r["kernel"] for r in res["rows"]]
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 for r in rows)
