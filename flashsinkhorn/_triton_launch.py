"""Compile options that every Triton launch of the library passes explicitly.

FMA contraction: Triton 3.9 warns when a kernel is compiled without an explicit
``enable_fp_fusion`` and announces that its default turns off in Triton 3.10. Every kernel here
was tuned (instruction counts, register budgets) and validated with a·b + c contracted to one
FFMA, so the option is pinned rather than left to the installed Triton's default.
``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns it off for debugging.
"""

FP_FUSION = {"enable_fp_fusion": True}
