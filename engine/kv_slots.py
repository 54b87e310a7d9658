"""Where an offload tier keeps its blocks: ``num_blocks`` fixed-size slots in host memory
(``HostSlots``) or in an unnamed file on local disk (``FileSlots``). Slots hold bytes only; which
hash lives in which slot, LRU and events are ``kv_offload.OffloadTier``'s.
"""

from __future__ import annotations

import os
import tempfile
from typing import Protocol

import psutil
import torch
import xxhash

MEDIUM = "CPU_TIER"  # the medium of a host tier's events
DISK_MEDIUM = "DISK_TIER"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 1024**3:.2f} GiB"


def digest(data: torch.Tensor) -> int:
    """xxh3_64 of a host tensor's bytes: the checksum every tier keeps per block."""
    return xxhash.xxh3_64_intdigest(data.numpy())


class SlotStorage(Protocol):
    """``num_blocks`` slots of ``block_nbytes`` bytes."""

    num_blocks: int
    block_nbytes: int
    medium: str

    def write(self, slot: int, src: torch.Tensor) -> int:
        """Store ``src`` (one block's bytes, any device) in ``slot``; return the xxh3_64 of what was stored."""

    def read(self, slot: int) -> torch.Tensor:
        """The bytes of ``slot`` as a host uint8 tensor, valid until the next ``read`` (raises ``OSError``)."""

    def close(self) -> None: ...


def host_memory_available() -> int | None:
    """What the host can give without swapping (``MemAvailable``), in bytes; None where that is not
    known."""
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, AttributeError):
        return None


class HostSlots:
    """Slots in one host tensor (pinned: CUDA copies to and from it are fast). ``ValueError`` with
    the size when the host cannot give that much memory: more than it has available
    (``MemAvailable``, refused before allocating: the kernel may grant it and kill the process
    once the tier fills), or an allocation that fails."""

    medium = MEDIUM

    def __init__(self, num_blocks: int, block_nbytes: int, pin_memory: bool = False) -> None:
        self.num_blocks, self.block_nbytes = num_blocks, block_nbytes
        size = num_blocks * block_nbytes
        available = host_memory_available()
        if available is not None and size > available:
            raise ValueError(f"{_gib(size)} of host memory asked for, the host has {_gib(available)} available "
                             "(MemAvailable)")  # fmt: skip
        try:
            self.data = torch.empty((num_blocks, block_nbytes), dtype=torch.uint8, pin_memory=pin_memory)
        except (RuntimeError, MemoryError) as exc:  # torch's allocator (or pinning) refused it
            why = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"cannot allocate {_gib(size)} of {'pinned ' if pin_memory else ''}host memory: "
                             f"{why}") from None  # fmt: skip

    def write(self, slot: int, src: torch.Tensor) -> int:
        dst = self.data[slot]
        dst.copy_(src.reshape(-1))
        return digest(dst)

    def read(self, slot: int) -> torch.Tensor:
        return self.data[slot]

    def close(self) -> None:
        pass


class FileSlots:
    """Slots in an unnamed temporary file under ``directory``: created owner-only and unlinked at
    once, so no other process can open it by name and nothing is left behind, even after a crash.
    Its space is reserved when it is made where the filesystem supports it (``ValueError`` if the
    disk cannot hold it), so a full disk does not fail writes later on ordinary filesystems
    (copy-on-write ones promise less; a failed write only loses that block). Reads and writes go
    through the page cache. ``directory`` None: the system's temporary directory (often a tmpfs,
    i.e. memory: give a directory on a disk)."""

    medium = DISK_MEDIUM

    def __init__(self, directory: str | None, num_blocks: int, block_nbytes: int) -> None:
        self.num_blocks, self.block_nbytes = num_blocks, block_nbytes
        directory = os.path.expanduser(directory) if directory else tempfile.gettempdir()
        try:
            self._file = tempfile.TemporaryFile(dir=directory, prefix="pdserve-kv-")
        except OSError as exc:
            raise ValueError(f"cannot create the disk tier's file in {directory!r}: {exc}") from None
        self._fd = self._file.fileno()
        size = num_blocks * block_nbytes
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, size)
            else:
                os.ftruncate(self._fd, size)
        except OSError as exc:
            self._file.close()
            raise ValueError(f"cannot reserve {size / 1024**3:.2f} GiB for the disk tier in {directory!r}: {exc}") from None
        self._stage = torch.empty(block_nbytes, dtype=torch.uint8)

    def write(self, slot: int, src: torch.Tensor) -> int:
        self._check_open()
        data = src.reshape(-1).cpu()
        view = memoryview(data.numpy())
        offset, done = slot * self.block_nbytes, 0
        while done < len(view):  # pwrite may write less than asked
            n = os.pwrite(self._fd, view[done:], offset + done)
            if n == 0:
                raise OSError(f"disk tier write of slot {slot} made no progress")
            done += n
        return digest(data)

    def read(self, slot: int) -> torch.Tensor:
        self._check_open()
        view = memoryview(self._stage.numpy())
        offset, done = slot * self.block_nbytes, 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"disk tier file ends inside slot {slot}")
            done += n
        return self._stage

    def _check_open(self) -> None:
        if self._fd < 0:  # a closed descriptor's number may belong to another file by now
            raise OSError("the disk tier's file is closed")

    def close(self) -> None:
        self._fd = -1
        self._file.close()
