"""flashsinkhorn/_direct_launch.py: launches through a compiled kernel's launcher, with a fake
Triton kernel (the launch bookkeeping is checked on the CPU; tests/mhc/test_host_path.py checks
the real launches on the GPU)."""

from collections import defaultdict
from operator import attrgetter

import pytest
import torch

from flashsinkhorn import _direct_launch as D
from flashsinkhorn import _triton_launch as L

pytestmark = pytest.mark.skipif(D._knobs is None, reason="needs triton.knobs (Triton 3.4+)")

NAMES = ("x", "y", "n", "eps", "BLOCK", "FAST")
CONSTEXPRS = {"BLOCK", "FAST"}
META = {"BLOCK": 64, "FAST": True, "num_warps": 4}
STREAM = 0x5EED


class Param:
    def __init__(self, name):
        self.name, self.is_constexpr = name, name in CONSTEXPRS


class FakeCompiled:
    """A CompiledKernel: ``run`` is the launcher, called with the grid, stream, function handle,
    packed metadata, launch metadata, the two hooks, then every argument."""

    def __init__(self, kernel, spec):
        self.kernel, self.spec = kernel, spec
        self.function = 0xF00 + len(kernel.compiled)
        self.packed_metadata = ("packed", spec)

    @property
    def run(self):
        return self._launch

    def _launch(self, *a):
        self.kernel.direct.append((self, a))
        if self.kernel.launcher_error:
            raise TypeError("launcher takes other arguments")


class FakeKernel:
    """A JITFunction: ``kernel[grid](*args, **meta)`` records a normal launch and returns the
    compiled kernel of the arguments' specialisation (n == 1, n % 16 == 0, tensor dtypes and
    16-byte alignment), as Triton does."""

    def __init__(self, bind_order=None):
        self.params = [Param(n) for n in NAMES]
        self.pre_run_hooks = []
        self.normal, self.direct, self.warmed, self.compiled = [], [], [], {}
        self.launcher_error, self.returns_compiled = False, True
        self.bind_order = bind_order
        self.device_caches = defaultdict(lambda: ({}, {}, None, None, self._bind))

    def _bind(self, *args, **kwargs):
        values = list(args) + [kwargs[n] for n in NAMES[len(args) :]]
        if self.bind_order is not None:
            values = [values[i] for i in self.bind_order]
        options = {k: v for k, v in kwargs.items() if k not in NAMES}
        return dict(zip(NAMES, values, strict=True)), [], options

    def _spec(self, args):
        spec = []
        for a in args:
            if isinstance(a, torch.Tensor):
                spec.append((a.dtype, a.data_ptr() % 16 == 0))
            elif type(a) is int:
                spec.append("1" if a == 1 else a % 16 == 0)
        return tuple(spec)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.normal.append((grid, args, kwargs))
            spec = self._spec(args)
            if spec not in self.compiled:
                self.compiled[spec] = FakeCompiled(self, spec)
            return self.compiled[spec] if self.returns_compiled else None

        return launch

    def warmup(self, *args, grid, **kwargs):
        self.warmed.append((grid, args, kwargs))


@pytest.fixture
def fake_gpu(monkeypatch):
    """CPU tensors stand for device tensors; the current device is ``fake_gpu["device"]`` (0
    unless a test sets it), the current stream of device d is STREAM + d."""
    current = {"device": 0}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(D, "_on_device", attrgetter("is_cpu"))
    monkeypatch.setattr(
        D, "_cuda_queries", lambda: (lambda: current["device"], lambda dev: STREAM + dev)
    )
    return current


def _tensors(dtype=torch.float32):
    return torch.zeros(64, dtype=dtype), torch.zeros(64, dtype=dtype)


