"""Streams: the decode streams a worker runs, by request id, so the router can end one by its id.

The router ends a stream it stopped reading (the client left) by cancelling the stream's Ray task.
Ray can lose that cancel when it arrives while the actor is still starting the task; the stream
then runs to ``max_tokens`` with nobody reading it, holding a running slot and its blocks all the
while. So the router also sends ``drop(request_id)``: the stream's queue gets ``Dropped`` and the
stream ends at its next read (its ``DecodeCall`` aborts the request and settles the lease). A drop
that arrives before its stream opened is kept for ``keep_s`` and ends the stream as it opens.
Request ids are the router's (uuid4), so a kept drop cannot end another client's stream.

Not thread-safe: every call comes from the actor's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

KEEP_S = 60.0  # how long a drop waits for a stream that has not opened
MAX_KEPT = 65536  # drops kept at most (the oldest go first)


class Dropped(Exception):
    """Put in a stream's queue by ``Streams.drop``: the router stopped reading the stream."""


class Streams:
    """The open streams' output queues by request id, and the drops that came before their stream."""

    def __init__(self, keep_s: float = KEEP_S, max_kept: int = MAX_KEPT,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        if keep_s <= 0 or max_kept < 1:
            raise ValueError(f"keep_s ({keep_s}) must be > 0 and max_kept ({max_kept}) >= 1")
        self._keep_s = keep_s
        self._max_kept = max_kept
        self._clock = clock
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._early: OrderedDict[str, float] = OrderedDict()  # request id -> when its drop came

    def open(self, request_id: str) -> asyncio.Queue[Any] | None:
        """A new queue for the stream's outputs, or None when the stream was dropped before it
        opened (it ends at once). The queue is reachable by ``drop`` until ``close``; a second
        stream of an id already open gets a queue no drop reaches (its registration then fails
        as an id in use)."""
        self._forget_old()
        if self._early.pop(request_id, None) is not None:
            return None
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues.setdefault(request_id, queue)
        return queue

    def close(self, request_id: str, queue: asyncio.Queue[Any] | None) -> None:
        """The stream that ``open`` gave ``queue`` ended: drops of its id no longer reach it."""
        if queue is not None and self._queues.get(request_id) is queue:
            del self._queues[request_id]

    def drop(self, request_id: str) -> bool:
        """End the stream of ``request_id``: True when it is open (it ends at its next read),
        False when it is not (kept, it ends as it opens within ``keep_s``)."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(Dropped(request_id))
            return True
        self._forget_old()
        self._early[request_id] = self._clock()
        self._early.move_to_end(request_id)
        while len(self._early) > self._max_kept:
            self._early.popitem(last=False)
        return False

    @property
    def num_open(self) -> int:
        return len(self._queues)

    @property
    def num_kept(self) -> int:
        return len(self._early)

    def _forget_old(self) -> None:
        horizon = self._clock() - self._keep_s
        while self._early and next(iter(self._early.values())) < horizon:
            self._early.popitem(last=False)
