"""Test configuration.

Without a CUDA device the Triton kernels run under the interpreter: TRITON_INTERPRET must be
set before triton decorates any kernel, i.e. before flashsinkhorn is imported.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    # A loss that stops short of its tolerance is a test bug unless the test asks for it
    # (pytest.warns): the suite runs converged solves or fixed iterations (tol=None). Added
    # here, not in pyproject.toml: resolving the class imports flashsinkhorn, which must come
    # after TRITON_INTERPRET is set above.
    config.addinivalue_line("filterwarnings", "error::flashsinkhorn.ConvergenceWarning")
    _check_interpreter_numpy()


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _check_interpreter_numpy():
    # Two pairings of Triton's interpreter and NumPy that cannot run the kernel tests: stop at
    # once with the fix instead of hundreds of failures (or, for the first, wrong numbers).
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton
    except ImportError:
        return
    import numpy as np

    tri, npy = _minor(triton.__version__), _minor(np.__version__)
    if tri < (3, 2) and npy >= (2, 0):
        why, fix = "stores nothing and reads back zeros with NumPy 2", "numpy<2"
    elif tri < (3, 7) and npy >= (2, 4):
        why, fix = "takes int() of 1-element arrays, which NumPy 2.4 refuses", "numpy<2.4"
    else:
        return
    raise pytest.UsageError(
        f"the interpreter of Triton {triton.__version__} {why} (NumPy {np.__version__} is "
        f"installed): install '{fix}' or a newer Triton to run the interpreter tests"
    )


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Device on which the Triton backend runs: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A default process group of one gloo rank for the sharded entry points, removed after."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
