"""Admission: bounds what the router has in flight, fairly across tenants.

At most ``max_in_flight`` requests run at once, at most ``max_per_tenant`` of one tenant (its
``cache_salt``; requests without one share a tenant). Others wait, each tenant in its own FIFO,
and a freed slot goes to the waiting tenant with the fewest requests running (in turn among
equals), so a client that floods the router delays its own requests, not everyone's. At most
``max_queued`` wait in all, shared fairly too: when they are full, a request of a tenant that
would still have no more waiting than the tenant with the most (at least two fewer now) takes the
place of that tenant's newest waiter, which is refused; otherwise the request is refused at
once (``Overloaded``), and so is one that waited ``queue_timeout_s``. While draining every new
request is refused (``Draining``). Runs on one asyncio event loop.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Overloaded(Exception):
    """No room now: the client should retry later (RESOURCE_EXHAUSTED, HTTP 429)."""


class Draining(Exception):
    """The router is shutting down and takes no new requests (UNAVAILABLE, HTTP 503)."""


class Admission:
    def __init__(self, max_in_flight: int, max_per_tenant: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_in_flight = max_in_flight
        self.max_per_tenant = min(max_per_tenant, max_in_flight)
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.running: Counter[str] = Counter()
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._turns: deque[str] = deque()  # tenants with waiters, in round-robin order
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.refused = 0

    @property
    def in_flight(self) -> int:
        return sum(self.running.values())

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def _can_run(self, tenant: str) -> bool:
        return self.in_flight < self.max_in_flight and self.running[tenant] < self.max_per_tenant

    @asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold a running slot for the body; raises ``Overloaded`` or ``Draining`` instead."""
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release(tenant)

    async def _acquire(self, tenant: str) -> None:
        if self.draining:
            raise Draining("the router is shutting down")
        if self._can_run(tenant) and not self._waiting.get(tenant):
            self._start(tenant)
            return
        if self.queued >= self.max_queued and not self._make_room(tenant):
            self.refused += 1
            raise Overloaded(f"too many requests waiting ({self.queued}); retry later")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant, deque())
        if not queue:
            self._turns.append(tenant)
        queue.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except BaseException as exc:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(tenant)  # the slot was granted as we gave up: hand it on
            else:
                fut.cancel()
                self._forget(tenant, fut)
            if isinstance(exc, asyncio.TimeoutError):
                self.refused += 1
                raise Overloaded(f"waited {self.queue_timeout_s:.0f}s for a slot; retry later") from None
            raise

    def _make_room(self, tenant: str) -> bool:
        """The queue is full: refuse the newest waiter of the tenant with the most waiting if it
        has more than one more than ``tenant`` would (so shares even out, and a tenant never
        pushes out its own); True when a place was freed."""
        if not self._waiting:  # no waiting places at all (max_queued 0)
            return False
        longest = max(self._waiting, key=lambda t: len(self._waiting[t]))
        if len(self._waiting[longest]) <= len(self._waiting.get(tenant, ())) + 1:
            return False
        fut = self._waiting[longest][-1]
        self._forget(longest, fut)
        self.refused += 1
        fut.set_exception(Overloaded(f"too many requests waiting ({self.max_queued}), most of them this "
                                     "tenant's: retry later"))  # fmt: skip
        return True

    def _start(self, tenant: str) -> None:
        self.running[tenant] += 1
        self._idle.clear()

    def _forget(self, tenant: str, fut: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and fut in queue:
            queue.remove(fut)
            if not queue:
                del self._waiting[tenant]
                self._turns.remove(tenant)

    def _release(self, tenant: str) -> None:
        self.running[tenant] -= 1
        if not self.running[tenant]:
            del self.running[tenant]
        self._dispatch()
        if not self.running:
            self._idle.set()

    def _dispatch(self) -> None:
        """Start waiters while there is room: each time the tenant with the fewest running."""
        while self._turns and self.in_flight < self.max_in_flight:
            eligible = [t for t in self._turns if self.running[t] < self.max_per_tenant]
            if not eligible:
                return
            tenant = min(eligible, key=lambda t: self.running[t])  # min() keeps the first of equals
            self._turns.remove(tenant)
            queue = self._waiting[tenant]
            fut = queue.popleft()
            if queue:
                self._turns.append(tenant)  # back of the line among its equals
            else:
                del self._waiting[tenant]
            self._start(tenant)
            fut.set_result(None)

    def drain(self) -> None:
        """Refuse new requests from now on; those running and waiting carry on."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing runs or waits; False after ``timeout_s``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True
