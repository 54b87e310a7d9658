"""The same-host KV transport's shared pieces: host identity, the regions, a pull's offer.

A region is a memfd (anonymous memory with no name in any filesystem) that a puller makes, fills
with pages once (``create_region``) and hands to exactly one holder; both map it once and keep it
mapped (``map_region``), and the holder writes the blocks of that puller's pulls into it, slot by
slot (``kvtransfer.shm_ring``). Because the pages exist before the first pull and stay, a pull's
copies run at the speed of a copy into memory already faulted in, not at that of the kernel
allocating and zeroing fresh pages (several times slower on the machines measured).

Seals: a region is sealed against shrinking and growing, and its seals against change, before it
leaves the puller, and both ends refuse to map one that is not: neither end can truncate it under
the other's mapping (a read past a new end would kill the reader with SIGBUS) nor seal it against
the holder's writes. Nobody seals it against writes: the holder writes it for every pull; the ring's
handshake (``kvtransfer.shm_ring``) says which slots it may write when.

``ShmUnavailable`` marks a failure of this transport before any byte reached the destination:
the puller then pulls the same blocks over gRPC.
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve import envs
from pdserve.kvtransfer.config import MAX_REGION_BYTES, MIN_REGION_BYTES

MEMFD_NAME = "pdserve-kv-staging"  # how a region shows in /proc/<pid>/fd and maps: "/memfd:pdserve-kv-staging"
TICKET_BYTES = 32
REGION_ID_BYTES = 16
# Neither end maps a region without these: no shrinking (no SIGBUS on a mapped page past a new end),
# no growing, and no further seals (nobody can later seal it against the holder's writes).
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


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
class RegionBlock:
    """One block of a region pull, in pull order (its bytes come in the slots' pieces)."""

    index: int  # as Piece.index: the lease's block index, or the position in the hash list
    block_hash: bytes
    num_tokens: int


@dataclass(frozen=True)
class PullOffer:
    """A holder's answer to PullRegion: ``refused`` (a reason: pull over gRPC instead), or the
    pull's blocks and the ticket that starts it on the region's channel."""

    refused: str = ""
    ticket: bytes = b""
    ticket_ttl_s: float = 0.0
    block_nbytes: int = 0
    total_tokens: int = 0
    blocks: tuple[RegionBlock, ...] = ()


def create_region(nbytes: int) -> int:
    """A new memfd of ``nbytes`` with every page allocated, sealed (``REQUIRED_SEALS``); the caller
    owns the descriptor. Raises ``OSError`` (no memory, no descriptors, no sealing); nothing is
    left open then."""
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)  # the one time these pages are allocated and zeroed
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_region(fd: int, nbytes: int, *, writable: bool) -> mmap.mmap:
    """Map region ``fd`` shared, its page tables filled at once (MAP_POPULATE), read-only unless
    ``writable``; ``fd`` stays the caller's (it may be closed once mapped).

    Raises ``ShmUnavailable`` for a descriptor that is not a region of ``nbytes`` bytes carrying
    ``REQUIRED_SEALS`` (nothing is mapped then), or one that cannot be mapped.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise ShmUnavailable(f"descriptor is not a region: {exc}") from exc
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ShmUnavailable(f"region is not sealed against resizing and new seals (seals {seals:#x})")
    if size != nbytes or not MIN_REGION_BYTES <= size <= MAX_REGION_BYTES:
        raise ShmUnavailable(f"region holds {size} bytes, {nbytes} were announced")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=prot)
    except OSError as exc:
        raise ShmUnavailable(f"cannot map the region: {exc}") from exc


def close_mapping(mm: mmap.mmap, *views: memoryview) -> None:
    """Release ``views`` of ``mm`` and unmap it; a view still exported elsewhere (an error's
    traceback) leaves the unmapping to the garbage collector."""
    try:
        for v in views:
            v.release()
        mm.close()
    except BufferError:
        pass
