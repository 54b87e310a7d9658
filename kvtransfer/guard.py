"""PullGuard: what one puller can hold on a holder, bounded.

A pull stream holds one server thread while it streams, and a puller that stops reading makes
the holder's next send block. So a holder (1) admits at most ``max_per_peer`` concurrent pulls
from one peer host (the others are refused at once, ``RESOURCE_EXHAUSTED``), and (2) cancels a
stream that has not sent its next chunk within ``stall_timeout_s``, or that runs past
``max_duration_s``; cancelling ends the RPC, which unblocks the send and releases the pull's
pins. A watchdog thread checks the streams a few times per stall period.

Plain Python: the servicer hands in the peer string and a cancel callable (``context.cancel``).
A puller uses the same watchdog for its own streams (``KVTransferClient``: a holder silent for
``holder_silence_s``), with the stream's ``cancel``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: ``ipv4:10.0.0.5:43210`` -> ``10.0.0.5``, ``ipv6:[::1]:5`` -> ``::1``."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    host = address.rpartition(":")[0]
    return host.strip("[]")


@dataclass(eq=False)
class PullTicket:
    """One admitted stream; call ``progress()`` after each chunk is sent, ``close()`` at the end."""

    host: str
    cancel: Callable[[], None]
    started: float
    last_progress: float
    _guard: PullGuard = field(repr=False)
    cancelled: str | None = None  # why the watchdog cancelled it

    def progress(self) -> None:
        self.last_progress = self._guard.clock()

    def close(self) -> None:
        self._guard._release(self)


class PullGuard:
    def __init__(
        self,
        max_per_peer: int,
        stall_timeout_s: float,
        max_duration_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        what: str = "a KV pull to",
    ) -> None:
        self.what = what  # how the log names a cancelled stream, before its peer
        self.max_per_peer = max_per_peer
        self.stall_timeout_s = stall_timeout_s
        self.max_duration_s = max_duration_s
        self.clock = clock
        self._lock = threading.Lock()
        self._active: set[PullTicket] = set()
        self._per_host: Counter[str] = Counter()
        self.refused = 0
        self.cancelled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kv-pull-watchdog", daemon=True)
        self._thread.start()

    def admit(self, peer: str, cancel: Callable[[], None]) -> PullTicket | None:
        """A ticket for a new stream from ``peer``, or None when that host is at its limit."""
        host = peer_host(peer)
        now = self.clock()
        with self._lock:
            if self._per_host[host] >= self.max_per_peer:
                self.refused += 1
                return None
            ticket = PullTicket(host, cancel, now, now, self)
            self._active.add(ticket)
            self._per_host[host] += 1
            return ticket

    def active(self, host: str | None = None) -> int:
        with self._lock:
            return len(self._active) if host is None else self._per_host[host]

    def _release(self, ticket: PullTicket) -> None:
        with self._lock:
            if ticket in self._active:
                self._active.remove(ticket)
                self._per_host[ticket.host] -= 1
                if not self._per_host[ticket.host]:
                    del self._per_host[ticket.host]

    def check(self) -> int:
        """Cancel every stalled or overlong stream now; returns how many were cancelled."""
        now = self.clock()
        with self._lock:
            due = []
            for t in self._active:
                if t.cancelled is not None:
                    continue
                if now - t.last_progress > self.stall_timeout_s:
                    t.cancelled = f"no progress for {now - t.last_progress:.1f}s"
                elif now - t.started > self.max_duration_s:
                    t.cancelled = f"running for {now - t.started:.1f}s"
                else:
                    continue
                due.append(t)
        for t in due:
            logger.warning("cancelling %s %s: %s", self.what, t.host, t.cancelled)
            try:
                t.cancel()
            except Exception:  # noqa: BLE001 - the RPC may have ended meanwhile
                logger.debug("cancel of a finished pull failed", exc_info=True)
        self.cancelled += len(due)
        return len(due)

    def _watch(self) -> None:
        interval = max(0.05, min(self.stall_timeout_s / 4, 1.0))
        while not self._stop.wait(interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one stream
                logger.exception("pull watchdog failed")

    def stop(self) -> None:
        """Tell the watchdog to end, without waiting for it (safe from any thread, a finalizer's too)."""
        self._stop.set()

    def close(self) -> None:
        self.stop()
        self._thread.join(timeout=5)
