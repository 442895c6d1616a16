"""Kernel tests that Triton 3.2's interpreter (the lowest supported Triton) cannot run.

Its interpreter stores two kernel outputs wrongly that 3.3.1's stores right (torch 2.6, both
on the CPU): the range flag of the plan kernels (backends/triton/plan.py, plan_self.py) is
set on sums that are in range, so every plan step falls back to the online sweep; and the
column indices of an argmax sweep split over column chunks (backends/triton/sample.py) read
0 in row 0 of every chunk after the first, and the label sweep aborts the process.
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
    reason="Triton < 3.3: its interpreter stores wrong plan-kernel flags and argmax indices "
    "(3.3.1's are right)",
)
