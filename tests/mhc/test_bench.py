"""The mHC benchmarks' --quick modes run and write their JSON (small shapes, CPU or GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script, out):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # the benchmarks run the Triton kernels on the GPU only (the interpreter is for the tests)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, str(ROOT / "bench" / script), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = out.glob("*.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_bench_mhc_quick(tmp_path):
    res = _run("bench_mhc.py", tmp_path)
    rows = res["rows"]
    assert not [r for r in rows if "error" in r]
    cases = {r["case"].split()[0] for r in rows}
    assert {"proj_fwd", "layer_fwd", "layer_fwd+bwd"} <= cases
    for r in rows:
        assert r["q01"] <= r["ms"] <= r["q99"] and r["reps"] >= 1
    fwd = [r for r in rows if r["case"].startswith("proj_fwd ")]
    assert all("pct_copy_same_bytes" in r and "pct_copy_peak" in r for r in fwd)
    methods = {r["method"] for r in rows if r["case"].startswith("layer_fwd+bwd")}
    assert any(m.startswith("ours, torch.compile") for m in methods)
    assert any(m.startswith("reference, torch.compile") for m in methods)


@pytest.mark.slow
def test_bench_mhc_train_quick(tmp_path):
    res = _run("bench_mhc_train.py", tmp_path)
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"ours-eager", "ours-compiled", "reference-eager", "reference-compiled"}
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows.values())
    # the same model, data and first step for every variant
    losses = [r["first_loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 1e-4
