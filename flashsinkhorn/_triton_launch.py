"""Compile options that every Triton launch of the library passes explicitly.

FMA contraction: Triton 3.9 warns when a kernel is compiled without an explicit
``enable_fp_fusion`` and announces that its default turns off in Triton 3.10. Every kernel here
was tuned (instruction counts, register budgets) and validated with a·b + c contracted to one
FFMA, so the option is pinned rather than left to the installed Triton's default.
``TRITON_FORCE_DISABLE_FP_FUSION=1`` still turns it off for debugging.

Also the host-side arithmetic of launch grids (cheaper than Triton's constexpr functions).
"""

import torch

FP_FUSION = {"enable_fp_fusion": True}


# Host-side grid arithmetic. Since Triton 3.5 ``triton.cdiv`` and ``triton.next_power_of_2`` are
# constexpr functions (usable inside kernels); called from the host they go through that
# wrapper at ~5 µs a call, and one solve makes about a hundred of them.


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative a and positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


_SMS: dict[int, int] = {}


def cuda_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, cached (``get_device_properties`` costs
    ~10 µs, and launches plan their grids with it)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SMS.get(idx)
    if sms is None:
        sms = _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return sms
