"""The block pool behaves as vLLM's v1 KV-cache core where pdserve once differed.

Each test replays a small scenario and states what vLLM does (vllm/v1/core/block_pool.py,
kv_cache_utils.py, single_type_kv_cache_manager.py); pdserve must do the same.
"""

from __future__ import annotations

from pdserve.engine.kvcache import NULL_BLOCK_ID, BlockStored, KVCacheManager, block_hashes
from tests.support.kvcache import BS, admit, req


def test_empty_cache_salt_is_no_salt() -> None:
    """vLLM adds the salt to block 0's extra keys only ``if request.cache_salt``: "" is no salt."""
    tokens = list(range(32))
    assert block_hashes(tokens, 16, cache_salt="") == block_hashes(tokens, 16)
    m = KVCacheManager(8, BS)
    a = req("a", list(range(9)), salt="")
    admit(m, a)
    m.free(a)
    assert admit(m, req("b", list(range(9)), salt=None)) == 8  # the same cache entries
    assert a.cache_salt is None


def test_a_second_copy_of_a_cached_block_keeps_serving_hits() -> None:
    """vLLM registers every computed copy of a hash (a hash maps to several blocks) and evicts copy
    by copy, so a live duplicate keeps the hash hittable after the original is evicted. Pool of 5,
    block size 4: vLLM hits 8 tokens at the end; pdserve used to hit 4."""
    m = KVCacheManager(5, BS)
    prompt = list(range(8))
    a = req("a", prompt)
    admit(m, a)
    m.free(a)  # blocks 0 (h0) and 1 (h1) free and cached
    b = req("b", prompt)
    assert admit(m, b) == 4  # hit capped at 1 block: block 1's tokens are recomputed into a new block
    b_blocks = m.get_block_ids("b")
    assert b_blocks[0] == 0 and b_blocks[1] != 1  # a second copy of h1, live
    filler = req("filler", list(range(1000, 1012)))  # takes the 3 free blocks: evicts a's copy of h1
    admit(m, filler)
    assert 1 in m.get_block_ids("filler")
    m.free(filler)
    c = req("c", prompt + [99])
    assert admit(m, c) == 8  # h0 and h1 (b's copy) both hit
    m.check_invariants()


def test_blocks_freed_together_keep_their_order_at_the_front() -> None:
    """vLLM's free_blocks prepends the unhashed blocks as one batch in the order given (a request's
    blocks are given tail first), so the tail block is reused first."""
    m = KVCacheManager(6, BS, enable_caching=False)
    r = req("r", list(range(12)))
    admit(m, r)
    assert m.get_block_ids("r") == [0, 1, 2]
    m.free(r)
    assert [b.block_id for b in m.pool.free_queue] == [2, 1, 0, 3, 4, 5]
    s = req("s", list(range(100, 104)))
    admit(m, s)
    assert m.get_block_ids("s") == [2]


def test_cached_blocks_go_to_the_back_lru_and_unhashed_to_the_front() -> None:
    """vLLM appends freed hashed blocks to the tail in the order given (tail of the chain first, so
    the chain's root is evicted last) and prepends unhashed ones."""
    m = KVCacheManager(6, BS)
    r = req("r", list(range(10)))  # blocks 0, 1 full (hashed), block 2 partial (unhashed)
    admit(m, r)
    m.free(r)
    assert [b.block_id for b in m.pool.free_queue] == [2, 3, 4, 5, 1, 0]


def test_sliding_window_frees_blocks_as_it_slides() -> None:
    """vLLM's SlidingWindowManager frees, before each allocation, the blocks wholly before
    ``num_computed_tokens - sliding_window + 1`` (newest first) and puts the null block in their
    place; the freed blocks stay cached. Window 7, block size 4."""
    events: list = []
    m = KVCacheManager(10, BS, event_sink=events.append, sliding_window=7)
    r = req("r", list(range(8)))
    admit(m, r)  # 8 computed: skipped tokens 8 - 7 + 1 = 2, no whole block yet
    assert NULL_BLOCK_ID not in m.get_block_ids("r")
    for tok in range(100, 106):  # decode to 14 tokens
        r.append_output_token(tok)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    # At the last allocation 13 tokens were computed: 13 - 7 + 1 = 7 skipped -> 1 whole block.
    ids = m.get_block_ids("r")
    assert ids[0] == NULL_BLOCK_ID and NULL_BLOCK_ID not in ids[1:]
    assert m.num_free_blocks() == 10 - (len(ids) - 1)
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert m.pool.get_cached_block(stored[0]) is not None  # freed, still a prefix-cache entry
    r.append_output_token(106)
    assert m.allocate_slots(r, 1) is not None  # 14 computed: 8 skipped -> 2 blocks
    assert m.get_block_ids("r")[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    m.check_invariants()
    m.free(r)
    assert m.num_free_blocks() == 10
    m.check_invariants()
