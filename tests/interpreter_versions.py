"""Kernel tests that Triton 3.2's interpreter (the lowest supported Triton) cannot run.

Its argmax (torch 2.6, on the CPU) returns wrong column indices that 3.3.1's returns right:
an argmax sweep split over column chunks (backends/triton/sample.py) reads 0 in row 0 of every
chunk after the first, and the label sweep aborts the process. (Its other flaw, a store whose
mask is one false value done as unmasked, the kernels avoid: they branch on such a value.)
"""

import os

import pytest


def _triton_minor() -> tuple[int, int] | None:
    try:
        import triton
    except ImportError:
        return None
    major, minor = triton.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


_TRITON = _triton_minor()

#: Skips a test module's interpreter runs below Triton 3.3 (GPU runs are not affected).
needs_interpreter_3_3 = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" and _TRITON is not None and _TRITON < (3, 3),
    reason="Triton < 3.3: its interpreter's argmax returns wrong column indices (3.3.1's are "
    "right)",
)
