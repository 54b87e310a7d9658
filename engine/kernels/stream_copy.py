"""``stream_copy``: a block's bytes into a CPU KV cache with streaming stores (``stream_copy.c``).

The reference is the plain slice assignment ``dest[:] = src`` (a memcpy), which is also what runs
where the library is not built (``PDSERVE_CPU_KERNELS=0``, no C compiler): the bytes written are
the same either way. The C copy writes each destination line without reading it first and runs
with the GIL released (a ctypes call), so a receiving thread neither waits on the cache's reads
nor holds up the process's other threads while it copies.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.engine.kernels import cpu_build

_SOURCE = Path(__file__).with_name("stream_copy.c")
MIN_BYTES = 4096  # below a page, the call's overhead outweighs what streaming saves


@functools.cache
def _copy() -> Any:
    """The C entry point, built and loaded on the first call; None where the library is not built."""
    lib = cpu_build.load(_SOURCE)
    if lib is None:
        return None
    fn = lib.pdserve_stream_copy
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return fn


def available() -> bool:
    """Whether the streaming copy runs here (builds the library on the first call, once per machine)."""
    return _copy() is not None


def stream_copy(dest: memoryview, src: bytes | memoryview) -> None:
    """Copy ``src`` into ``dest``, a writable C-contiguous byte view of the same length.

    Raises ``ValueError`` when the lengths differ or ``dest`` is read-only. ``src`` and ``dest``
    must not overlap. The bytes are the plain copy's (``dest[:] = src``)."""
    n = src.nbytes if isinstance(src, memoryview) else len(src)
    if dest.nbytes != n:
        raise ValueError(f"stream_copy: {n} bytes into a view of {dest.nbytes}")
    if dest.readonly:
        raise ValueError("stream_copy: the destination is read-only")
    fn = _copy() if n >= MIN_BYTES else None
    if fn is None:
        dest[:] = src
        return
    fn(_address(dest), _address(src), n)


def _address(buffer: bytes | memoryview) -> int:
    """The first byte's address of a C-contiguous buffer (numpy reads it without copying)."""
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data
