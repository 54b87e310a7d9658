"""BlockPool: the physical KV blocks of one worker, their ref counts and the prefix cache.

Contract:
- A block is either in the free queue (``ref_cnt == 0``) or held (``ref_cnt > 0``), never both.
- The prefix cache maps a block hash to the blocks registered under it. Two live requests that
  computed the same block each register their copy (as vLLM does: a block table never changes,
  so a duplicate is not merged away); a lookup returns the oldest copy, and a hash stays cached
  until its last copy is evicted. A free cached block stays reusable until it is handed out
  again, at which point it is evicted (lazily).
- Events describe hashes, not copies: ``BlockStored`` when a hash becomes cached,
  ``BlockRemoved`` when its last copy leaves. So an index built from them says exactly which
  hashes this pool can serve.
- The null block (``null_block``) stands in a request's block list for a block that slid out
  of every sliding window; it is not part of the pool and every method here skips it.
- The pool does no I/O: events go to the sinks its owner registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pdserve.engine.kvcache.block import NULL_BLOCK_ID, FreeKVCacheBlockQueue, KVCacheBlock
from pdserve.engine.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink, KVCacheEvent


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
        self.null_block = KVCacheBlock(NULL_BLOCK_ID)
        self.free_queue = FreeKVCacheBlockQueue(list(self.blocks))
        # hash -> {block_id: block}, oldest copy first (dicts keep insertion order).
        self._cached: dict[bytes, dict[int, KVCacheBlock]] = {}
        self._sinks: list[EventSink] = [event_sink] if event_sink else []
        # Called with (block_id, hash) as a cached block is evicted (its last copy), before the
        # block is handed out again: its bytes are still there (an offload tier copies them).
        self.eviction_sink: Callable[[int, bytes], None] | None = None

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

    @property
    def num_cached_hashes(self) -> int:
        return len(self._cached)

    def has_cached(self, block_hash: bytes) -> bool:
        """Whether a block is cached under ``block_hash``: one lookup, so a reader without the pool's
        lock gets a true answer of some moment (no iteration a writer could disturb)."""
        return bool(self._cached.get(block_hash))

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """The oldest block cached under ``block_hash``, or None."""
        copies = self._cached.get(block_hash)
        return next(iter(copies.values())) if copies else None

    def is_cached(self, block: KVCacheBlock) -> bool:
        """``block`` is registered under its own hash in this pool."""
        h = block.block_hash
        return h is not None and self._cached.get(h, {}).get(block.block_id) is block

    # -- cache map ----------------------------------------------------------------------
    def _register(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Cache ``block`` under ``block_hash``; True if the hash was not cached before."""
        block.block_hash = block_hash
        copies = self._cached.setdefault(block_hash, {})
        copies[block.block_id] = block
        return len(copies) == 1

    def _unregister(self, block: KVCacheBlock) -> bytes | None:
        """Forget ``block``'s hash; returns the hash if that was its last copy, else None."""
        h = block.block_hash
        assert h is not None
        copies = self._cached[h]
        del copies[block.block_id]
        block.block_hash = None
        if copies:
            return None
        del self._cached[h]
        return h

    # -- allocation ---------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with ``ref_cnt == 1``.

        A taken block that was cached is evicted now (``BlockRemoved`` once a hash loses its
        last copy). Raises ``BlockPoolError`` if fewer blocks are free; nothing changes then.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self.free_queue):
            raise BlockPoolError(f"asked for {num_blocks} blocks but only {len(self.free_queue)} of {self.num_blocks} are free")
        blocks = self.free_queue.popleft_n(num_blocks)
        gone: list[bytes] = []
        for block in blocks:
            if block.block_hash is not None:
                h = self._unregister(block)
                if h is not None:
                    gone.append(h)
                    if self.eviction_sink is not None:
                        self.eviction_sink(block.block_id, h)
            block.ref_cnt = 1
        if gone:
            self._emit(BlockRemoved(gone, self.medium))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free queue.

        Every block must be registered in this pool's cache under its own hash.
        """
        blocks = list(blocks)
        for block in blocks:
            if not self.is_cached(block):
                raise BlockPoolError(f"touch of block {block.block_id} whose hash is not cached in this pool")
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in eviction order (first freed is evicted first).

        Blocks reaching ``ref_cnt == 0`` go back as two batches, each in the given order:
        unhashed ones (or all, with caching off) to the front of the free queue, reused first;
        cached ones to the back, evicted least recently freed first. Null blocks are skipped.
        Raises ``BlockPoolError`` on a double free (nothing changes then).
        """
        blocks = [b for b in ordered_blocks if not b.is_null]
        for block in blocks:
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"double free of block {block.block_id}")
        reuse_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (evict_last if self.enable_caching and block.block_hash is not None else reuse_first).append(block)
        self.free_queue.prepend_n(reuse_first)
        self.free_queue.append_n(evict_last)

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
        and ``token_ids`` its tokens. A hash already cached under another block gets this block
        as a second copy. Emits a ``BlockStored`` for each contiguous run of hashes that became
        cached (each a chain under its parent). Returns how many blocks were registered.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return 0
        if num_full_blocks > len(block_hashes) or num_full_blocks > len(blocks):
            raise BlockPoolError(
                f"cannot cache {num_full_blocks} blocks: {len(block_hashes)} hashes, {len(blocks)} blocks"
            )
        registered = 0
        runs: list[tuple[bytes | None, list[bytes], list[int]]] = []  # (parent, hashes, tokens) per chain
        run: tuple[bytes | None, list[bytes], list[int]] | None = None
        for i in range(num_cached_blocks, num_full_blocks):
            block, h = blocks[i], block_hashes[i]
            if block.is_null:
                run = None
                continue
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"cannot cache free block {block.block_id}")
            if block.block_hash is not None:
                if block.block_hash != h:
                    raise BlockPoolError(f"block {block.block_id} already cached under another hash")
                run = None
                continue
            registered += 1
            if not self._register(block, h):  # another copy of a cached hash: no event
                run = None
                continue
            if run is None:
                run = (block_hashes[i - 1] if i > 0 else None, [], [])
                runs.append(run)
            run[1].append(h)
            run[2].extend(token_ids[i * block_size : (i + 1) * block_size])
        for parent, hashes, tokens in runs:
            self._emit(BlockStored(hashes, parent, tokens, block_size, lora_name, self.medium))
        return registered

    def cache_restored_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                              block_size: int) -> None:  # fmt: skip
        """Register held, uncached ``blocks`` under ``block_hashes`` (KV restored from elsewhere,
        e.g. an offload tier, without the request that computed it): one ``BlockStored`` per
        hash that became cached, with no parent or tokens (they are not known here)."""
        if len(blocks) != len(block_hashes):
            raise BlockPoolError(f"{len(blocks)} blocks for {len(block_hashes)} hashes")
        for block, h in zip(blocks, block_hashes):
            if block.ref_cnt <= 0 or block.block_hash is not None or block.is_null:
                raise BlockPoolError(f"block {block.block_id} is free, null or cached already")
            if self.enable_caching and self._register(block, h):
                self._emit(BlockStored([h], None, [], block_size, None, self.medium))

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> int:
        """Forget the hashes of ``blocks`` (their KV turned out invalid); one ``BlockRemoved``
        for the hashes that lost their last copy.

        Blocks that are not cached (null ones included) are skipped. Returns how many were uncached.
        """
        uncached = 0
        gone: list[bytes] = []
        for block in blocks:
            if self.is_cached(block):
                uncached += 1
                h = self._unregister(block)
                if h is not None:
                    gone.append(h)
        if gone:
            self._emit(BlockRemoved(gone, self.medium))
        return uncached

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is held; returns False otherwise."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for copies in self._cached.values():
            for block in copies.values():
                block.block_hash = None
        self._cached.clear()
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
                assert self.is_cached(block), f"block {block.block_id} hash not mapped"
        for h, copies in self._cached.items():
            assert copies, "a cached hash with no block"
            for block_id, block in copies.items():
                assert block.block_id == block_id and block.block_hash == h, "cache map points at a wrong block"
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None and not null.in_free_queue, "null block was used"
