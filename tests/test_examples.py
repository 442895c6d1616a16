"""The example scripts: ``--help`` starts no work, and the CPU-quick modes stay quick.

``--help`` runs in this process (no second torch import), with matplotlib and scikit-learn
made unimportable: the help must not need the optional packages, and must not create its
output folder. The quick runs are marked ``slow`` (``pytest -m slow tests/test_examples.py``:
56 s on a shared 2-core CPU at a load average of 3-5): each must finish within the 2 minutes
the docs promise.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def test_every_example_is_listed_in_the_docs():
    doc = (ROOT / "docs" / "examples.md").read_text()
    assert EXAMPLES and all(f"`{name}`" in doc for name in EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_starts_no_work(name, tmp_path, monkeypatch, capsys):
    for mod in ("matplotlib", "sklearn"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--quick" in out and "--threads" in out
    assert list(tmp_path.iterdir()) == []  # no output folder, no files


QUICK = {
    "convergence.py": ["out/convergence.png", "--quick"],
    "demo.py": ["--quick", "--out", "out/demo.png"],
    "gradient_flow.py": ["out/flow", "--quick"],
    "hvp_accuracy.py": ["--quick"],
    "mhc_transformer.py": ["--quick"],
    "multiscale_stages.py": ["--quick", "--out", "out/ms.png"],
    "otdd.py": ["out/otdd", "--quick"],
    "shuffled_regression.py": ["--quick", "--out", "out/sr"],
    "distributed.py": ["--quick"],
    "flow_matching.py": ["--quick", "--out", "out/fm"],
}
NEEDS = {
    "convergence.py": ["matplotlib"],
    "gradient_flow.py": ["matplotlib"],
    "multiscale_stages.py": ["matplotlib"],
    "otdd.py": ["matplotlib", "sklearn", "tqdm"],
    "flow_matching.py": ["matplotlib"],
}


def test_every_example_has_a_quick_run():
    assert sorted(QUICK) == EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_quick_mode_finishes_within_two_minutes(name, tmp_path):
    for mod in NEEDS.get(name, []):
        pytest.importorskip(mod)
    script = str(ROOT / "examples" / name)
    cmd = [sys.executable, script, *QUICK[name]]
    if name == "distributed.py":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", *cmd[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert elapsed < 120
