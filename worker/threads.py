"""Work handed from a worker's event loop to its threads, waited for without being dropped.

A worker's event loop streams every request's tokens, so what waits for the engine's lock (which
a step holds for as long as it runs) goes to a thread. Cancelling the coroutine that waits for
such work must not drop it: an abort or a registration half done would leak blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TypeVar

T = TypeVar("T")


async def run_to_end(executor: Executor, fn: Callable[[], T]) -> T:
    """Run ``fn`` on ``executor`` and wait for it. Unlike ``asyncio.to_thread``, cancelling the
    waiter never drops ``fn`` while it is still queued: it runs to its end regardless. An executor
    that is shutting down takes no work: ``fn`` then runs here (the ends of requests must run)."""
    try:
        future = executor.submit(fn)
    except RuntimeError:  # shut down: the worker is closing
        return fn()
    return await wait_to_end(future)


async def wait_to_end(future: Future[T]) -> T:
    """Wait for ``future``; cancelling the waiter leaves it running to its end."""
    inner = asyncio.wrap_future(future)
    # A waiter cancelled meanwhile never reads the result: retrieve it so no error is logged twice.
    inner.add_done_callback(lambda f: f.cancelled() or f.exception())
    return await asyncio.shield(inner)
