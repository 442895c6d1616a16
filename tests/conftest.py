"""Test configuration.

Without a CUDA device the Triton kernels run under the interpreter: TRITON_INTERPRET must be
set before triton decorates any kernel, i.e. before flashsinkhorn is imported. Under
pytest-xdist (`make test`: 2 workers, --dist loadfile) the workers share the cores and the
modules that spawn gloo ranks run on one worker.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _share_cores_between_workers():
    # Under pytest-xdist (`make test` runs 2 workers) each worker process gets its share of the
    # cores as torch intra-op threads: with torch's default (one thread per core) in every
    # worker, 2 workers on 2 cores oversubscribe and the dense torch tests slow down. Set once
    # per worker process; the tests that change the count restore it themselves.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // int(workers)))


_share_cores_between_workers()


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


# The modules that spawn gloo ranks (tests/dist_harness.py), by the start of their path: one job
# of ranks per module, shared by its tests through a module-scoped fixture.
GLOO_MODULES = "tests/test_distributed"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # `make test` runs pytest-xdist with --dist loadfile: a module's tests stay on one worker, so
    # module-scoped fixtures run once. The modules of GLOO_MODULES form one unit on top: their
    # jobs run one after the other, never two jobs' ranks on the cores at once (a rank waits at
    # most dist_harness.TIMEOUT_S in a collective).
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GlooModulesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = super()._split_scope(nodeid)
            return GLOO_MODULES if scope.startswith(GLOO_MODULES) else scope

    return GlooModulesTogether(config, log)


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
