"""KVCacheBlock and the free-block queue (a doubly linked list with O(1) middle removal)."""

from __future__ import annotations

from collections.abc import Iterator

# Id of the null block: the placeholder a request's block list holds where a block slid out of
# every sliding window and went back to the pool (it is never read, never written, never freed).
NULL_BLOCK_ID = -1


class KVCacheBlock:
    """Metadata of one physical KV block.

    ``ref_cnt`` counts the live requests holding the block. ``block_hash`` is set
    while the block is registered in the prefix cache. ``prev_free``/``next_free``
    link it into the free queue while ``ref_cnt == 0``. A block with id
    ``NULL_BLOCK_ID`` is the pool's null block (``is_null``), outside the pool.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "in_free_queue")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.in_free_queue = False

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the front is taken first.

    Unhashed blocks go to the front (nothing to lose), cached ones to the back
    (least recently freed is evicted first); blocks freed together keep their order. ``remove`` takes a block out of the
    middle in O(1), which a prefix-cache hit on a free block needs.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        # Sentinels remove every empty-list special case from the link updates.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def _link_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.in_free_queue:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        block.in_free_queue = True
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``; it must be in this queue."""
        if not block.in_free_queue:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("no free blocks")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        assert self._tail.prev_free is not None
        self._link_after(self._tail.prev_free, block)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in their order: ``blocks[0]`` is reused first."""
        anchor = self._head
        for block in blocks:
            self._link_after(anchor, block)
            anchor = block

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free
