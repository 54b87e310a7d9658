"""WorkerHealth: the workers the router routes around, and how they come back.

A worker whose call failed as unavailable (its actor died, its node is gone, it ended a stream
early) is *down*: the router stops sending it requests at once, instead of making every later
request fail over it first (a dead Ray actor answers each call with an error only after a
reconnect attempt, seconds each). While any worker is down, one probe task pings the down
workers every ``interval_s``; a worker that answers within ``timeout_s`` is up again (a node
that comes back gets its actors restarted by Ray, which re-register and serve again).

Plain asyncio; the router's event loop owns it. ``ping`` is the only dependency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

Ping = Callable[[str], Awaitable[object]]


class WorkerHealth:
    """Down workers and their probe. Must be used from one event loop (the router's)."""

    def __init__(self, ping: Ping, interval_s: float = 1.0, timeout_s: float = 5.0) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("health probe interval and timeout must be > 0")
        self._ping = ping
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._down: dict[str, float] = {}  # worker id -> monotonic time it went down
        self._probe: asyncio.Task[None] | None = None
        self.recoveries = 0  # lifetime count of workers seen up again

    def down(self) -> frozenset[str]:
        """The workers not to route to now."""
        return frozenset(self._down)

    def is_up(self, worker_id: str) -> bool:
        return worker_id not in self._down

    def mark_down(self, worker_id: str, reason: object) -> None:
        """Route around ``worker_id`` until a ping answers. Idempotent; starts the probe if idle."""
        if worker_id not in self._down:
            self._down[worker_id] = time.monotonic()
            logger.warning("worker %s is down (%s); routing around it until it answers", worker_id, reason)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_down(), name="pdserve-worker-probe")

    async def _probe_down(self) -> None:
        while self._down:
            await asyncio.sleep(self.interval_s)
            answered = await asyncio.gather(*(self._answers(w) for w in list(self._down)))
            for w, ok in answered:
                if ok and self._down.pop(w, None) is not None:
                    self.recoveries += 1
                    logger.warning("worker %s answers again; routing to it", w)

    async def _answers(self, worker_id: str) -> tuple[str, bool]:
        try:
            await asyncio.wait_for(self._ping(worker_id), self.timeout_s)
            return worker_id, True
        except Exception:  # noqa: BLE001 - dead, restarting, unreachable or slow: still down
            return worker_id, False

    def close(self) -> None:
        """Stop probing (idempotent)."""
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
