"""Kernel tests that Triton 3.2's interpreter (the lowest supported Triton) cannot run.

Its argmax (torch 2.6, on the CPU) returns wrong column indices that 3.3.1's returns right:
an argmax sweep split over column chunks (backends/triton/sample.py) reads 0 in row 0 of every
chunk after the first, and the label sweep aborts the process. Its other flaw, a store whose
mask is one false value done as unmasked, the plan kernels avoid by branching on the value;
the mHC general path's value check keeps the masked store (the branch form was miscompiled by
Triton 3.6 for sm_90), so its interpreter tests skip there.
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

#: Under an interpreter below Triton 3.3.
OLD_INTERPRETER = (
    os.environ.get("TRITON_INTERPRET") == "1" and _TRITON is not None and _TRITON < (3, 3)
)

#: Skips a test module's interpreter runs below Triton 3.3 (GPU runs are not affected).
needs_interpreter_3_3 = pytest.mark.skipif(
    OLD_INTERPRETER,
    reason="Triton < 3.3: its interpreter's argmax returns wrong column indices (3.3.1's are "
    "right)",
)

#: Why the mHC general path's value-check tests skip under that interpreter.
MASKED_SCALAR_STORE = (
    "Triton < 3.3: its interpreter stores through a false scalar mask (the value check's flag "
    "bytes of the general path); compiled kernels and 3.3.1's interpreter honour it"
)
