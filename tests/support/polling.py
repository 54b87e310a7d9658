"""Synchronising tests on conditions, never on sleeps."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``cond`` until it is truthy; False after ``timeout`` seconds (then checked once more)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return bool(cond())


async def wait_until_async(cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """``wait_until`` for coroutines: yields to the event loop between polls."""
    import asyncio

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(interval)
    return bool(cond())


def process_gone(pid: int) -> bool:
    """True once no process has id ``pid`` (for ``wait_until``; a zombie still counts as there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
