"""The example scripts: ``--help`` starts no work, and the CPU-quick modes stay quick.

``--help`` runs in this process (no second torch import), with matplotlib and scikit-learn
made unimportable: the help must not need the optional packages, and must not create its
output folder. The quick runs are marked ``slow`` (``pytest -m slow tests/test_examples.py``:
56 s on a shared 2-core CPU at a load average of 3-5): each must finish within the 2 minutes
the docs promise.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import runpy
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

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


#: Packages an example's --help must not import (seconds of start-up on a loaded machine).
HEAVY = ("torch", "flashsinkhorn", "numpy", "scipy", "triton", "matplotlib", "sklearn")


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_returns_before_heavy_imports(name, tmp_path):
    # packages of the same names that refuse to import, ahead of the real ones on the path
    for mod in HEAVY:
        (tmp_path / mod).mkdir()
        (tmp_path / mod / "__init__.py").write_text(f"raise ImportError('{mod} imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), "--help"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name[:-3] + "_example", ROOT / "examples" / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_demo_draws_the_transport_and_the_convergence_curve(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    import flashsinkhorn as fs

    demo = _load("demo.py")
    x, y = demo.clouds(90, torch.device("cpu"))
    res = fs.sinkhorn(x, y, eps=0.1)
    curve = fs.sinkhorn(x, y, eps=0.1, check_every=1)
    fig = demo.draw(str(tmp_path / "d.png"), x, y, res, curve, 0.1, plt)
    left, right = fig.axes[:2]
    (lines,) = [c for c in left.collections if isinstance(c, LineCollection)]
    segs = lines.get_segments()
    assert len(segs) == 90  # every point (fewer than LINES): from x_i to T(x_i)
    T = res.barycentric_map().numpy()
    seen = set()
    for s in segs:
        d2 = ((x.numpy() - s[0]) ** 2).sum(1)
        i = int(np.argmin(d2))
        assert d2[i] < 1e-12 and i not in seen
        seen.add(i)
        np.testing.assert_allclose(s[1], T[i], rtol=1e-5, atol=1e-6)
    # both clouds on the same axis
    assert sum(len(c.get_offsets()) for c in left.collections[:2]) == 180
    (curve_line,) = [ln for ln in right.get_lines() if len(ln.get_xdata()) > 2]
    assert list(curve_line.get_xdata()) == [i for i, _ in curve.errors]
    assert list(curve_line.get_ydata()) == [e for _, e in curve.errors]
    assert (tmp_path / "d.png").stat().st_size > 10_000
    plt.close(fig)


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
    if name == "mhc_transformer.py":  # the quick run shows the loss falling, not batch noise
        first, last = map(float, re.search(r"loss fell from (\S+) to (\S+) ", run.stdout).groups())
        assert last < first - 0.3


@pytest.mark.slow
def test_distributed_spawns_its_own_ranks_without_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "examples" / "distributed.py"), "--quick"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "spawning 2 CPU ranks" in run.stdout and "world 2," in run.stdout
    assert "step 2: S_eps" in run.stdout
