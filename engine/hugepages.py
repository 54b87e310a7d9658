"""Large CPU tensors on 2 MB pages, where Linux's transparent huge pages allow it.

A decode step's attention reads each sequence's K/V where its blocks lie, anywhere in a cache of hundreds
of megabytes: a bfloat16 layer of a block is 12 KB, so on 4 KB pages nearly every block a sequence reads
starts with a TLB miss and a page walk, and the reads behind it wait. On 2 MB pages the same cache is a
few hundred TLB entries. The in-place decode kernel read a 213 MB cache 1.04-1.08x faster on 2 MB pages
(``pdserve bench attention-cpu``'s problem, 30 layers, each cache in turn; docs/performance.md, "The KV
cache on 2 MB pages").

Linux backs an anonymous region with 2 MB pages when the region is 2 MB-aligned and advised so
(``madvise(MADV_HUGEPAGE)``) before its pages are first touched, and the system's setting
(``/sys/kernel/mm/transparent_hugepage/enabled``) is ``always`` or ``madvise``. :func:`zeros` lays a
tensor out that way; elsewhere (another OS, the setting ``never``, no 2 MB page free at the fault) the
same memory is ordinary pages, and the tensor is the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's value on every architecture


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    """libc's ``madvise``, or None off Linux or without it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def advisable() -> bool:
    """Whether this process can ask for huge pages (Linux, libc's ``madvise`` found)."""
    return _madvise() is not None


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, contiguous, its memory starting on a 2 MB boundary and
    advised to huge pages before it is first written (module docstring). Tensors under 2 MB, or where
    ``madvise`` is missing or refuses, are ordinary ``torch.zeros``. The tensor is a view of a buffer up to
    2 MB larger, which it keeps alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    advise = _madvise()
    if nbytes < HUGE_PAGE or advise is None:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # not yet touched: a fresh mapping at this size
    offset = -raw.data_ptr() % HUGE_PAGE
    region = raw[offset : offset + nbytes]
    # Whole 4 KB pages inside the region only: the advice must not reach past the buffer.
    if advise(region.data_ptr(), nbytes // 4096 * 4096, _MADV_HUGEPAGE) != 0:
        return torch.zeros(shape, dtype=dtype)
    return region.zero_().view(dtype).view(shape)
