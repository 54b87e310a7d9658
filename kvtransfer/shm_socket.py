"""The Unix socket that hands staged regions (``kvtransfer.shm``) to their pullers: both ends.

Protocol, one exchange per connection: the puller connects to the holder's socket and sends
its ticket (``TICKET_BYTES`` bytes, from the holder's PullShm answer); the holder answers one
status byte, ``0x00`` with the region's memfd attached (SCM_RIGHTS), or ``0x01`` followed by
a reason, and closes. Both ends check the other with SO_PEERCRED: the same effective uid, or
the connection is dropped (holder) / the socket is not used (puller).

Who can connect: the socket lives in a fresh directory of mode 0700 (``private_dir``), so only
the worker's own user (and root) can reach it at all; the ticket then names one staged pull,
once. The server is one thread; each connection gets ``io_timeout_s`` to send its ticket.

A worker that is killed outright leaves its directory behind; the next one to start under the
same base directory removes those of its user whose socket refuses connections (``sweep_stale``).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from pdserve import envs
from pdserve.kvtransfer.shm import TICKET_BYTES, ShmUnavailable, StagedRegion
from pdserve.ratelog import RateLimitFilter

logger = logging.getLogger(__name__)
logger.addFilter(RateLimitFilter())  # connections of another user must not flood the log

SOCKET_NAME = "kv.sock"
DIR_PREFIX = "pdserve-kv-"
_OK, _REFUSED = b"\x00", b"\x01"
_MAX_SUN_PATH = 107  # sockaddr_un.sun_path holds 108 bytes, NUL included
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def private_dir(base: str | None = None) -> str:
    """A fresh directory of mode 0700 for one worker's socket, under ``base`` (None: the user's
    runtime directory when it is theirs and private, else the system's temp directory)."""
    if base is None:
        base = _own_runtime_dir() or tempfile.gettempdir()
    removed = sweep_stale(base)
    if removed:
        logger.info("removed %d socket directories of dead workers under %s", removed, base)
    path = tempfile.mkdtemp(prefix=DIR_PREFIX, dir=base)  # created 0700 with a random name
    if len(os.fsencode(os.path.join(path, SOCKET_NAME + ".new"))) > _MAX_SUN_PATH:
        os.rmdir(path)
        raise OSError(f"socket path under {base!r} is longer than a Unix socket address allows")
    return path


def sweep_stale(base: str) -> int:
    """Remove the socket directories under ``base`` that this user's dead workers left: those whose
    socket refuses connections (nobody listens). A live server's socket always accepts, since it is
    given its name only once it listens. Returns how many were removed."""
    try:
        entries = list(os.scandir(base))
    except OSError:
        return 0
    removed = 0
    for entry in entries:
        if not entry.name.startswith(DIR_PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            path = os.path.join(entry.path, SOCKET_NAME)
            if _refuses(path):
                os.unlink(path)
                os.rmdir(entry.path)
                removed += 1
        except OSError:  # another worker swept it first, or it is not ours to remove
            continue
    return removed


def _refuses(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:  # no socket there (yet), or a live one that is busy
            return False
    return False


def _own_runtime_dir() -> str | None:
    path = envs.runtime_dir()
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    if st is None or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path


def peer_uid(sock: socket.socket) -> int:
    """The effective uid of the process at the other end of a connected Unix socket."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


class FdServer:
    """Hands out regions on ``<directory>/kv.sock``: ``redeem(ticket)`` gives the region a ticket
    names (once) or None. The region's descriptor is closed here as soon as it is sent, or
    refused. ``close()`` stops the thread and removes the socket and ``directory``."""

    def __init__(self, directory: str, redeem: Callable[[bytes], StagedRegion | None],
                 io_timeout_s: float = 1.0) -> None:  # fmt: skip
        self.directory = directory
        self.path = os.path.join(directory, SOCKET_NAME)
        self._redeem = redeem
        self._io_timeout_s = io_timeout_s
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        binding = self.path + ".new"  # named kv.sock only once it listens (see sweep_stale)
        try:
            self._sock.bind(binding)
            os.chmod(binding, 0o600)
            self._sock.listen(64)
            os.rename(binding, self.path)
        except OSError:
            self._sock.close()
            Path(binding).unlink(missing_ok=True)
            raise
        self._thread = threading.Thread(target=self._serve, name="kv-shm-fds", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                logger.exception("accept on %s failed", self.path)
                continue
            with conn:
                if self._closed:
                    return
                try:
                    self._handle(conn)
                except OSError as exc:  # the puller went away mid-exchange: its ticket is spent
                    logger.debug("shm exchange on %s failed: %s", self.path, exc)

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(self._io_timeout_s)
        uid = peer_uid(conn)
        if uid != os.geteuid():
            logger.warning("refused a connection to %s from uid %d", self.path, uid)
            return
        ticket = _recv_exact(conn, TICKET_BYTES)
        region = self._redeem(ticket) if ticket is not None else None
        if region is None:
            conn.sendall(_REFUSED + b"unknown, used or expired ticket")
            return
        try:
            socket.send_fds(conn, [_OK], [region.fd])
        finally:
            region.close()  # the descriptor in flight keeps the memfd alive for the puller

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:  # wake the accept() with a connection of our own
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(self.path)
        except OSError:
            pass
        self._thread.join(5)
        self._sock.close()
        Path(self.path).unlink(missing_ok=True)
        try:
            os.rmdir(self.directory)
        except OSError as exc:
            logger.warning("could not remove %s: %s", self.directory, exc)


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def fetch_region(path: str, ticket: bytes, timeout_s: float) -> int:
    """Redeem ``ticket`` on the holder's socket at ``path``; the received memfd (the caller closes it).

    Raises ``ShmUnavailable``: ``permanent`` when the socket cannot be used at all (missing,
    refused, another user's), else for this ticket alone (refused, expired, connection lost).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(max(timeout_s, 0.001))
    try:
        try:
            sock.connect(path)
        except OSError as exc:
            raise ShmUnavailable(f"cannot connect to {path}: {exc}", permanent=True) from exc
        try:
            uid = peer_uid(sock)
            if uid != os.geteuid():
                raise ShmUnavailable(f"{path} is served by uid {uid}, not this user", permanent=True)
            sock.sendall(ticket)
            msg, fds, flags, _ = socket.recv_fds(sock, 512, 1, socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:
            raise ShmUnavailable(f"exchange on {path} failed: {exc}") from exc
    finally:
        sock.close()
    if msg[:1] == _OK and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
        return fds[0]
    for fd in fds:
        os.close(fd)
    reason = msg[1:].decode(errors="replace") if msg[:1] == _REFUSED else f"malformed answer {msg[:16]!r}"
    raise ShmUnavailable(f"holder refused the ticket: {reason}")
