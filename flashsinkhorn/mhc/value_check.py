"""Logits without a bistochastic projection: the conditions, their messages, and the flags in
which the Triton forward reports them.

Three conditions, checked per matrix: a NaN or +inf entry (exp(M − rowmax M) is NaN), a row of
−inf only and a column of −inf only (a zero row or column of P₀, which no scaling makes
stochastic). Other −inf entries are zeros of P₀ and allowed.

The torch backend computes them with two reductions (:func:`check_logit_values`). The Triton
forward computes them in the projection kernel, from the logits it reads anyway: a kernel with
the check sets byte k of a 4-byte flag (:func:`take_flag`) for condition k and writes nothing
for good logits. The caller waits for the kernel once and reads the flag
(:meth:`Flag.read`), so a checked call costs one synchronisation and no other launch.

On a GPU the flag is pinned host memory that the kernel writes through the unified address
space (a CUDA tensor aliasing it): reading it after the stream synchronisation is a load from
host memory, with no copy launched. Where that alias cannot be made, the flag is device memory
and is read with one copy (which synchronises). A flag is zero when taken; a flag that reported
something is not reused, so no launch ever zeroes one.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["Flag", "check_logit_values", "give_back", "raise_for", "take_flag"]

#: bits of :func:`raise_for` (byte k of a flag is bit 2**k)
NAN_OR_POS_INF, ROW_OF_NEG_INF, COLUMN_OF_NEG_INF = 1, 2, 4


def raise_for(bits: int) -> None:
    """Raises the ValueError of the first condition in ``bits`` (NaN/+inf, then a row of
    −inf, then a column); returns for 0."""
    if bits & NAN_OR_POS_INF:
        raise ValueError(
            "logits must not contain NaN or +inf (-inf entries are allowed: they are zeros of "
            "the matrix); pass check_finite=False to skip this check"
        )
    for bit, what in ((ROW_OF_NEG_INF, "row"), (COLUMN_OF_NEG_INF, "column")):
        if bits & bit:
            raise ValueError(
                f"logits have a {what} of -inf only: a zero {what} cannot be normalised "
                "(no doubly stochastic scaling exists)"
            )


def check_logit_values(logits: torch.Tensor) -> None:
    """Raises for logits (..., n, n) that have no bistochastic projection (torch reductions,
    one device synchronisation); the reference of the Triton forward's check."""
    # A row max is NaN for a NaN in the row (amax propagates it), +inf for a +inf, and -inf
    # for a row of -inf only.
    row_max = logits.amax(-1)
    col_max = logits.amax(-2)
    # The flags as the bits of one integer, read with one item(): under torch.func transforms
    # torch 2.6 reads no tensor with tolist() ("Cannot access data pointer").
    bits = (
        NAN_OR_POS_INF * (torch.isnan(row_max) | (row_max == math.inf)).any()
        + ROW_OF_NEG_INF * (row_max == -math.inf).any()
        + COLUMN_OF_NEG_INF * (col_max == -math.inf).any()
    )
    raise_for(int(bits))


class Flag:
    """Four bytes that a checking kernel sets (``kernel``: the tensor it is given), read on
    the host by :meth:`read`."""

    __slots__ = ("device", "kernel", "_word", "_keep")

    def __init__(self, device: int, kernel: torch.Tensor, word, keep=None):
        self.device = device
        self.kernel = kernel  # int8 (4,): what the kernel writes
        self._word = word  # int32 (1,) NumPy view of the same bytes in host memory, or None
        self._keep = keep  # the pinned tensor behind an alias

    def read(self) -> int:
        """Waits for the work queued on the current stream and returns the bits set."""
        word = self._word
        if word is None:
            w = self.kernel.view(torch.int32).item()  # a copy, which synchronises
        else:
            if self.device >= 0:
                _sync_current_stream(self.device)
            w = int(word[0])
        if not w:
            return 0
        # little-endian bytes of the word: byte k is bit k
        return sum(1 << k for k in range(3) if (w >> (8 * k)) & 0xFF)


# Free flags per device index (-1: CPU, under the Triton interpreter). A call takes one, and
# gives it back when it read zero: concurrent calls (threads, streams) never share a flag, and a
# flag is never zeroed while a kernel may still write it.
_FREE: dict[int, list[Flag]] = {}


def take_flag(x: torch.Tensor) -> Flag:
    """A zeroed flag for a kernel that reads ``x`` (on the current device when ``x`` is a CUDA
    tensor)."""
    device = torch._C._cuda_getDevice() if x.is_cuda else -1
    free = _FREE.get(device)
    if free:
        try:
            return free.pop()
        except IndexError:  # another thread took the last one
            pass
    return _new_flag(device)


def give_back(flag: Flag) -> None:
    """Returns a flag that read zero (its kernel has finished) to the free list."""
    _FREE.setdefault(flag.device, []).append(flag)


class _CudaArray:
    """The CUDA array interface of a pinned host buffer (under unified addressing a pinned
    host pointer is valid in kernels as it is)."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": "|i1",
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def _new_flag(device: int) -> Flag:
    if device < 0:
        t = torch.zeros(4, dtype=torch.int8)
        return Flag(device, t, t.numpy().view(np.int32))
    with torch.cuda.device(device):
        host = torch.zeros(4, dtype=torch.int8, pin_memory=True)
        try:
            alias = torch.as_tensor(_CudaArray(host))
            ok = alias.is_cuda and alias.data_ptr() == host.data_ptr() and alias.dtype == host.dtype
            if ok:
                # once per flag: a kernel's write through the alias must reach the host bytes
                alias.fill_(1)
                _sync_current_stream(device)
                ok = host.tolist() == [1, 1, 1, 1]
                host.zero_()
        except (RuntimeError, TypeError, ValueError):
            ok = False
        if ok:
            return Flag(device, alias, host.numpy().view(np.int32), host)
        return Flag(device, torch.zeros(4, dtype=torch.int8, device="cuda"), None)


# torch.cuda.Stream objects per (device, raw stream): torch.cuda.current_stream() builds a
# new one on every call (≈ 2 µs of host time); the raw handle is a C call.
_STREAMS: dict = {}


def _sync_current_stream(device: int) -> None:
    """Waits for the current stream of ``device`` (the current device: the one the kernel was
    launched on)."""
    key = (device, torch._C._cuda_getCurrentRawStream(device))
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= 256:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.current_stream(device)
    stream.synchronize()
