"""A puller's staging regions for one holder: ``RegionPool``.

Each region is a memfd the puller makes (``shm.create_region``: its pages allocated once), maps
read-only, and hands to this pool's holder, and to no other, through the holder's Unix socket
(``shm_socket.attach_region``, with a ticket from an authenticated AttachRegion call that
``grant`` makes). The descriptor is closed once it is sent; both processes keep their mapping, and
the connection stays open as the region's channel. So a region only ever holds copies of this one
holder's blocks, which the holder had anyway, and the puller reads only the pieces the holder
announces for its own pull.

Pool contract: ``take`` hands out a region nobody else uses (an idle one whose channel is still
open, else a new one while fewer than ``max_regions`` exist), or None when all are in use (the
caller pulls over gRPC); ``give`` puts it back after a pull that left it intact, ``discard`` ends
one whose state is unknown (a pull failed mid-way). ``trim`` ends the regions idle for ``idle_s``
or longer, so that a holder no longer pulled from does not keep the puller's memory (``take`` trims
too; an idle client needs someone to call it). ``close`` ends the idle regions at once and
the others as they come back; ending a region closes its channel (the holder unmaps it) and
unmaps it here: no descriptor, no mapping stays behind.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from pdserve.kvtransfer.shm import ShmUnavailable, close_mapping, create_region, map_region
from pdserve.kvtransfer.shm_socket import attach_region


class Region:
    """One attached region on the puller: its read-only mapping (``view``) and its channel."""

    def __init__(self, sock: socket.socket, region_id: bytes, mm: mmap.mmap) -> None:
        self.sock = sock
        self.region_id = region_id
        self.nbytes = len(mm)
        self._mm = mm
        self.view = memoryview(mm)
        self.idle_since = 0.0  # on the pool's clock, set by each ``give`` (only idle regions are aged)

    def intact(self) -> bool:
        """The channel is open and quiet: between pulls the holder sends nothing, so anything to
        read (its end of the stream, above all) means the holder has let the region go."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        return not poller.poll(0)

    def close(self) -> None:
        self.sock.close()
        close_mapping(self._mm, self.view)


class RegionPool:
    """Regions of ``region_bytes`` for the holder at ``socket_path`` (module docstring). Thread-safe.

    ``grant(nbytes, deadline)`` asks the holder for an attach ticket (AttachRegion); it raises
    ``ShmUnavailable`` on a refusal, or the call's own errors.
    """

    def __init__(self, socket_path: str, region_bytes: int, max_regions: int,
                 grant: Callable[[int, float], bytes], idle_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.socket_path = socket_path
        self.region_bytes = region_bytes
        self.max_regions = max_regions
        self.idle_s = idle_s
        self._clock = clock
        self._grant = grant
        self._lock = threading.Lock()
        self._idle: list[Region] = []
        self._count = 0  # regions that exist or are being made
        self._closed = False

    def take(self, deadline: float) -> Region | None:
        """A region for one pull, now the caller's until ``give``/``discard``; None when all
        ``max_regions`` are in use. Raises ``ShmUnavailable`` (or ``grant``'s errors) when a new
        one cannot be made; nothing is left behind then."""
        stale: list[Region] = self._expired()
        try:
            with self._lock:
                while self._idle:
                    region = self._idle.pop()
                    if region.intact():
                        return region
                    stale.append(region)
                    self._count -= 1
                if self._closed or self._count >= self.max_regions:
                    return None
                self._count += 1
        finally:
            for region in stale:
                region.close()
        try:
            return self._make(deadline)
        except BaseException:
            with self._lock:
                self._count -= 1
            raise

    def _make(self, deadline: float) -> Region:
        ticket = self._grant(self.region_bytes, deadline)
        try:
            fd = create_region(self.region_bytes)
        except OSError as exc:  # no memory (or descriptors) for it now: this pull goes over gRPC
            raise ShmUnavailable(f"cannot make a region of {self.region_bytes} bytes: {exc}") from exc
        try:
            mm = map_region(fd, self.region_bytes, writable=False)
            try:
                sock, region_id = attach_region(self.socket_path, ticket, fd, self.region_bytes,
                                                deadline - time.monotonic())  # fmt: skip
            except BaseException:
                close_mapping(mm)
                raise
        finally:
            os.close(fd)  # sent (the holder has its own) or not: the mapping is all this side keeps
        return Region(sock, region_id, mm)

    def give(self, region: Region) -> None:
        with self._lock:
            if not self._closed:
                region.idle_since = self._clock()
                self._idle.append(region)
                return
            self._count -= 1
        region.close()

    def discard(self, region: Region) -> None:
        with self._lock:
            self._count -= 1
        region.close()

    def trim(self) -> int:
        """End the regions idle for ``idle_s`` or longer; how many."""
        expired = self._expired()
        for region in expired:
            region.close()
        return len(expired)

    def _expired(self) -> list[Region]:
        """Take the regions idle for ``idle_s`` or longer out of the pool (the caller closes them)."""
        cutoff = self._clock() - self.idle_s
        with self._lock:
            expired = [r for r in self._idle if r.idle_since <= cutoff]
            if expired:
                self._idle = [r for r in self._idle if r.idle_since > cutoff]
                self._count -= len(expired)
        return expired

    @property
    def size(self) -> int:
        """Regions that exist (idle or in use)."""
        with self._lock:
            return self._count

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for region in idle:
            region.close()
