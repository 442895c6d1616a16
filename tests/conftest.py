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
