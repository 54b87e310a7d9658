"""One-time tickets: ``TicketTable``, what the holder of the same-host transport files things under.

Contract:

- a ticket is ``TICKET_BYTES`` random bytes, good for one redemption within ``ttl_s``: ``take``
  removes it whatever happens next, so a second use, or one after expiry, finds nothing;
- the table owns each entry until ``take`` hands it over; it closes those of expired tickets
  (``reap``, also on the way in ``add``, and ``take`` of an expired one) and all of them at ``close``;
- at most ``max_per_host`` unredeemed entries per peer host (``add`` refuses beyond).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pdserve.kvtransfer.shm import TICKET_BYTES


class _Closeable(Protocol):
    def close(self) -> None: ...


T = TypeVar("T", bound=_Closeable)


@dataclass
class _Entry(Generic[T]):
    item: T
    host: str
    expires_at: float


class TicketTable(Generic[T]):
    """Entries by one-time ticket (module docstring). Thread-safe."""

    def __init__(self, ttl_s: float, max_per_host: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_per_host = max_per_host
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry[T]] = {}

    def add(self, item: T, host: str) -> bytes | None:
        """File ``item`` for a peer on ``host``; its ticket, or None (``item`` is then not taken:
        the caller closes it) when ``host`` already has ``max_per_host`` waiting."""
        self.reap()
        with self._lock:
            if sum(e.host == host for e in self._entries.values()) >= self.max_per_host:
                return None
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._entries[ticket] = _Entry(item, host, self._clock() + self.ttl_s)
            return ticket

    def take(self, ticket: bytes) -> T | None:
        """The item ``ticket`` names, now the caller's; None for an unknown, used or expired one."""
        with self._lock:
            entry = self._entries.pop(ticket, None)
        if entry is None:
            return None
        if entry.expires_at < self._clock():
            entry.item.close()
            return None
        return entry.item

    def reap(self) -> int:
        """Close the items of expired tickets; how many."""
        now = self._clock()
        with self._lock:
            due = [t for t, e in self._entries.items() if e.expires_at < now]
            items = [self._entries.pop(t).item for t in due]
        for item in items:
            item.close()
        return len(items)

    def close(self) -> None:
        with self._lock:
            items, self._entries = [e.item for e in self._entries.values()], {}
        for item in items:
            item.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
