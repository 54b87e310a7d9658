"""Keep the KV wire's chunk buffers resident: glibc malloc settings for a process that streams KV.

Every message of a pull is a fresh buffer of about ``chunk_bytes`` on each end (the holder's
encoded chunk, grpcio's assembled message on the puller). Under glibc's defaults such a buffer
is mmap'ed while it is above the dynamic mmap threshold, and once it is below, freeing it at the
top of a heap (gRPC's threads allocate in their own arenas) hands its pages back to the kernel
whenever the free top exceeds the trim threshold (twice the mmap threshold). The next message
then faults its pages in again and the kernel zeroes them first: page faults and zeroing cost
the puller about a quarter of its CPU per byte (``pdserve bench transfer``, docs/performance.md).
Raising both thresholds above any chunk keeps those buffers in the heap, reused, resident.

The price: up to ``trim_threshold`` bytes of freed memory may stay resident per malloc arena
(glibc makes up to 8 per core; in practice the few threads that stream chunks) instead of going
back to the kernel, and buffers below ``mmap_threshold`` come from the heap. Chunks above
``mmap_threshold`` (``chunk_bytes`` may be up to 1 GiB) are still mmap'ed per message.
Workers call ``tune_malloc`` once at start; ``PDSERVE_MALLOC_TUNING=0`` turns it off.
Elsewhere than glibc it does nothing.

What stays resident is bounded in two ways: the arenas are capped (``ARENA_MAX``; gRPC's many
threads would otherwise each get one, every one keeping up to the trim threshold), and
``HeapTrimmer`` hands free heap memory back (``malloc_trim``) when the worker goes idle, at most
every few seconds, so a burst of long prompts does not leave its peak resident for good.
"""

from __future__ import annotations

import ctypes
import logging
import math
import platform
import time
from collections.abc import Callable

from pdserve import envs

logger = logging.getLogger(__name__)

MiB = 1 << 20
# mallopt parameters (<malloc.h>)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# 32 MiB is the largest mmap threshold every 64-bit glibc accepts (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD = 32 * MiB
TRIM_THRESHOLD = 64 * MiB
ARENA_MAX = 4


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds for this process (all threads, from now on).

    Returns True when both were applied; False where the C library is not glibc, where
    ``PDSERVE_MALLOC_TUNING=0``, or when glibc refused a value (nothing is changed then, or only
    the first). Idempotent.
    """
    if not 0 < mmap_threshold <= trim_threshold:
        raise ValueError(f"need 0 < mmap_threshold <= trim_threshold, got {mmap_threshold}, {trim_threshold}")
    if not envs.malloc_tuning() or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the running process's C library
    except (OSError, AttributeError) as exc:
        logger.debug("no mallopt in this C library: %s", exc)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    if not ok:
        logger.warning("glibc refused mmap_threshold=%d / trim_threshold=%d", mmap_threshold, trim_threshold)
    elif not mallopt(_M_ARENA_MAX, ARENA_MAX):
        logger.warning("glibc refused arena_max=%d", ARENA_MAX)
    return ok


def _malloc_trim() -> Callable[[int], int] | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_size_t,)
    fn.restype = ctypes.c_int
    return fn


class HeapTrimmer:
    """``maybe_trim()``: give free heap memory back to the kernel (glibc's ``malloc_trim(0)``, every
    arena), at most once per ``min_interval_s``. Meant for a worker that just went idle: the
    trim walks the heaps (milliseconds) and the next request faults its pages in again. Does
    nothing where the C library is not glibc. Thread-safe enough: a race trims twice, harmlessly."""

    def __init__(self, min_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._trim = _malloc_trim()
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._last = -math.inf
        self.trims = 0

    def maybe_trim(self) -> bool:
        now = self._clock()
        if self._trim is None or now - self._last < self._min_interval_s:
            return False
        self._last = now
        self._trim(0)
        self.trims += 1
        return True
