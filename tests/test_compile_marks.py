"""The library imports without ``torch._dynamo``, and torch.compile still sees its markers.

``torch.compiler.disable`` and ``assume_constant_result`` import ``torch._dynamo`` (about
3 s on a 2-core CPU) when applied; ``flashsinkhorn._compile_marks`` sets the attributes Dynamo
reads instead and applies the real ``disable`` once Dynamo is loaded. The behaviour under
torch.compile is tested in test_compile.py and tests/mhc/test_layer_ops.py; here: the import,
the attributes against the real decorators, and that Dynamo traces no frame of the library.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashsinkhorn import _compile_marks

ROOT = Path(__file__).resolve().parents[1]

_IMPORT_EVERY_MODULE = """
import sys
import torch
torch.set_num_threads(1)
if "torch._dynamo" in sys.modules:
    print("torch")
    raise SystemExit
import pkgutil
import flashsinkhorn
names = [m.name for m in pkgutil.walk_packages(flashsinkhorn.__path__, "flashsinkhorn.")]
for name in ["flashsinkhorn", *names]:
    try:
        __import__(name)
    except ImportError as e:
        if e.name != "triton":  # the Triton modules on a machine without Triton
            raise
    if "torch._dynamo" in sys.modules:
        print(name)
        raise SystemExit
print(len(names))
"""


def _run(script: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_no_module_of_the_package_imports_dynamo():
    out = _run(_IMPORT_EVERY_MODULE)
    if out == "torch":
        pytest.skip(f"torch {torch.__version__} imports torch._dynamo itself")
    assert out.isdigit() and int(out) > 50, f"importing {out} imported torch._dynamo"


def test_markers_are_those_of_the_real_decorators():
    import torch._dynamo  # noqa: F401  (the real decorators import it anyway)

    def f():
        return 1

    def g():
        return 1

    ours = _compile_marks.disable(f, "why")
    # what Dynamo reads off a function when it traces a call to it (the message only where
    # torch.compiler.disable takes a reason: torch >= 2.7)
    attrs = ("_torchdynamo_disable",)
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        real = torch.compiler.disable(g, reason="why")
        attrs += ("_torchdynamo_disable_msg",)
    else:
        real = torch.compiler.disable(g)
    for attr in attrs:
        assert getattr(ours, attr) == getattr(real, attr)
    assert ours() == 1 and ours.__name__ == "f" and ours.__wrapped__ is f

    def h():
        return 2

    def k():
        return 2

    assert vars(_compile_marks.assume_constant_result(h)) == vars(
        torch.compiler.assume_constant_result(k)
    )


_COMPILE_IN_A_FRESH_PROCESS = """
import sys
import torch
torch.set_num_threads(1)
import flashsinkhorn as fs
assert "torch._dynamo" not in sys.modules
from pathlib import Path

x = torch.randn(17, 3, dtype=torch.float64)
y = torch.randn(13, 3, dtype=torch.float64) + 0.5

def f(x, y):
    z = torch.tanh(x)
    a = fs.ot_cost(z, y, eps=0.1)
    r = fs.sinkhorn(z, y, eps=0.2)
    b = fs.sinkhorn_divergence(z, y, eps=0.1)
    return a + r.value + b + r.apply(y).sum() + r.barycentric_map().sum()

compiled = torch.compile(f, backend="eager")
for _ in range(2):
    torch.testing.assert_close(compiled(x, y), f(x, y), rtol=1e-12, atol=1e-14)
import torch._dynamo.convert_frame as cf
package = str(Path(fs.__file__).parent)
seen = [c() for c in cf.input_codes.seen]
print(sorted({c.co_name for c in seen if c is not None and c.co_filename.startswith(package)}))
"""


def test_dynamo_traces_no_frame_of_the_library():
    # a compiled function breaks its graph at each entry point and runs it eagerly: Dynamo's
    # frame callback must see none of the library's frames (the wrappers included), also
    # when the first compiled call comes before any eager one
    if not hasattr(torch._C, "_dynamo"):
        pytest.skip("this torch has no Dynamo")
    assert _run(_COMPILE_IN_A_FRESH_PROCESS) == "[]"