def test_first_call_normal_then_direct(fake_gpu):
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    x, y = _tensors()
    dl((3,), x, y, 40, 0.5)
    assert k.normal == [((3,), (x, y, 40, 0.5), META)] and k.direct == []
    dl((3,), x, y, 40, 0.5)
    (compiled,) = k.compiled.values()
    head = (3, 1, 1, STREAM, compiled.function, compiled.packed_metadata, None, None, None)
    assert k.direct == [(compiled, (*head, x, y, 40, 0.5, 64, True))]
    # same signature (40 and 24 are not multiples of 16): direct, with this call's values
    dl((5, 2), y, x, 24, 0.25)
    head = (5, 2, 1, STREAM, compiled.function, compiled.packed_metadata, None, None, None)
    assert k.direct[-1] == (compiled, (*head, y, x, 24, 0.25, 64, True))
    assert len(k.normal) == 1 and dl.enabled


@pytest.mark.parametrize(
    "change",
    ["n == 1", "n % 16 == 0", "misaligned", "dtype", "int for float", "i64", "u64"],
)
def test_new_signature_goes_through_the_normal_path_once(fake_gpu, change):
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    x, y = _tensors()
    n, eps = 40, 0.5
    dl((2,), x, y, n, eps)
    dl((2,), x, y, n, eps)
    assert len(k.normal) == 1 and len(k.direct) == 1
    if change == "n == 1":
        n = 1
    elif change == "n % 16 == 0":
        n = 48
    elif change == "misaligned":
        x = torch.zeros(65)[1:]
        assert x.data_ptr() % 16 != 0
    elif change == "dtype":
        x, y = _tensors(torch.bfloat16)
    elif change == "int for float":
        eps = 0
    elif change == "i64":
        n = 2**40 + 8
    else:
        n = 2**63 + 8
    for _ in range(3):
        dl((2,), x, y, n, eps)
    assert len(k.normal) == 2 and len(k.direct) == 3
    assert k.normal[-1] == ((2,), (x, y, n, eps), META)
    assert k.direct[-1][1][9:13] == (x, y, n, eps)
    # the first signature still launches directly
    dl((2,), *_tensors(), 40, 0.5)
    assert len(k.normal) == 2 and len(k.direct) == 4


def test_each_device_has_its_compiled_kernel(fake_gpu):
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    x, y = _tensors()
    dl((2,), x, y, 40, 0.5)
    dl((2,), x, y, 40, 0.5)
    fake_gpu["device"] = 1
    dl((2,), x, y, 40, 0.5)
    assert (len(k.normal), len(k.direct)) == (2, 1)
    dl((2,), x, y, 40, 0.5)
    assert len(k.normal) == 2 and k.direct[-1][1][3] == STREAM + 1
    fake_gpu["device"] = 0
    dl((2,), x, y, 40, 0.5)
    assert len(k.normal) == 2 and k.direct[-1][1][3] == STREAM


def test_type_error_from_the_launcher_falls_back_for_good(fake_gpu):
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    x, y = _tensors()
    dl((2,), x, y, 40, 0.5)
    k.launcher_error = True
    dl((4,), x, y, 40, 0.5)
    # one direct attempt, then the same launch the normal way: launched once
    assert len(k.direct) == 1 and k.normal[-1] == ((4,), (x, y, 40, 0.5), META)
    assert len(k.normal) == 2 and not dl.enabled
    k.launcher_error = False
    for _ in range(2):
        dl((4,), x, y, 40, 0.5)
    assert len(k.direct) == 1 and len(k.normal) == 4


def test_launch_hooks_and_settings(fake_gpu, monkeypatch):
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    x, y = _tensors()
    dl((2,), x, y, 40, 0.5)
    dl((2,), x, y, 40, 0.5)
    assert (len(k.normal), len(k.direct)) == (1, 1)
    # a launch hook (a profiler's) sees every launch: the normal path while it is installed
    hooks = D._knobs.runtime.launch_enter_hook
    seen = []
    if hasattr(hooks, "add"):
        hooks.add(seen.append)
        try:
            dl((2,), x, y, 40, 0.5)
        finally:
            hooks.remove(seen.append)
        assert (len(k.normal), len(k.direct)) == (2, 1)
    normal, direct = len(k.normal), len(k.direct)
    with monkeypatch.context() as mp:
        mp.setattr(D._knobs.runtime, "launch_exit_hook", seen.append)
        dl((2,), x, y, 40, 0.5)
    assert (len(k.normal), len(k.direct)) == (normal + 1, direct)
    k.pre_run_hooks.append(lambda *a, **kw: None)
    dl((2,), x, y, 40, 0.5)
    assert (len(k.normal), len(k.direct)) == (normal + 2, direct)
    k.pre_run_hooks.clear()
    normal = len(k.normal)
    dl((2,), x, y, 40, 0.5)
    assert len(k.normal) == normal and len(k.direct) == direct + 1 and dl.enabled
    # Triton's debug setting selects another compiled kernel: adopted once more
    with monkeypatch.context() as mp:
        mp.setattr(D._knobs.runtime, "debug", not D._knobs.runtime.debug)
        dl((2,), x, y, 40, 0.5)
        dl((2,), x, y, 40, 0.5)
    assert len(k.normal) == normal + 1


