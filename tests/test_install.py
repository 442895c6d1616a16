"""Installing the package prints no warning of ours: an editable build is a plain .pth entry.

setuptools implements an editable install of a flat layout with an import hook and then warns
(pip >= 25 shows it as a BuildBackendWarning on every ``pip install -e .``); the
``package-dir`` mapping of pyproject.toml makes it a .pth entry for the checkout, without a
warning. The build runs here on a copy of pyproject.toml and a stub package (a few seconds).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

_BUILD = """
import json, sys, warnings
from setuptools import build_meta
with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    name = build_meta.build_editable(sys.argv[1])
print(json.dumps({"wheel": name, "warnings": [f"{w.category.__name__}: {w.message}" for w in rec]}))
"""


def test_editable_build_emits_no_warning(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("pyproject.toml needs setuptools >= 77 (its build-system requirement)")
    project = tmp_path / "project"
    (project / "flashsinkhorn").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, project / name)
    (project / "flashsinkhorn" / "__init__.py").write_text("")
    (project / "flashsinkhorn" / "py.typed").write_text("")
    (project / "tests").mkdir()  # another top-level folder, as in the checkout
    (project / "tests" / "__init__.py").write_text("")
    out = tmp_path / "dist"
    out.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", _BUILD, str(out)],
        cwd=project, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["warnings"] == []
    with zipfile.ZipFile(out / got["wheel"]) as whl:
        (pth,) = [n for n in whl.namelist() if n.endswith(".pth")]
        assert whl.read(pth).decode().strip() == str(project.resolve())
