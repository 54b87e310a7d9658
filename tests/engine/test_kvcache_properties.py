"""Random sequences of allocate / grow / hit / free / preempt against the pool's invariants,
with and without a sliding window (blocks leave a request as the window slides)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.kvcache import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

BS = 4
PREFIXES = [list(range(100, 112)), list(range(200, 206)), []]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("new"), st.integers(0, 2), st.integers(1, 14)),
        st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 6)),
        st.tuples(st.just("free"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("preempt"), st.integers(0, 50), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


def check(m: KVCacheManager, live: dict[str, Request]) -> None:
    m.check_invariants()  # ref_cnt == holders, free xor held, hash map consistent
    pool = m.pool
    held = [b for blocks in m.req_to_blocks.values() for b in blocks if not b.is_null]
    held_ids = {b.block_id for b in held}
    free_ids = {b.block_id for b in pool.free_queue}
    assert not held_ids & free_ids
    assert len(pool.free_queue) + len(held_ids) == pool.num_blocks
    assert sum(b.ref_cnt for b in pool.blocks) == len(held)
    assert set(m.req_to_blocks) == set(live)
    for r in live.values():
        blocks = m.req_to_blocks[r.request_id]
        assert len(blocks) * BS >= r.num_computed_tokens
        if m.sliding_window is None:
            assert not any(b.is_null for b in blocks)
        else:  # nulls only where no later query can look, and only as a prefix
            nulls = [i for i, b in enumerate(blocks) if b.is_null]
            assert nulls == list(range(len(nulls)))
            assert len(nulls) * BS <= max(0, r.num_computed_tokens - m.sliding_window + 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(4, 24), window=st.sampled_from([None, 3, 6, 9]))
def test_random_workloads_keep_invariants(ops: list[tuple[str, int, int]], num_blocks: int, window: int | None) -> None:
    m = KVCacheManager(num_blocks, BS, sliding_window=window)
    live: dict[str, Request] = {}
    counter = 0
    for op, a, b in ops:
        if op == "new":
            counter += 1
            tokens = PREFIXES[a] + [1000 + counter * 20 + i for i in range(b)]
            r = Request(f"r{counter}", tokens, SamplingParams(), BS)
            hit, n = m.get_computed_blocks(r)
            assert n < r.num_tokens
            got = m.allocate_slots(r, r.num_tokens - n, n, hit)
            if got is not None:
                r.num_computed_tokens = r.num_tokens
                live[r.request_id] = r
        elif live:
            r = list(live.values())[a % len(live)]
            if op == "grow":
                for i in range(b):
                    r.append_output_token(5000 + i)
                    if m.allocate_slots(r, 1) is None:
                        # out of blocks mid-decode: preempt this request
                        m.free(r)
                        del live[r.request_id]
                        break
                    r.num_computed_tokens += 1
            else:  # free or preempt: both return every block
                m.free(r)
                del live[r.request_id]
        check(m, live)
    for r in list(live.values()):
        m.free(r)
    live.clear()
    check(m, live)
    assert m.num_free_blocks() == num_blocks
    assert all(b.ref_cnt == 0 for b in m.pool.blocks)
