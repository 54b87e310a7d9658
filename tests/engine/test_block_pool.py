from __future__ import annotations

import pytest

from pdserve.engine.kvcache import (
    AllBlocksCleared,
    BlockPool,
    BlockPoolError,
    BlockRemoved,
    BlockStored,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    block_hashes,
)


def test_free_queue_order_and_middle_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert [b.block_id for b in q.popleft_n(2)] == [0, 1]
    q.prepend_n([blocks[1], blocks[0]])
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 0, 3, 4, 2]
    taken = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(taken)
    with pytest.raises(RuntimeError):
        q.append(blocks[3])
    with pytest.raises(ValueError):
        q.popleft_n(10)


def _pool_with_events(n: int = 8) -> tuple[BlockPool, list]:
    events: list = []
    return BlockPool(n, event_sink=events.append), events


def test_allocate_and_free_order() -> None:
    pool, _ = _pool_with_events(8)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.usage == pytest.approx(3 / 8)
    pool.free_blocks(reversed(a))  # unhashed blocks go to the front, as one batch in the order freed
    assert [b.block_id for b in pool.free_queue][:3] == [2, 1, 0]
    assert pool.usage == 0.0
    pool.check_invariants()


def test_cache_touch_evict_events() -> None:
    pool, events = _pool_with_events(4)
    tokens = list(range(40))
    hs = block_hashes(tokens, 16)
    blocks = pool.get_new_blocks(3)
    n = pool.cache_full_blocks(blocks, hs, 0, 2, 16, tokens)
    assert n == 2
    assert events == [BlockStored(hs, None, tokens[:32], 16, None, "GPU")]
    # cache again: nothing new, no event
    assert pool.cache_full_blocks(blocks, hs, 0, 2, 16, tokens) == 0 and len(events) == 1
    pool.free_blocks(reversed(blocks))
    # hashed blocks at the back, tail of the chain (block 1) before block 0; unhashed block 2 at front
    assert [b.block_id for b in pool.free_queue] == [2, 3, 1, 0]
    # prefix hit: touching a free cached block takes it out of the queue
    pool.touch([pool.get_cached_block(hs[0])])
    assert blocks[0].ref_cnt == 1 and not blocks[0].in_free_queue
    # allocating 3 blocks evicts block 1 lazily (it is the only free cached one)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [2, 3, 1]
    assert events[-1] == BlockRemoved([hs[1]], "GPU")
    assert pool.get_cached_block(hs[1]) is None and pool.get_cached_block(hs[0]) is blocks[0]
    pool.check_invariants()


def test_errors() -> None:
    pool, _ = _pool_with_events(4)
    with pytest.raises(BlockPoolError):
        pool.get_new_blocks(5)
    assert pool.get_num_free_blocks() == 4  # nothing changed
    b = pool.get_new_blocks(1)
    pool.free_blocks(b)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free_blocks(b)
    with pytest.raises(BlockPoolError, match="hash"):
        pool.touch(b)  # block not cached
    other = BlockPool(4)
    ob = other.get_new_blocks(1)
    hs = block_hashes(list(range(16)), 16)
    other.cache_full_blocks(ob, hs, 0, 1, 16, list(range(16)))
    with pytest.raises(BlockPoolError, match="hash"):
        pool.touch(ob)  # a block cached in another pool
    with pytest.raises(ValueError):
        BlockPool(0)
    pool.check_invariants()


def test_duplicate_copies_are_cached_and_events_follow_the_hash() -> None:
    pool, events = _pool_with_events(4)
    tokens = list(range(16))
    hs = block_hashes(tokens, 16)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    assert pool.cache_full_blocks(a, hs, 0, 1, 16, tokens) == 1
    assert pool.cache_full_blocks(b, hs, 0, 1, 16, tokens) == 1  # a second copy is registered too
    assert pool.get_cached_block(hs[0]) is a[0] and b[0].block_hash == hs[0]
    assert len(events) == 1  # the hash became cached once
    pool.free_blocks(a)
    pool.get_new_blocks(3)  # evicts a's copy: the hash is still served by b
    assert pool.get_cached_block(hs[0]) is b[0] and len(events) == 1
    pool.free_blocks(b)
    pool.check_invariants()
    pool.get_new_blocks(1)  # the last copy goes: now the hash is removed
    assert events[-1] == BlockRemoved([hs[0]], "GPU") and pool.get_cached_block(hs[0]) is None
    pool.check_invariants()


def test_reset_prefix_cache() -> None:
    pool, events = _pool_with_events(4)
    tokens = list(range(16))
    hs = block_hashes(tokens, 16)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, hs, 0, 1, 16, tokens)
    assert pool.reset_prefix_cache() is False  # a block is in use
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert isinstance(events[-1], AllBlocksCleared)
    assert pool.get_cached_block(hs[0]) is None and blocks[0].block_hash is None
    pool.check_invariants()


def test_uncache_blocks_forgets_hashes_and_emits_removed() -> None:
    pool, events = _pool_with_events(4)
    tokens = list(range(32))
    hs = block_hashes(tokens, 16)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hs, 0, 2, 16, tokens)
    assert pool.uncache_blocks(blocks[1:]) == 1
    assert events[-1] == BlockRemoved([hs[1]], "GPU")
    assert pool.get_cached_block(hs[1]) is None and pool.get_cached_block(hs[0]) is blocks[0]
    assert pool.uncache_blocks(blocks[1:]) == 0  # already uncached: no event
    pool.free_blocks(reversed(blocks))
    pool.check_invariants()


def test_stored_events_are_chains_even_around_a_duplicate() -> None:
    """A hash in the middle already cached as another copy splits the stored hashes into two
    chains, each under its own parent (an event never skips a link)."""
    pool, events = _pool_with_events(8)
    tokens = list(range(64))
    hs = block_hashes(tokens, 16)
    other = pool.get_new_blocks(2)
    pool.cache_full_blocks(other, hs, 1, 2, 16, tokens)  # only block 1's hash, as another copy
    events.clear()
    blocks = pool.get_new_blocks(4)
    assert pool.cache_full_blocks(blocks, hs, 0, 4, 16, tokens) == 4
    assert events == [BlockStored([hs[0]], None, tokens[:16], 16, None, "GPU"),
                      BlockStored([hs[2], hs[3]], hs[1], tokens[32:64], 16, None, "GPU")]
    pool.check_invariants()
