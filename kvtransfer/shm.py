"""The same-host KV transport's regions: one pull's blocks in a sealed memfd (plain Python, no gRPC).

Holder: ``stage`` copies exactly the pinned blocks of one pull, back to back, into a fresh
memfd (anonymous memory with no name in any filesystem), computes each block's ``xxh3_64``
checksum from the holder's own bytes, and seals the memfd against writing, growing and
shrinking: once sealed, nobody (the holder included) can change or truncate it, so the bytes a
puller checks are the bytes it copies, and a mapping of it can never fault past its end.

Puller: ``mapped_chunk`` maps a received memfd read-only, after checking its seals and size, and
presents the blocks as one ``Chunk`` whose pieces are views of the mapping; the caller feeds it
to the same ``BlockReceiver`` as the gRPC stream (checksum before each write, hashes, token
counts, completeness), so both transports land blocks under one set of checks.

``ShmUnavailable`` marks a failure of this transport before any byte reached the destination:
the puller then pulls the same blocks over gRPC.
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdserve import envs
from pdserve.kvtransfer.errors import InvalidPullError
from pdserve.kvtransfer.source import PinnedBlocks
from pdserve.kvtransfer.wire import Chunk, Piece, checksum

MEMFD_NAME = "pdserve-kv-staging"  # how a staged region shows in /proc/<pid>/fd: "/memfd:pdserve-kv-staging"
TICKET_BYTES = 32
# A puller maps a region only under these seals: no writes (the checked bytes stay the copied
# ones), no shrinking (no SIGBUS on a mapped page past a new end), no growing.
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_SEALS = REQUIRED_SEALS | fcntl.F_SEAL_SEAL


class ShmUnavailable(Exception):
    """The shared-memory path cannot carry this pull; nothing was written to the destination.

    ``permanent``: the holder's socket itself is unusable (missing, refused, another user), so
    the puller stops trying it until the holder advertises another one.
    """

    def __init__(self, reason: str, *, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


@functools.cache
def host_id() -> str:
    """``"<boot id>/<euid>"``: equal for two processes of one user on one running kernel (in any
    network namespace); empty where the kernel's boot id cannot be read (no same-host transport).
    ``PDSERVE_HOST_ID`` replaces the boot id: a simulated cluster gives each of its nodes its own,
    so that they are separate hosts to this transport as their namespaces are to the network."""
    if override := envs.host_id():
        return f"{override}/{os.geteuid()}"
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
    return f"{boot}/{os.geteuid()}" if boot else ""


@dataclass(frozen=True)
class ShmBlock:
    """Where one block of a pull lies in its region: ``[offset, offset + block_nbytes)``."""

    index: int  # as Piece.index: the lease's block index, or the position in the hash list
    block_hash: bytes
    num_tokens: int
    offset: int
    checksum: int


@dataclass(frozen=True)
class ShmOffer:
    """A holder's answer to PullShm: ``refused`` (a reason: pull over gRPC instead), or a staged
    region of ``region_bytes`` redeemable once with ``ticket`` on its Unix socket."""

    refused: str = ""
    ticket: bytes = b""
    ticket_ttl_s: float = 0.0
    region_bytes: int = 0
    block_nbytes: int = 0
    total_tokens: int = 0
    blocks: tuple[ShmBlock, ...] = ()


class StagedRegion:
    """A sealed memfd holding one pull's blocks, as the holder keeps it until it is handed over.

    ``close()`` closes the holder's descriptor; idempotent and thread-safe (the socket server
    and the expiry reaper may both reach it). A descriptor already sent lives on in the puller.
    """

    def __init__(self, fd: int, nbytes: int, block_nbytes: int, total_tokens: int,
                 blocks: tuple[ShmBlock, ...]) -> None:  # fmt: skip
        self.fd = fd
        self.nbytes = nbytes
        self.block_nbytes = block_nbytes
        self.total_tokens = total_tokens
        self.blocks = blocks
        self._lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self.fd)


def stage(
    pinned: PinnedBlocks,
    block_nbytes: int,
    read: Callable[[int], memoryview],
    progress: Callable[[], None] = lambda: None,
) -> StagedRegion:
    """Copy the ``pinned`` blocks (``read(block_id)``: one block's bytes) into a new sealed memfd.

    Block ``i`` of the pull lies at ``i * block_nbytes``. ``progress`` is called after each
    block (the stall watchdog's heartbeat). Raises ``OSError`` (no memory, no descriptors, a
    kernel without sealing); the memfd is closed then.
    """
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        nbytes = len(pinned.block_ids) * block_nbytes
        os.ftruncate(fd, nbytes)
        blocks = []
        for pos, block_id in enumerate(pinned.block_ids):
            data = read(block_id)
            offset = pos * block_nbytes
            _pwrite_all(fd, data, offset)
            block = ShmBlock(pinned.indices[pos], pinned.hashes[pos], pinned.num_tokens[pos], offset, checksum(data))
            blocks.append(block)
            progress()
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # no writable mapping exists: pwrite only
    except BaseException:
        os.close(fd)
        raise
    return StagedRegion(fd, nbytes, block_nbytes, pinned.total_tokens, tuple(blocks))


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@contextmanager
def mapped_chunk(fd: int, offer: ShmOffer) -> Iterator[Chunk]:
    """The blocks of ``offer`` in the received region ``fd``, as one ``Chunk`` whose pieces are
    views of a read-only mapping (no copy); unmapped on exit. ``fd`` stays the caller's to close.

    Raises ``ShmUnavailable`` for a region without the required seals or of another size than
    offered (nothing written yet), ``InvalidPullError`` for block places outside it.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise ShmUnavailable(f"received descriptor is not a region: {exc}") from exc
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ShmUnavailable(f"region is not sealed against writes and resizing (seals {seals:#x})")
    if size != offer.region_bytes or size == 0:
        raise ShmUnavailable(f"region holds {size} bytes, {offer.region_bytes} were offered")
    n = offer.block_nbytes
    bad = [b.index for b in offer.blocks if not 0 <= b.offset <= size - n]
    if n <= 0 or bad:
        raise InvalidPullError(f"holder placed blocks {bad[:8]} outside its {size}-byte region of {n}-byte blocks")
    try:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    except OSError as exc:
        raise ShmUnavailable(f"cannot map the region: {exc}") from exc
    view = memoryview(mm)
    pieces = tuple(Piece(b.index, b.block_hash, b.num_tokens, 0, view[b.offset : b.offset + n], b.checksum)
                   for b in offer.blocks)  # fmt: skip
    try:
        yield Chunk(0, len(pieces), offer.total_tokens, n, pieces)
    finally:
        _unmap(mm, view, pieces)


def _unmap(mm: mmap.mmap, view: memoryview, pieces: tuple[Piece, ...]) -> None:
    try:
        for p in pieces:
            p.data.release()  # type: ignore[union-attr]
        view.release()
        mm.close()
    except BufferError:  # a view is still exported (an error's traceback): unmapped when it is collected
        pass
