from __future__ import annotations

import pytest

from pdserve.engine.kvcache import BlockPoolError, BlockStored, KVCacheManager
from tests.support.kvcache import BS, admit, req


def test_allocate_grow_free() -> None:
    m = KVCacheManager(10, BS)
    r = req("a", list(range(10)))
    hit, n = m.get_computed_blocks(r)
    assert (hit, n) == ([], 0)
    new = m.allocate_slots(r, 10)
    assert new is not None and len(new) == 3
    r.num_computed_tokens = 10
    # 2 full blocks cached at allocation time
    assert m.num_cached_blocks["a"] == 2
    # decode: 2 more tokens fit in the partial block, the third needs a new block
    r.append_output_token(99)
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    r.append_output_token(98)
    assert m.allocate_slots(r, 1) == []
    r.num_computed_tokens += 1
    assert m.num_cached_blocks["a"] == 3  # block 2 became full and was cached
    r.append_output_token(97)
    assert len(m.allocate_slots(r, 1) or []) == 1
    m.check_invariants()
    m.free(r)
    assert m.num_free_blocks() == 10
    with pytest.raises(BlockPoolError):
        m.free(r)
    m.check_invariants()


def test_prefix_hit_is_capped_and_counted() -> None:
    m = KVCacheManager(16, BS)
    a = req("a", list(range(8)))
    admit(m, a)
    m.free(a)
    # same 8 tokens: only 1 block may hit so that one token is computed
    b = req("b", list(range(8)))
    hit, n = m.get_computed_blocks(b)
    assert n == 4 and len(hit) == 1
    assert m.stats.requests == 1  # a lookup alone is not counted
    c = req("c", list(range(9)))
    assert admit(m, c) == 8
    assert m.stats.requests == 2
    assert m.stats.queries == 8 + 9 and m.stats.hits == 0 + 8
    assert m.stats.hit_rate == pytest.approx(8 / 17)
    # c preempted (its blocks freed) and admitted again: not a new query, its hits not counted twice
    m.free(c)
    c.num_computed_tokens = 0
    assert admit(m, c) == 8
    assert (m.stats.requests, m.stats.queries, m.stats.hits) == (2, 8 + 9, 8)


def test_salt_isolates() -> None:
    m = KVCacheManager(16, BS)
    admit(m, req("a", list(range(9)), salt="t1"))
    assert m.get_computed_blocks(req("b", list(range(9)), salt="t2"))[1] == 0
    assert m.get_computed_blocks(req("c", list(range(9)), salt="t1"))[1] == 8


def test_shared_blocks_refcount_and_free_order() -> None:
    m = KVCacheManager(8, BS)
    a, b = req("a", list(range(9))), req("b", list(range(9)) + [50])
    admit(m, a)
    assert admit(m, b) == 8
    shared = m.get_blocks("a")[:2]
    assert m.get_blocks("b")[:2] == shared and all(x.ref_cnt == 2 for x in shared)
    m.check_invariants()
    m.free(a)
    assert all(x.ref_cnt == 1 for x in shared)
    m.free(b)
    assert m.num_free_blocks() == 8
    m.check_invariants()


def test_allocation_failure_changes_nothing() -> None:
    m = KVCacheManager(3, BS)
    a = req("a", list(range(8)))
    admit(m, a)
    m.free(a)  # 2 cached free blocks
    b = req("b", list(range(8)) + list(range(100, 108)))
    hit, n = m.get_computed_blocks(b)
    assert n == 8
    assert m.allocate_slots(b, 8, n, hit) is None  # needs 2 new + 2 evictable hits > 3 free
    assert "b" not in m.req_to_blocks and m.num_free_blocks() == 3
    assert all(x.ref_cnt == 0 for x in hit)
    m.check_invariants()


def test_external_tokens_cached_only_when_complete() -> None:
    events: list = []
    m = KVCacheManager(8, BS, event_sink=events.append)
    r = req("x", list(range(10)))
    new = m.allocate_slots(r, 0, num_external_computed_tokens=9)
    assert new is not None and len(new) == 3
    assert not events and m.num_cached_blocks["x"] == 0
    r.num_computed_tokens = 9
    m.mark_external_complete(r)
    assert len(events) == 1 and isinstance(events[0], BlockStored) and len(events[0].block_hashes) == 2
    m.free(r)
    m.check_invariants()


def test_bad_arguments() -> None:
    m = KVCacheManager(4, BS)
    r = req("a", list(range(4)))
    with pytest.raises(ValueError):
        m.allocate_slots(r, -1)
    with pytest.raises(ValueError):
        m.allocate_slots(r, 4, num_new_computed_tokens=4, new_computed_blocks=[])
    assert m.allocate_slots(r, 100) is None  # more than the pool holds: refused, not corrupted
    m.check_invariants()


def test_windowed_admission_bound_covers_a_recompute_after_preemption() -> None:
    """With a sliding window a request is admitted on a bound below its full length; a request
    preempted late recomputes prompt and output in one chunk, which the bound must cover, or it
    would wait forever at the head of the queue (and everything behind it)."""
    from pdserve.engine.config import SchedulerConfig
    from pdserve.engine.kvcache.manager import blocks_for_request
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import Scheduler

    window, pool, budget = 8, 10, 16
    # A recompute in one 204-token chunk would need 51 blocks: with a large step budget the bound
    # is the full length, and a 10-block pool refuses the request instead of admitting a deadlock.
    assert blocks_for_request(4, 200, 1000, BS, window, 2048) == 51
    # With 16-token steps the recompute is chunked and the window keeps it within 7 blocks.
    assert blocks_for_request(4, 200, 1000, BS, window, budget) == 7
    m = KVCacheManager(pool, BS, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=1000), m)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    reqs = [req(name, [1 + i, 2, 3, 4]) for i, name in enumerate("AB")]
    for r in reqs:
        r.sampling_params = params
        sched.add(r)

    def step() -> None:
        for s in sched.schedule().scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.samples:
                s.request.append_output_token(7)
                status = s.request.check_stop()
                if status is not None:
                    sched.finish(s.request, status)

    most_held = 0

    def held() -> int:
        return max(sum(not b.is_null for b in m.get_blocks(r.request_id)) for r in reqs)

    for _ in range(100):
        step()
        most_held = max(most_held, held())
    # Something else (KV loads) keeps taking every free block: a request is preempted.
    grabs = []
    for i in range(20):
        if m.num_free_blocks():
            grabs.append(req(f"grab{i}", list(range(100, 100 + BS * m.num_free_blocks()))))
            assert m.allocate_slots(grabs[-1], grabs[-1].num_tokens, trim_window=False) is not None
        step()
        if sched.num_preemptions:
            break
    assert sched.num_preemptions >= 1
    for g in grabs:
        m.free(g)
    for _ in range(400):
        step()
        most_held = max(most_held, held())
    assert all(r.status.finished for r in reqs), [r.status for r in reqs]
    assert most_held <= 7  # never above the bound it was admitted under
    assert m.num_free_blocks() == pool
