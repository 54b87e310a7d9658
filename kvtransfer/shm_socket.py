"""The holder's Unix socket, through which pullers hand it their regions (``kvtransfer.shm``): both ends.

One connection per region: the puller connects, sends ATTACH (``kvtransfer.shm_frames``) with an
attach ticket from the holder's AttachRegion answer and the region's memfd (SCM_RIGHTS), and the
holder answers ATTACHED with the region's id or REFUSED. The connection then stays open as the
region's channel (its pulls' GO, SLOT and ACK frames) until either end closes it, which ends the
region on both. Both ends check the other with SO_PEERCRED: the same effective uid, or the
connection is dropped (holder) / the socket is not used (puller).

Who can connect: the socket lives in a fresh directory of mode 0700 (``private_dir``), so only
the worker's own user (and root) can reach it at all; the ticket then admits one region, once.
The server accepts on one thread and serves each connection on a thread of its own (at most
``max_connections`` at once; more are closed at once).

A worker that is killed outright leaves its directory behind; the next one to start under the
same base directory removes those of its user whose socket refuses connections (``sweep_stale``).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pdserve import envs
from pdserve.kvtransfer.shm import REGION_ID_BYTES, ShmUnavailable
from pdserve.kvtransfer.shm_frames import ATTACH, ATTACHED, REFUSED, encode_attach, recv_frame, send_frame
from pdserve.ratelog import RateLimitFilter

logger = logging.getLogger(__name__)
logger.addFilter(RateLimitFilter())  # connections of another user must not flood the log

SOCKET_NAME = "kv.sock"
DIR_PREFIX = "pdserve-kv-"
NAMING_GRACE_S = 60.0  # a directory still without its socket this long after it was made is a dead worker's
_MAX_SUN_PATH = 107  # sockaddr_un.sun_path holds 108 bytes, NUL included
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def private_dir(base: str | None = None) -> str:
    """A fresh directory of mode 0700 for one worker's socket, under ``base`` (None: the user's
    runtime directory when it is theirs and private, else the system's temp directory)."""
    if base is None:
        base = own_runtime_dir() or tempfile.gettempdir()
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
    socket refuses connections (nobody listens), and those without a socket ``NAMING_GRACE_S`` after
    they were made (a worker that died before it named its socket). A live server's socket always
    accepts, since it is given its name only once it listens, moments after its directory is made.
    Returns how many were removed."""
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
            if os.path.lexists(path):
                stale = _refuses(path)
            else:
                stale = time.time() - entry.stat(follow_symlinks=False).st_mtime > NAMING_GRACE_S
            if stale:
                shutil.rmtree(entry.path)
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


def own_runtime_dir() -> str | None:
    """``$XDG_RUNTIME_DIR`` when it is this user's own and private (no group or other bits); else None."""
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


class RegionServer:
    """Accepts region channels on ``<directory>/kv.sock``: ``serve(conn)`` runs on a thread of its
    own for each connection of this user and owns it (closes it when done). ``close()`` stops
    accepting, shuts every live connection down (their ``serve`` calls see the end of the stream),
    waits for them, and removes the socket and ``directory``."""

    def __init__(self, directory: str, serve: Callable[[socket.socket], None], max_connections: int) -> None:
        self.directory = directory
        self.path = os.path.join(directory, SOCKET_NAME)
        self._serve_one = serve
        self._max_connections = max_connections
        self._lock = threading.Lock()
        self._live: dict[socket.socket, threading.Thread] = {}
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
        self._thread = threading.Thread(target=self._accept_loop, name="kv-shm-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                logger.exception("accept on %s failed", self.path)
                continue
            try:
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                continue
            with self._lock:
                refused = self._closed or uid != os.geteuid() or len(self._live) >= self._max_connections
                if not refused:
                    thread = threading.Thread(target=self._run, args=(conn,), name="kv-shm-region", daemon=True)
                    self._live[conn] = thread
            if refused:
                if uid != os.geteuid():
                    logger.warning("refused a connection to %s from uid %d", self.path, uid)
                conn.close()
                if self._closed:
                    return
                continue
            thread.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self._serve_one(conn)
        except Exception:  # one region's failure must not end the others
            logger.exception("region channel on %s failed", self.path)
        finally:
            with self._lock:
                self._live.pop(conn, None)
            conn.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._live)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = dict(self._live)
        try:  # wake the accept() with a connection of our own
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(1.0)
                s.connect(self.path)
        except OSError:
            pass
        self._thread.join(5)
        self._sock.close()
        for conn, thread in live.items():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed meanwhile
                pass
            thread.join(5)
        Path(self.path).unlink(missing_ok=True)
        try:
            os.rmdir(self.directory)
        except OSError as exc:
            logger.warning("could not remove %s: %s", self.directory, exc)


def attach_region(path: str, ticket: bytes, fd: int, nbytes: int, timeout_s: float) -> tuple[socket.socket, bytes]:
    """Hand region ``fd`` of ``nbytes`` to the holder listening at ``path`` with an attach ticket:
    the region's channel (a connected socket, the caller's) and the id the holder gave the region.
    ``fd`` stays the caller's.

    Raises ``ShmUnavailable``: ``permanent`` when the socket cannot be used at all (missing,
    refused, another user's), else for this region alone (refused, expired, connection lost).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(max(timeout_s, 0.001))
    try:
        try:
            sock.connect(path)
        except OSError as exc:
            raise ShmUnavailable(f"cannot connect to {path}: {exc}", permanent=True) from exc
        uid = peer_uid(sock)
        if uid != os.geteuid():
            raise ShmUnavailable(f"{path} is served by uid {uid}, not this user", permanent=True)
        send_frame(sock, ATTACH, encode_attach(ticket, nbytes), (fd,))
        kind, payload, _ = recv_frame(sock)
    except OSError as exc:  # FrameError (a ConnectionError) included
        sock.close()
        raise ShmUnavailable(f"attaching a region on {path} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    if kind == ATTACHED and len(payload) == REGION_ID_BYTES:
        return sock, payload
    sock.close()
    reason = payload.decode(errors="replace") if kind == REFUSED else f"unexpected frame {kind}"
    raise ShmUnavailable(f"holder refused the region: {reason}")
