"""The holder's side of the same-host transport: ``ShmExporter``, its tickets and attached regions.

A puller's AttachRegion call (``kvtransfer.shm_service``) gets an attach ticket here; the puller hands
the region over on the Unix socket (``kvtransfer.shm_socket``) with it, and the connection stays
the region's channel, served by one thread of ours (``_serve``). A PullRegion call pins the blocks
and files a ``HolderPull`` under a pull ticket; the puller's GO with that ticket on the region's
channel runs it there (``kvtransfer.shm_ring.write_pull``).

Both kinds of ticket live in a ``kvtransfer.shm_tickets.TicketTable``: single use, within
``shm_ticket_ttl_s``; an attach ticket admits one region of the size asked for, a pull ticket one
pull on the region it was filed for.

Regions: one is only ever attached to the holder whose ticket the puller got, through the
connection that handed it over; the holder names it there (``REGION_ID_BYTES`` random bytes), and a
PullRegion names the region by that id (an id this holder did not give out is refused). The pull
itself starts only with a GO on the region's own channel, and a pull ticket filed for one region
is refused on any other. A region carries one pull at a time. When its channel ends (the puller closed it, a pull failed, the
server stops) the holder unmaps the region and forgets its id.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import threading
from dataclasses import dataclass

import numpy as np

from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.shm import REGION_ID_BYTES, TICKET_BYTES, ShmUnavailable, close_mapping, host_id, map_region
from pdserve.kvtransfer.shm_frames import ATTACH, ATTACHED, FAILED, GO, REFUSED, decode_attach, recv_frame, send_frame
from pdserve.kvtransfer.shm_ring import HolderPull, write_pull
from pdserve.kvtransfer.shm_socket import RegionServer, private_dir
from pdserve.kvtransfer.shm_tickets import TicketTable

logger = logging.getLogger(__name__)


@dataclass
class AttachGrant:
    """What an attach ticket admits: one region of ``nbytes``."""

    nbytes: int

    def close(self) -> None:  # holds nothing
        pass


class HolderRegion:
    """A puller's region as this holder maps it (writable), with its channel and reservation."""

    def __init__(self, region_id: bytes, conn: socket.socket, mm: mmap.mmap, nbytes: int) -> None:
        self.region_id = region_id
        self.conn = conn
        self.nbytes = nbytes
        self._mm = mm
        self.array = np.frombuffer(mm, dtype=np.uint8)
        self.pending: HolderPull | None = None  # the pull filed for it, until it ends
        self._lock = threading.Condition()
        self._busy = False
        self._gone = False

    def reserve(self, wait_s: float = 0.0) -> bool:
        """Take the region for one pull, waiting up to ``wait_s`` for the pull that has it to end;
        False when it is still taken then, or once it is gone."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy or self._gone, timeout=wait_s)
            if self._busy or self._gone:
                return False
            self._busy = True
            return True

    def end_pull(self) -> None:
        """The reserved pull ended (``HolderPull.close``): the region is free again."""
        with self._lock:
            self._busy = False
            self.pending = None
            self._lock.notify_all()

    def abort(self) -> None:
        """End the channel (its thread sees the end of the stream and unmaps the region)."""
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def unmap(self) -> None:
        """Forget the region: its pending pull ends, its mapping goes (once)."""
        with self._lock:
            if self._gone:
                return
            self._gone = True
            pending, self.pending = self.pending, None
            self._lock.notify_all()
        if pending is not None:
            pending.close()
        self.array = np.empty(0, dtype=np.uint8)  # drops the export of the mapping
        close_mapping(self._mm)


class ShmExporter:
    """What a holder needs for the same-host transport: its host id, the attach and pull tickets,
    the attached regions, and the socket server in a private directory (``private_dir(config.shm_dir)``).
    Raises ``OSError`` when the socket cannot be set up; ``close()`` ends every region channel and
    removes the directory."""

    def __init__(self, config: TransferConfig) -> None:
        self.host_id = host_id()
        if not self.host_id:
            raise OSError("this kernel's boot id is unreadable: no same-host identity")
        self.config = config
        self.attach_tickets: TicketTable[AttachGrant] = TicketTable(config.shm_ticket_ttl_s, config.max_pulls_per_peer)
        # Pulls are bounded per peer host by the servicer's admission (PullGuard) already.
        self.pull_tickets: TicketTable[HolderPull] = TicketTable(config.shm_ticket_ttl_s, 1 << 30)
        self._lock = threading.Lock()
        self._regions: dict[bytes, HolderRegion] = {}
        directory = private_dir(config.shm_dir)
        try:
            # One connection more than regions: a handshake in progress while the table is full.
            self.server = RegionServer(directory, self._serve, config.shm_max_regions + 1)
        except OSError:
            _rmdir_quietly(directory)
            raise

    @property
    def socket_path(self) -> str:
        return self.server.path

    def __len__(self) -> int:
        """Attached regions."""
        with self._lock:
            return len(self._regions)

    def grant_attach(self, host: str, nbytes: int) -> bytes | None:
        """An attach ticket for a region of ``nbytes`` from a puller on ``host``, or None when this
        holder maps ``shm_max_regions`` regions already, or that host has its limit of tickets waiting."""
        if len(self) + len(self.attach_tickets) >= self.config.shm_max_regions:
            return None
        return self.attach_tickets.add(AttachGrant(nbytes), host)

    def region(self, region_id: bytes) -> HolderRegion | None:
        with self._lock:
            return self._regions.get(region_id)

    def file_pull(self, pull: HolderPull, region: HolderRegion, host: str) -> bytes:
        """File ``pull`` (which reserved ``region``) for the puller's GO; its ticket."""
        region.pending = pull
        ticket = self.pull_tickets.add(pull, host)
        assert ticket is not None  # no per-host bound on this table
        return ticket

    def reap(self) -> int:
        return self.attach_tickets.reap() + self.pull_tickets.reap()

    def close(self) -> None:
        self.server.close()  # every channel's thread unmaps its region on the way out
        self.attach_tickets.close()
        self.pull_tickets.close()

    # -- a region's channel (a thread of the socket server) ---------------------------------
    def _serve(self, conn: socket.socket) -> None:
        region = self._attach(conn)
        if region is None:
            return
        try:
            while self._run_next(conn, region):
                pass
        finally:
            with self._lock:
                self._regions.pop(region.region_id, None)
            region.unmap()

    def _attach(self, conn: socket.socket) -> HolderRegion | None:
        conn.settimeout(self.config.stall_timeout_s)  # the handshake; pulls set their own
        try:
            kind, payload, fds = recv_frame(conn, max_fds=1)
        except OSError as exc:
            logger.debug("region handshake on %s failed: %s", self.socket_path, str(exc))
            return None
        try:
            if kind != ATTACH or len(fds) != 1:
                raise ShmUnavailable(f"expected ATTACH with one descriptor, got frame {kind} with {len(fds)}")
            ticket, nbytes = decode_attach(payload, TICKET_BYTES)
            grant = self.attach_tickets.take(ticket)
            if grant is None:
                raise ShmUnavailable("unknown, used or expired ticket")
            if grant.nbytes != nbytes:
                raise ShmUnavailable(f"the ticket admits a region of {grant.nbytes} bytes, not {nbytes}")
            mm = map_region(fds[0], nbytes, writable=True)
        except (ShmUnavailable, OSError) as exc:
            _send_quietly(conn, REFUSED, str(exc).encode())
            return None
        finally:
            for fd in fds:
                _close_quietly(fd)  # the mapping keeps the memory; no descriptor outlives the handshake
        region = HolderRegion(secrets.token_bytes(REGION_ID_BYTES), conn, mm, nbytes)
        with self._lock:
            self._regions[region.region_id] = region
        try:
            send_frame(conn, ATTACHED, region.region_id)
        except OSError:
            with self._lock:
                self._regions.pop(region.region_id, None)
            region.unmap()
            return None
        return region

    def _run_next(self, conn: socket.socket, region: HolderRegion) -> bool:
        """Wait for the next GO and run its pull; False once the channel is over."""
        conn.settimeout(None)  # an idle region waits for its next pull as long as its puller lives
        try:
            kind, payload, _ = recv_frame(conn)
        except OSError:  # the puller closed the region (or the server stops)
            return False
        pull = self.pull_tickets.take(payload) if kind == GO else None
        if pull is None or pull.region_id != region.region_id or not pull.start(region.abort):
            if pull is not None:
                pull.close()
            _send_quietly(conn, REFUSED, b"unknown, used or expired pull ticket for this region")
            return kind == GO
        try:
            write_pull(conn, region.array, pull, self.config.stall_timeout_s)
            return True
        # The log gets the message, not the exception: a record kept by a handler would keep the
        # exception's frames, and with them views of the region that keep it mapped.
        except OSError as exc:
            logger.info("region pull ended: its channel failed: %s", str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - the holder's own failure: tell the puller, end the region
            logger.warning("region pull failed: %s", str(exc))
            _send_quietly(conn, FAILED, str(exc).encode())
            return False
        finally:
            pull.close()


def _send_quietly(conn: socket.socket, kind: int, payload: bytes) -> None:
    try:
        send_frame(conn, kind, payload)
    except OSError:
        pass


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _rmdir_quietly(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass
