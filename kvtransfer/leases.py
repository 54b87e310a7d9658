"""LeaseTable: the KV of handed-off prefills, held for the decode worker that will pull it.

Pure Python and thread-safe (gRPC handler threads, the reaper thread and the engine all
call in). The table does not touch the blocks: the engine holds them (a ``HeldKV``) until
told otherwise, and the table hands each lease once to the owner's ``on_release`` callback
when it ends (released, expired or closed); the callback lets the engine free them
(``KVHandover.release``).

Contract:
- A lease ends at most once; ``on_release`` runs exactly once per created lease,
  outside the table's lock (so it may take the owner's pool lock without lock-order
  trouble). An exception from it is logged, never propagated into the reaper.
- Pulls are counted: ``acquire`` ... ``end_pull`` (or ``with table.pull(id)``). A lease
  released or expired while pulls of it stream is *dead* (no new pull may acquire it)
  and its blocks are released only when the last of those pulls ends.
- ``acquire`` of an unknown, released or expired lease raises ``LeaseNotFoundError``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.engine.kv_handover import HeldKV
from pdserve.kvtransfer.errors import BlockNotFoundError

logger = logging.getLogger(__name__)


class LeaseNotFoundError(BlockNotFoundError):
    """No live lease has this id (never created, released or expired)."""

    def __init__(self, lease_id: str) -> None:
        super().__init__(f"lease {lease_id!r} not found (unknown, released or expired)", lease_id=lease_id)


@dataclass(frozen=True)
class Lease:
    """One handed-off request's KV (``held``), pullable until ``expires_at``."""

    lease_id: str
    held: HeldKV
    expires_at: float

    @property
    def request_id(self) -> str:
        return self.held.request_id


@dataclass
class _Entry:
    lease: Lease
    active_pulls: int = 0
    pulled: bool = False  # a pull of it began
    dead: bool = False  # released or expired: no new pulls, freed when active_pulls hits 0


class LeaseTable:
    def __init__(
        self,
        on_release: Callable[[Lease], None],
        default_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not default_ttl_s > 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s}")
        self._on_release = on_release
        self._default_ttl_s = default_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._by_request: dict[str, str] = {}  # live request id -> lease id
        self.created = 0  # leases ever created
        self.released_unpulled = 0  # leases released (not expired) before any pull of them began

    # -- lifecycle ------------------------------------------------------------------------
    def create(self, held: HeldKV, ttl_s: float | None = None) -> str:
        """Put ``held`` under a new lease; return its id.

        Raises ``ValueError`` if the request already has a live lease (two leases would free
        its blocks twice) or ``ttl_s`` is not positive.
        """
        ttl = self._default_ttl_s if ttl_s is None else ttl_s
        if not ttl > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl}")
        lease_id = uuid.uuid4().hex
        lease = Lease(lease_id, held, self._clock() + ttl)
        with self._lock:
            if held.request_id in self._by_request:
                raise ValueError(f"request {held.request_id!r} already has lease {self._by_request[held.request_id]!r}")
            self._entries[lease_id] = _Entry(lease)
            self._by_request[held.request_id] = lease_id
            self.created += 1
        return lease_id

    def acquire(self, lease_id: str) -> Lease:
        """Start a pull of the lease; pair with ``end_pull``. Raises ``LeaseNotFoundError``."""
        to_release: list[Lease] = []
        try:
            with self._lock:
                entry = self._entries.get(lease_id)
                if entry is not None and not entry.dead and self._clock() >= entry.lease.expires_at:
                    to_release = self._kill(entry)  # expired but not reaped yet
                if entry is None or entry.dead:
                    raise LeaseNotFoundError(lease_id)
                entry.active_pulls += 1
                entry.pulled = True
                return entry.lease
        finally:
            self._run_callbacks(to_release)

    def end_pull(self, lease_id: str) -> None:
        """End a pull started by ``acquire``; frees a dead lease when its last pull ends."""
        to_release: list[Lease] = []
        with self._lock:
            entry = self._entries.get(lease_id)
            if entry is None or entry.active_pulls <= 0:
                raise RuntimeError(f"end_pull of lease {lease_id!r} without a matching acquire")
            entry.active_pulls -= 1
            if entry.dead and entry.active_pulls == 0:
                to_release = self._pop(entry)
        self._run_callbacks(to_release)

    @contextmanager
    def pull(self, lease_id: str) -> Iterator[Lease]:
        """``with table.pull(id) as lease:`` -- acquire for the duration of the block."""
        lease = self.acquire(lease_id)
        try:
            yield lease
        finally:
            self.end_pull(lease_id)

    def release(self, lease_id: str) -> bool:
        """End the lease (deferred while pulls of it stream). False if it was not live."""
        with self._lock:
            entry = self._entries.get(lease_id)
            if entry is None or entry.dead:
                return False
            self.released_unpulled += not entry.pulled
            to_release = self._kill(entry)
        self._run_callbacks(to_release)
        return True

    def release_request(self, request_id: str) -> bool:
        """``release`` the lease of ``request_id``. True when the table holds its KV: a live lease
        (released now) or one released while pulls of it stream (freed when they end); the caller
        must not free that KV itself."""
        with self._lock:
            lease_id = self._by_request.get(request_id)
            if lease_id is None:
                return False
            entry = self._entries[lease_id]
            if not entry.dead:
                self.released_unpulled += not entry.pulled
            to_release = [] if entry.dead else self._kill(entry)
        self._run_callbacks(to_release)
        return True

    def reap(self, now: float | None = None) -> int:
        """Expire every lease past its deadline; return how many were released now."""
        now = self._clock() if now is None else now
        to_release: list[Lease] = []
        with self._lock:
            for entry in list(self._entries.values()):
                if not entry.dead and now >= entry.lease.expires_at:
                    to_release.extend(self._kill(entry))
        self._run_callbacks(to_release)
        return len(to_release)

    def close(self) -> int:
        """End every lease (those being pulled when their pulls end); return how many were released now."""
        to_release: list[Lease] = []
        with self._lock:
            for entry in list(self._entries.values()):
                if not entry.dead:
                    to_release.extend(self._kill(entry))
        self._run_callbacks(to_release)
        return len(to_release)

    # -- queries --------------------------------------------------------------------------
    def __len__(self) -> int:
        """Live leases (not released, not expired)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if not e.dead)

    def __contains__(self, lease_id: object) -> bool:
        with self._lock:
            entry = self._entries.get(lease_id)  # type: ignore[arg-type]
            return entry is not None and not entry.dead

    def num_holding(self) -> int:
        """Leases still holding blocks: live ones plus dead ones whose pulls are streaming."""
        with self._lock:
            return len(self._entries)

    def active_pulls(self, lease_id: str) -> int:
        with self._lock:
            entry = self._entries.get(lease_id)
            return entry.active_pulls if entry else 0

    # -- internals (call with self._lock held) -------------------------------------------
    def _kill(self, entry: _Entry) -> list[Lease]:
        entry.dead = True
        return self._pop(entry) if entry.active_pulls == 0 else []

    def _pop(self, entry: _Entry) -> list[Lease]:
        del self._entries[entry.lease.lease_id]
        # The request id stays taken until the lease's blocks are handed to its release callback.
        self._by_request.pop(entry.lease.request_id, None)
        return [entry.lease]

    def _run_callbacks(self, leases: list[Lease]) -> None:
        for lease in leases:
            try:
                self._on_release(lease)
            except Exception:
                logger.exception("releasing the blocks of lease %s (request %s) failed", lease.lease_id, lease.request_id)
