"""The mHC layer's torch path works on a machine without Triton (CPU-only installs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoTriton())
    import torch
    import flashsinkhorn as fs

    layer = fs.mhc.HyperConnection(16, 4)
    x = torch.randn(3, 4, 16, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (3, 4, 16) and x.grad is not None and torch.isfinite(x.grad).all()
    h = fs.mhc.sinkhorn_knopp(torch.randn(5, 4, 4), 20, backend="torch")
    assert torch.allclose(h.sum(-1), torch.ones(5, 4), atol=1e-3)
    assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules)
    print("ok")
    """
)


def test_mhc_layer_imports_and_runs_without_triton():
    env_free = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert env_free.returncode == 0, env_free.stderr[-3000:]
    assert env_free.stdout.strip().endswith("ok")
