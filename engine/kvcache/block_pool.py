"""BlockPool: the physical KV blocks of one worker, their ref counts and the prefix cache.

Contract:
- A block is either in the free queue (``ref_cnt == 0``) or held (``ref_cnt > 0``), never both.
- ``cached`` maps a block hash to the one block registered under it; that block's
  ``block_hash`` equals the key. A free cached block stays reusable until it is
  handed out again, at which point it is evicted (lazily) and ``BlockRemoved`` is emitted.
- The pool does no I/O: events go to the sink its owner registered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.kvcache.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink, KVCacheEvent


class BlockPoolError(RuntimeError):
    """A caller broke the pool's contract (double free, foreign hash, over-allocation)."""


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        medium: str = "GPU",
        event_sink: EventSink | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.medium = medium
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(list(self.blocks))
        self.cached: dict[bytes, KVCacheBlock] = {}
        self._sinks: list[EventSink] = [event_sink] if event_sink else []
        self.blocks_stored = 0
        self.blocks_evicted = 0

    # -- events -------------------------------------------------------------------------
    def add_event_sink(self, sink: EventSink) -> None:
        self._sinks.append(sink)

    def _emit(self, event: KVCacheEvent) -> None:
        for sink in self._sinks:
            sink(event)

    # -- queries ------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    # -- allocation ---------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with ``ref_cnt == 1``.

        A taken block that was cached is evicted now (``BlockRemoved``).
        Raises ``BlockPoolError`` if fewer blocks are free; nothing changes then.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self.free_queue):
            raise BlockPoolError(f"asked for {num_blocks} blocks but only {len(self.free_queue)} of {self.num_blocks} are free")
        blocks = self.free_queue.popleft_n(num_blocks)
        evicted: list[bytes] = []
        for block in blocks:
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        if evicted:
            self.blocks_evicted += len(evicted)
            self._emit(BlockRemoved(evicted, self.medium))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free queue.

        Every block must be registered in this pool's cache under its own hash.
        """
        blocks = list(blocks)
        for block in blocks:
            if block.block_hash is None or self.cached.get(block.block_hash) is not block:
                raise BlockPoolError(f"touch of block {block.block_id} whose hash is not cached in this pool")
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in eviction order (first freed is evicted first).

        A block reaching ``ref_cnt == 0`` goes to the back of the free queue if it is
        cached, else to the front. Raises ``BlockPoolError`` on a double free.
        """
        blocks = list(ordered_blocks)
        for block in blocks:
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"double free of block {block.block_id}")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # -- prefix cache -------------------------------------------------------------------
    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        token_ids: Sequence[int],
        lora_name: str | None = None,
    ) -> int:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        ``blocks`` are one request's blocks in order, ``block_hashes`` its full-block hashes
        and ``token_ids`` its tokens. A hash already registered to another block is left
        to that block (the duplicate stays uncached). Emits one ``BlockStored`` for the
        blocks newly registered. Returns how many were registered.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return 0
        if num_full_blocks > len(block_hashes) or num_full_blocks > len(blocks):
            raise BlockPoolError(
                f"cannot cache {num_full_blocks} blocks: {len(block_hashes)} hashes, {len(blocks)} blocks"
            )
        stored: list[bytes] = []
        stored_tokens: list[int] = []
        parent: bytes | None = None
        for i in range(num_cached_blocks, num_full_blocks):
            block, h = blocks[i], block_hashes[i]
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"cannot cache free block {block.block_id}")
            if block.block_hash is not None:
                if block.block_hash != h:
                    raise BlockPoolError(f"block {block.block_id} already cached under another hash")
                continue
            if h in self.cached:
                continue
            if not stored:
                parent = block_hashes[i - 1] if i > 0 else None
            block.block_hash = h
            self.cached[h] = block
            stored.append(h)
            stored_tokens.extend(token_ids[i * block_size : (i + 1) * block_size])
        if stored:
            self.blocks_stored += len(stored)
            self._emit(BlockStored(stored, parent, stored_tokens, block_size, lora_name, self.medium))
        return len(stored)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Forget the hashes of ``blocks`` (their KV turned out invalid); emits one ``BlockRemoved``.

        Blocks that are not cached are skipped. Returns how many were uncached.
        """
        removed: list[bytes] = []
        for block in blocks:
            h = block.block_hash
            if h is not None and self.cached.get(h) is block:
                del self.cached[h]
                block.block_hash = None
                removed.append(h)
        if removed:
            self.blocks_evicted += len(removed)
            self._emit(BlockRemoved(removed, self.medium))
        return len(removed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is held; returns False otherwise."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self._emit(AllBlocksCleared(self.medium))
        return True

    # -- invariants ---------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's internal state is inconsistent."""
        in_queue = list(self.free_queue)
        assert len(in_queue) == len(self.free_queue), "free queue length mismatch"
        ids = {b.block_id for b in in_queue}
        assert len(ids) == len(in_queue), "block twice in the free queue"
        for block in self.blocks:
            free = block.block_id in ids
            assert free == block.in_free_queue, f"block {block.block_id} queue flag wrong"
            assert free == (block.ref_cnt == 0), f"block {block.block_id} ref_cnt={block.ref_cnt} free={free}"
            assert block.ref_cnt >= 0
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not mapped"
        for h, block in self.cached.items():
            assert block.block_hash == h, "cache map points at a block with another hash"
