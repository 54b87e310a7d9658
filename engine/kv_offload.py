"""OffloadTier: a bounded second tier of KV blocks in host memory, keyed by block hash, LRU.

Blocks the device pool evicts are copied here (``store``, called by the pool as it evicts, before
the block is reused), so a prefix that no longer fits the pool is restored by a memory copy
instead of recomputed. The engine looks up a new request's prefix in the pool first and then
here, and loads the blocks found here through the KV-handover API as external KV
(``LLMEngine._restore_from_tier``). Every stored block keeps an xxh3_64 of its bytes, checked
when it is loaded: a block whose bytes changed is dropped and reported, never used.

Events (the pool's sink, so Redis sees them): ``BlockStored`` / ``BlockRemoved`` with
``medium=MEDIUM`` as blocks enter and leave the tier. They carry hashes only (no parent, no
tokens): the tier keeps bytes, not token ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from pdserve.engine.kvcache.events import BlockRemoved, BlockStored, EventSink

MEDIUM = "CPU_TIER"


class TierCorruptionError(RuntimeError):
    """A tier block's bytes no longer match the checksum taken when it was stored."""


@dataclass(frozen=True)
class TierStats:
    num_blocks: int
    used_blocks: int
    stored: int  # blocks copied in (lifetime)
    evicted: int  # blocks dropped for room (LRU)
    loaded: int  # blocks copied back into the pool
    corrupted: int  # blocks found changed at load time (dropped)


def _digest(data: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(data.numpy())


class OffloadTier:
    """``num_blocks`` slots of ``block_nbytes`` bytes. Not thread-safe: the engine calls it under
    its lock. ``pin_memory`` (CUDA engines) makes device-host copies asynchronous-capable and fast."""

    def __init__(self, num_blocks: int, block_nbytes: int, block_size: int, event_sink: EventSink | None = None,
                 pin_memory: bool = False) -> None:  # fmt: skip
        if num_blocks < 1:
            raise ValueError(f"an offload tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_nbytes = block_nbytes
        self.block_size = block_size
        self.data = torch.empty((num_blocks, block_nbytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))
        self._checksums = [0] * num_blocks
        self._sink = event_sink
        self._stored = self._evicted = self._loaded = self._corrupted = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def stats(self) -> TierStats:
        return TierStats(self.num_blocks, len(self._slots), self._stored, self._evicted, self._loaded,
                         self._corrupted)  # fmt: skip

    def store(self, block_hash: bytes, src: torch.Tensor) -> None:
        """Copy one block (``src``: its ``block_nbytes`` bytes, any device) in under ``block_hash``,
        dropping the least recently used block when full. A hash already here is only refreshed."""
        if src.numel() != self.block_nbytes:
            raise ValueError(f"a tier block is {self.block_nbytes} bytes, got {src.numel()}")
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        gone: list[bytes] = []
        if not self._free:
            old, slot = self._slots.popitem(last=False)
            self._free.append(slot)
            self._evicted += 1
            gone.append(old)
        slot = self._free.pop()
        dst = self.data[slot]
        dst.copy_(src.reshape(-1))
        self._checksums[slot] = _digest(dst)
        self._slots[block_hash] = slot
        self._stored += 1
        if self._sink is not None:
            if gone:
                self._sink(BlockRemoved(gone, MEDIUM))
            self._sink(BlockStored([block_hash], None, [], self.block_size, None, MEDIUM))

    def match(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes of ``block_hashes`` are here."""
        n = 0
        for h in block_hashes:
            if h not in self._slots:
                break
            n += 1
        return n

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        """Mark blocks most recently used (about to be loaded: the evictions that making room for
        them causes take other blocks first)."""
        for h in block_hashes:
            if h in self._slots:
                self._slots.move_to_end(h)

    def load(self, block_hash: bytes, dst: torch.Tensor) -> None:
        """Copy the block stored under ``block_hash`` into ``dst`` (a block's bytes, any device),
        after checking its bytes. Raises ``KeyError`` if absent and ``TierCorruptionError`` if its
        bytes changed since ``store`` (the block is dropped then)."""
        slot = self._slots[block_hash]
        src = self.data[slot]
        if _digest(src) != self._checksums[slot]:
            self._drop(block_hash)
            self._corrupted += 1
            raise TierCorruptionError(f"offload-tier block {block_hash.hex()} changed since it was stored")
        dst.reshape(-1).copy_(src)
        self._slots.move_to_end(block_hash)
        self._loaded += 1

    def _drop(self, block_hash: bytes) -> None:
        self._free.append(self._slots.pop(block_hash))
        if self._sink is not None:
            self._sink(BlockRemoved([block_hash], MEDIUM))

    def check_invariants(self) -> None:
        """Every slot is either free or holds exactly one hash."""
        used = list(self._slots.values())
        assert len(set(used)) == len(used), "a tier slot holds two hashes"
        assert not set(used) & set(self._free), "a tier slot is both free and used"
        assert len(used) + len(self._free) == self.num_blocks, "a tier slot went missing"
