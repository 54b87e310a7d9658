"""OffloadTier: bounded lower tiers of KV blocks, keyed by block hash, each with its own LRU.

Blocks the device pool evicts are copied into the host-memory tier (``store``, called by the pool as
it evicts, before the block is reused), so a prefix that no longer fits the pool is restored by a
memory copy instead of recomputed. With a disk tier behind it (``spill``), the blocks the host tier
drops for room are written there instead of lost. The engine looks up a new request's prefix in the
pool first and then here (host, then disk), and loads the blocks found here through the
KV-handover API as external KV (``LLMEngine._restore_from_tier``). Every stored block keeps an
xxh3_64 of its bytes, checked when it is loaded: a block whose bytes changed (or could not be read
back) is dropped and reported, never used.

Where the bytes live is a ``SlotStorage`` (``engine/kv_slots.py``): host memory or an unnamed file.

Events (the pool's sink, so Redis sees them): ``BlockStored`` / ``BlockRemoved`` with the tier's
``medium`` (``CPU_TIER``, ``DISK_TIER``) as blocks enter and leave it. They carry hashes only (no
parent, no tokens): the tiers keep bytes, not token ids.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pdserve.engine.config import CacheConfig
from pdserve.engine.kv_slots import FileSlots, HostSlots, SlotStorage, digest
from pdserve.engine.kvcache.events import BlockRemoved, BlockStored, EventSink

logger = logging.getLogger(__name__)


class TierCorruptionError(RuntimeError):
    """A tier block's bytes no longer match the checksum taken when it was stored, or could not be
    read back."""


@dataclass(frozen=True)
class TierStats:
    num_blocks: int
    used_blocks: int
    stored: int  # blocks copied in (lifetime)
    evicted: int  # blocks dropped for room (LRU)
    loaded: int  # blocks copied back into the pool
    corrupted: int  # blocks found changed at load time (dropped)


class OffloadTier:
    """``num_blocks`` slots of ``block_nbytes`` bytes in host memory (``pin_memory`` for CUDA
    engines), or in ``storage``; ``spill``: the tier that takes the blocks this one drops for room
    (a disk tier behind the host tier). Lookups (``__contains__``, ``match``, ``touch``, ``load``)
    see both. Not thread-safe: the engine calls it under its lock."""

    def __init__(self, num_blocks: int, block_nbytes: int, block_size: int, event_sink: EventSink | None = None,
                 pin_memory: bool = False, *, storage: SlotStorage | None = None,
                 spill: OffloadTier | None = None) -> None:  # fmt: skip
        if num_blocks < 1:
            raise ValueError(f"an offload tier needs at least one block, got {num_blocks}")
        self.storage = storage or HostSlots(num_blocks, block_nbytes, pin_memory)
        if (self.storage.num_blocks, self.storage.block_nbytes) != (num_blocks, block_nbytes):
            raise ValueError("the storage's slots do not match the tier's")
        if spill is not None and spill.block_nbytes != block_nbytes:
            raise ValueError(f"a spill tier of {spill.block_nbytes}-byte blocks behind {block_nbytes}-byte ones")
        self.num_blocks = num_blocks
        self.block_nbytes = block_nbytes
        self.block_size = block_size
        self.medium = self.storage.medium
        self.spill = spill
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._checksums = [0] * num_blocks
        self._sink = event_sink
        self._stored = self._evicted = self._loaded = self._corrupted = 0
        self._protected: frozenset[bytes] = frozenset()  # never dropped for room (see ``protected``)

    @property
    def data(self) -> torch.Tensor:
        """The host tier's slots (``[num_blocks, block_nbytes]``)."""
        if not isinstance(self.storage, HostSlots):
            raise AttributeError("only a host tier keeps its blocks in a tensor")
        return self.storage.data

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots or (self.spill is not None and block_hash in self.spill)

    def stats(self) -> TierStats:
        """This tier's own counters (the spill tier has its own)."""
        return TierStats(self.num_blocks, len(self._slots), self._stored, self._evicted, self._loaded,
                         self._corrupted)  # fmt: skip

    @property
    def num_corrupted(self) -> int:
        """Blocks found changed or unreadable at load, in this tier and its spill (lifetime)."""
        return self._corrupted + (self.spill.num_corrupted if self.spill is not None else 0)

    @contextmanager
    def protected(self, block_hashes: Sequence[bytes]) -> Iterator[None]:
        """While inside, ``store`` never drops these blocks for room, here or in ``spill``: a restore
        makes room in the pool first, and the blocks that pool evicts are stored here, which must
        not push out the very blocks being restored. Nests."""
        before = self._protected
        self._protected = before | frozenset(block_hashes)
        try:
            if self.spill is not None:
                with self.spill.protected(block_hashes):
                    yield
            else:
                yield
        finally:
            self._protected = before

    def _victim(self) -> bytes | None:
        """The least recently used block that may be dropped for room; None when all are protected."""
        return next((h for h in self._slots if h not in self._protected), None)

    def store(self, block_hash: bytes, src: torch.Tensor) -> None:
        """Copy one block (``src``: its ``block_nbytes`` bytes, any device) in under ``block_hash``,
        making room by dropping the least recently used block that is not ``protected`` (into
        ``spill`` when there is one); when every block here is protected, ``block_hash`` is not
        kept. A hash already here is only refreshed. Never raises for an I/O failure: the block is
        then not kept (logged)."""
        if src.numel() != self.block_nbytes:
            raise ValueError(f"a tier block is {self.block_nbytes} bytes, got {src.numel()}")
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        gone: list[bytes] = []
        if not self._free:
            old = self._victim()
            if old is None:
                logger.debug("%s: every block is being restored; block %s not kept", self.medium, block_hash.hex())
                return
            slot = self._slots.pop(old)
            try:
                if self.spill is not None:
                    self._spill(old, slot)
            finally:  # whatever the spill did, the slot is free and the block gone from this tier
                self._free.append(slot)
                self._evicted += 1
                gone.append(old)
        slot = self._free.pop()
        try:
            self._checksums[slot] = self.storage.write(slot, src)
        except Exception:  # noqa: BLE001 - an eviction must not fail: the block is just not kept
            self._free.append(slot)
            logger.warning("%s: could not store block %s", self.medium, block_hash.hex(), exc_info=True)
            stored = False
        else:
            self._slots[block_hash] = slot
            self._stored += 1
            stored = True
        if self._sink is not None:
            if gone:
                self._sink(BlockRemoved(gone, self.medium))
            if stored:
                self._sink(BlockStored([block_hash], None, [], self.block_size, None, self.medium))

    def _spill(self, block_hash: bytes, slot: int) -> None:
        """Pass the block in ``slot`` on to the spill tier, if its bytes are intact. Never raises."""
        assert self.spill is not None
        try:
            data = self.storage.read(slot)
            intact = digest(data) == self._checksums[slot]
            if intact:
                self.spill.store(block_hash, data)
        except Exception:  # noqa: BLE001 - as in store: the block is lost, the eviction goes on
            logger.warning("%s: could not spill block %s", self.medium, block_hash.hex(), exc_info=True)
            return
        if not intact:  # a changed block is dropped, not passed on
            self._corrupted += 1
            logger.warning("%s: block %s changed since it was stored; dropped, not spilled", self.medium,
                           block_hash.hex())  # fmt: skip

    def match(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes of ``block_hashes`` are here (in this tier or its spill)."""
        n = 0
        for h in block_hashes:
            if h not in self:
                break
            n += 1
        return n

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        """Mark blocks most recently used (about to be loaded: the evictions that making room for
        them causes take other blocks first)."""
        for h in block_hashes:
            if h in self._slots:
                self._slots.move_to_end(h)
        if self.spill is not None:
            self.spill.touch(block_hashes)

    def load(self, block_hash: bytes, dst: torch.Tensor) -> None:
        """Copy the block stored under ``block_hash`` (here, else in ``spill``) into ``dst`` (a
        block's bytes, any device), after checking its bytes. Raises ``KeyError`` if absent and
        ``TierCorruptionError`` if its bytes changed since ``store`` or cannot be read (the block is
        dropped then; an intact copy in ``spill`` is loaded instead if there is one)."""
        slot = self._slots.get(block_hash)
        if slot is None:
            if self.spill is None:
                raise KeyError(block_hash)
            self.spill.load(block_hash, dst)
            return
        try:
            src = self.storage.read(slot)
            problem = None if digest(src) == self._checksums[slot] else "changed since it was stored"
        except OSError as exc:
            problem = f"could not be read: {exc}"
        if problem is not None:
            self._drop(block_hash)
            self._corrupted += 1
            if self.spill is not None and block_hash in self.spill:  # an intact copy below
                self.spill.load(block_hash, dst)
                return
            raise TierCorruptionError(f"{self.medium} block {block_hash.hex()} {problem}")
        dst.reshape(-1).copy_(src)
        self._slots.move_to_end(block_hash)
        self._loaded += 1

    def _drop(self, block_hash: bytes) -> None:
        self._free.append(self._slots.pop(block_hash))
        if self._sink is not None:
            self._sink(BlockRemoved([block_hash], self.medium))

    def close(self) -> None:
        """Release the storage (a disk tier's file), this tier's and its spill's."""
        self.storage.close()
        if self.spill is not None:
            self.spill.close()

    def check_invariants(self) -> None:
        """Every slot is either free or holds exactly one hash (in this tier and its spill)."""
        used = list(self._slots.values())
        assert len(set(used)) == len(used), "a tier slot holds two hashes"
        assert not set(used) & set(self._free), "a tier slot is both free and used"
        assert len(used) + len(self._free) == self.num_blocks, "a tier slot went missing"
        if self.spill is not None:
            self.spill.check_invariants()


def offload_tiers(cc: CacheConfig, block_nbytes: int, event_sink: EventSink | None, pin_memory: bool) -> OffloadTier:
    """The host tier of ``cc.kv_offload_gb``, with a disk tier of ``cc.kv_offload_disk_gb`` behind it if set.
    ``ValueError`` naming the option when a tier cannot be made (no block fits, the host's memory or
    the disk cannot hold it); nothing is left held then."""
    sizes = {}
    for name in ("kv_offload_gb", "kv_offload_disk_gb"):
        gb = getattr(cc, name)
        sizes[name] = int(gb * 1024**3) // block_nbytes
        if gb > 0 and sizes[name] < 1:
            raise ValueError(f"{name}={gb} holds no block of {block_nbytes} bytes")
    # The host memory first: the disk tier's file is then made only once nothing else can fail.
    try:
        host = HostSlots(sizes["kv_offload_gb"], block_nbytes, pin_memory)
    except ValueError as exc:
        raise ValueError(f"kv_offload_gb={cc.kv_offload_gb}: {exc}; lower kv_offload_gb") from None
    disk = None
    if sizes["kv_offload_disk_gb"]:
        storage = FileSlots(cc.kv_offload_disk_dir, sizes["kv_offload_disk_gb"], block_nbytes)
        disk = OffloadTier(sizes["kv_offload_disk_gb"], block_nbytes, cc.block_size, event_sink, storage=storage)
    return OffloadTier(sizes["kv_offload_gb"], block_nbytes, cc.block_size, event_sink, storage=host, spill=disk)
