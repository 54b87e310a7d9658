"""The holder's side of the same-host transport: tickets for staged regions, and ``ShmExporter``.

A PullShm call (``kvtransfer.server``) stages its blocks (``kvtransfer.shm.stage``) and files the
region here under a fresh random ticket; the puller redeems it on the Unix socket
(``kvtransfer.shm_socket.FdServer``). Contract of ``TicketTable``:

- a ticket is ``TICKET_BYTES`` random bytes, good for one redemption within ``ttl_s``: ``take``
  removes it whatever happens next, so a second use, or one after expiry, finds nothing;
- the table owns each region's descriptor until ``take`` hands it over; it closes those of
  expired tickets (``reap``, also on the way in ``take``/``add``) and all of them at ``close``;
- at most ``max_per_host`` unredeemed regions per peer host (``add`` refuses beyond): a
  puller that never redeems holds at most that much memory, for ``ttl_s``.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.guard import peer_host
from pdserve.kvtransfer.shm import TICKET_BYTES, ShmOffer, StagedRegion, host_id
from pdserve.kvtransfer.shm_socket import FdServer, private_dir

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    region: StagedRegion
    host: str
    expires_at: float


class TicketTable:
    """Staged regions by one-time ticket (module docstring). Thread-safe."""

    def __init__(self, ttl_s: float, max_per_host: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_per_host = max_per_host
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}

    def add(self, region: StagedRegion, host: str) -> bytes | None:
        """File ``region`` for a puller on ``host``; its ticket, or None (the region is then
        not taken: the caller closes it) when ``host`` already has ``max_per_host`` waiting."""
        self.reap()
        with self._lock:
            if sum(e.host == host for e in self._entries.values()) >= self.max_per_host:
                return None
            ticket = secrets.token_bytes(TICKET_BYTES)
            self._entries[ticket] = _Entry(region, host, self._clock() + self.ttl_s)
            return ticket

    def take(self, ticket: bytes) -> StagedRegion | None:
        """The region ``ticket`` names, now the caller's; None for an unknown, used or expired one."""
        with self._lock:
            entry = self._entries.pop(ticket, None)
        if entry is None:
            return None
        if entry.expires_at < self._clock():
            entry.region.close()
            return None
        return entry.region

    def reap(self) -> int:
        """Close the regions of expired tickets; how many."""
        now = self._clock()
        with self._lock:
            due = [t for t, e in self._entries.items() if e.expires_at < now]
            regions = [self._entries.pop(t).region for t in due]
        for r in regions:
            r.close()
        return len(regions)

    def close(self) -> None:
        with self._lock:
            regions, self._entries = [e.region for e in self._entries.values()], {}
        for r in regions:
            r.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class ShmExporter:
    """What a holder needs to serve PullShm: its host id, the ticket table and the socket server
    in a private directory (``private_dir(config.shm_dir)``). Raises ``OSError`` when the socket
    cannot be set up; ``close()`` closes every staged region and removes the directory."""

    def __init__(self, config: TransferConfig) -> None:
        self.host_id = host_id()
        if not self.host_id:
            raise OSError("this kernel's boot id is unreadable: no same-host identity")
        self.tickets = TicketTable(config.shm_ticket_ttl_s, config.max_pulls_per_peer)
        directory = private_dir(config.shm_dir)
        try:
            self.fd_server = FdServer(directory, self.tickets.take)
        except OSError:
            _rmdir_quietly(directory)
            raise

    @property
    def socket_path(self) -> str:
        return self.fd_server.path

    def offer(self, region: StagedRegion, peer: str) -> ShmOffer:
        """File ``region`` for the gRPC ``peer`` and describe it, or refuse (and close it)."""
        ticket = self.tickets.add(region, peer_host(peer))
        if ticket is None:
            region.close()
            return ShmOffer(refused=f"{self.tickets.max_per_host} staged pulls of this peer are waiting already")
        return ShmOffer(
            ticket=ticket,
            ticket_ttl_s=self.tickets.ttl_s,
            region_bytes=region.nbytes,
            block_nbytes=region.block_nbytes,
            total_tokens=region.total_tokens,
            blocks=region.blocks,
        )

    def reap(self) -> int:
        return self.tickets.reap()

    def close(self) -> None:
        self.fd_server.close()
        self.tickets.close()


def _rmdir_quietly(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