@pytest.mark.parametrize(
    "case", ["cpu tensor", "grid list", "grid callable", "None arg", "tensor subclass"]
)
def test_unsupported_calls_take_the_normal_path(fake_gpu, monkeypatch, case):
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    x, y = _tensors()
    grid = (2,)
    if case == "cpu tensor":
        monkeypatch.setattr(D, "_on_device", attrgetter("is_cuda"))
    elif case == "grid list":
        grid = [2]
    elif case == "grid callable":
        grid = lambda meta: (2,)  # noqa: E731
    elif case == "None arg":
        y = None
    else:
        x = torch.nn.Parameter(x)
    for _ in range(3):
        dl(grid, x, y, 40, 0.5)
    assert len(k.normal) == 3 and k.direct == [] and dl.enabled


def test_unmatched_argument_structure_disables(fake_gpu):
    x, y = _tensors()
    # Triton's binder orders the arguments otherwise than the parameters: never direct
    k = FakeKernel(bind_order=[1, 0, 2, 3, 4, 5])
    dl = D.DirectLaunch(k, **META)
    for _ in range(3):
        dl((2,), x, y, 40, 0.5)
    assert len(k.normal) == 3 and k.direct == [] and not dl.enabled
    # a constexpr passed positionally, a run-time argument in meta, a missing constexpr
    for meta, args in [
        ({"FAST": True}, (x, y, 40, 0.5, 64)),
        ({"eps": 0.5, "BLOCK": 64, "FAST": True}, (x, y, 40)),
        ({"BLOCK": 64}, (x, y, 40, 0.5)),
    ]:
        k = FakeKernel()
        dl = D.DirectLaunch(k, **meta)
        dl((2,), *args)
        dl((2,), *args)
        assert len(k.normal) == 2 and k.direct == [] and not dl.enabled


def test_compiled_kernel_without_a_launcher_disables(fake_gpu):
    # e.g. the interpreter's kernels return nothing
    k = FakeKernel()
    k.returns_compiled = False
    dl = D.DirectLaunch(k, **META)
    x, y = _tensors()
    dl((2,), x, y, 40, 0.5)
    dl((2,), x, y, 40, 0.5)
    assert len(k.normal) == 2 and k.direct == [] and not dl.enabled


def test_interpreter_and_missing_knobs_use_the_normal_path(fake_gpu, monkeypatch):
    x, y = _tensors()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    dl((2,), x, y, 40, 0.5)
    dl((2,), x, y, 40, 0.5)
    assert len(k.normal) == 2 and k.direct == [] and not dl.enabled
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(D, "_knobs", None)
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    dl((2,), x, y, 40, 0.5)
    dl((2,), x, y, 40, 0.5)
    assert len(k.normal) == 2 and k.direct == [] and not dl.enabled


def test_recording_mode_records_the_launch(fake_gpu, monkeypatch):
    monkeypatch.setattr(L, "_PRECOMPILED", set())
    k = FakeKernel()
    dl = D.DirectLaunch(k, **META)
    x, y = _tensors()
    L.precompile_once(("direct",), dl, (2,), x, y, 40, 0.5)
    assert k.warmed == [((2,), (x, y, 40, 0.5), META)]
    assert k.normal == [] and k.direct == []
    dl((2,), x, y, 40, 0.5)
    dl((2,), x, y, 40, 0.5)
    assert (len(k.normal), len(k.direct)) == (1, 1)
