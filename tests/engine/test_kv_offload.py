"""The offload tier: evicted blocks kept in host memory by hash (LRU), prefixes restored from it
through the KV-handover API with the same tokens as recomputing them, changed bytes detected,
pool invariants kept and every block returned; Redis (the real embedded server) keeps a holder
field while either tier holds the block."""

from __future__ import annotations

import json
import os
import random
import stat

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_offload import OffloadTier, TierCorruptionError, TierStats
from pdserve.engine.kv_slots import DISK_MEDIUM, MEDIUM, FileSlots
from pdserve.engine.kvcache.events import BlockRemoved, BlockStored
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.publisher import KVEventPublisher
from tests.support.redis import unique_namespace

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def prefixes(n: int, length: int = 96, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def test_tier_keeps_the_most_recent_blocks_and_says_so() -> None:
    events: list = []
    tier = OffloadTier(2, 8, 16, events.append)
    blocks = {bytes([i]) * 16: torch.full((8,), i, dtype=torch.uint8) for i in range(3)}
    a, b, c = blocks
    tier.store(a, blocks[a])
    tier.store(b, blocks[b])
    tier.touch([a])  # a is now the most recent: c pushes b out
    tier.store(c, blocks[c])
    assert a in tier and c in tier and b not in tier
    assert tier.match([a, c, b, a]) == 2
    out = torch.empty(8, dtype=torch.uint8)
    tier.load(c, out)
    assert torch.equal(out, blocks[c])
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored", "BlockRemoved", "BlockStored"]
    assert events[2] == BlockRemoved([b], MEDIUM) and all(e.medium == MEDIUM for e in events)
    tier.check_invariants()
    # Bytes that changed after the store are caught at load, and the block is dropped.
    tier.data[tier._slots[a]][3] ^= 0xFF  # noqa: SLF001 - corrupt the stored copy in place
    with pytest.raises(TierCorruptionError, match=a.hex()):
        tier.load(a, out)
    assert a not in tier and events[-1] == BlockRemoved([a], MEDIUM) and tier.stats().corrupted == 1
    tier.check_invariants()
    with pytest.raises(ValueError, match="8 bytes"):
        tier.store(b, torch.zeros(9, dtype=torch.uint8))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefixes_four_times_the_pool_come_back_from_the_tier(tiny_model: str, kv_cache_dtype: str) -> None:
    """Eight 6-block prefixes through a 12-block pool: the second round finds every prefix in the
    tier (restored, not recomputed) and produces the tokens an engine without a tier does."""
    prompts = [p + [5] for p in prefixes(8)]
    expected = [o.token_ids for o in LLM(tiny_model, num_blocks=256, kv_cache_dtype=kv_cache_dtype).generate(
        prompts, PARAMS)]  # fmt: skip
    llm = LLM(tiny_model, num_blocks=12, kv_offload_gb=0.01, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    first = [llm.generate([p], PARAMS)[0] for p in prompts]
    again = [llm.generate([p], PARAMS)[0] for p in prompts]
    assert [o.num_cached_tokens for o in first] == [0] * 8
    assert [o.num_cached_tokens for o in again] == [96] * 8  # 6 full blocks each, from the tier
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
    assert engine.num_tier_hit_tokens >= 7 * 96  # the last prefix may still be in the pool
    stats = engine.stats()
    assert stats.offload_hit_tokens == engine.num_tier_hit_tokens and stats.offload_used_blocks >= 48
    engine.handover.check_invariants()
    engine.tier.check_invariants()
    usage = engine.kv_usage()
    assert usage.free_blocks == usage.num_blocks and usage.requests == 0


def test_a_batch_that_preempts_with_the_tier_frees_every_block(tiny_model: str) -> None:
    prompts = [p + [7] for p in prefixes(4, length=40, seed=3)]
    expected = [o.token_ids for o in LLM(tiny_model, num_blocks=256).generate(prompts, SamplingParams(
        max_tokens=30, ignore_eos=True))]  # fmt: skip
    llm = LLM(tiny_model, num_blocks=10, kv_offload_gb=0.01, max_num_seqs=4)
    for _ in range(2):
        outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
        assert [o.token_ids for o in outs] == expected
    assert llm.engine.stats().num_preemptions > 0
    llm.engine.handover.check_invariants()
    usage = llm.engine.kv_usage()
    assert usage.free_blocks == usage.num_blocks and usage.requests == 0


def test_a_changed_tier_block_is_recomputed_not_used(tiny_model: str) -> None:
    prompts = [p + [9] for p in prefixes(4, seed=5)]
    llm = LLM(tiny_model, num_blocks=8, kv_offload_gb=0.01)
    first = [llm.generate([p], PARAMS)[0].token_ids for p in prompts]
    tier = llm.engine.tier
    victim = llm.engine.make_request(prompts[0], PARAMS).block_hashes[2]
    assert victim in tier
    tier.data[tier._slots[victim]].zero_()  # noqa: SLF001 - the stored copy changes behind the tier's back
    out = llm.generate([prompts[0]], PARAMS)[0]
    assert out.token_ids == first[0] and out.num_cached_tokens == 0  # computed, correct
    assert llm.engine.stats().offload_corrupted_blocks == 1 and victim not in tier
    llm.engine.handover.check_invariants()
    assert llm.engine.kv_usage().free_blocks == 8


def test_redis_keeps_a_holder_while_either_tier_has_the_block(tiny_model: str, redis_server) -> None:  # noqa: ANN001
    cfg = IndexConfig(redis_server.url, namespace=unique_namespace())
    client = cfg.client()
    publisher = KVEventPublisher(cfg, "w0")
    block_nbytes = LLM(tiny_model, num_blocks=1).engine.layout.block_nbytes
    tier_gb = 4 * block_nbytes / 1024**3
    engine = LLMEngine(EngineConfig(tiny_model, device="cpu", cache=CacheConfig(16, 8, kv_offload_gb=tier_gb)),
                       event_sink=publisher)  # fmt: skip
    assert engine.tier is not None and engine.tier.num_blocks == 4
    seen: list = []
    engine.kv_manager.pool.add_event_sink(seen.append)
    a, b = (p + [5] for p in prefixes(2, length=96, seed=7))
    run(engine, a)
    run(engine, b)  # evicts a's blocks from the 8-block pool into the 4-block tier
    assert publisher.flush(10)
    hashes_a = engine.make_request(a, PARAMS).block_hashes
    in_tier = [h for h in hashes_a if h in engine.tier]
    gone = [h for h in hashes_a if h not in engine.tier and engine.kv_manager.pool.get_cached_block(h) is None]
    assert in_tier and gone
    assert all(client.hexists(cfg.block_key(h), "w0") for h in in_tier)  # held by the tier
    assert not any(client.hexists(cfg.block_key(h), "w0") for h in gone)  # dropped by both tiers
    media = {e.medium for e in seen}
    assert media == {"CPU"}  # the pool's events; the tier's go to the publisher directly
    stream = client.xrange(cfg.events_key)
    assert {f["medium"] for _, f in stream} == {"CPU", MEDIUM}
    assert any(f["type"] == "BlockStored" and f["medium"] == MEDIUM for _, f in stream)
    publisher.close()


def run(engine: LLMEngine, prompt: list[int]) -> None:
    req = engine.add_request(prompt, PARAMS)
    while not any(o.finished for o in engine.step() if o.request_id == req.request_id):
        pass


def test_a_remote_prefill_pulls_only_what_the_local_tier_lacks(tiny_model: str) -> None:
    """A decode engine whose tier holds the prefix reserves only the rest as external KV."""
    from pdserve.engine.kv_handover import RemotePrefill

    engine = LLM(tiny_model, num_blocks=10, kv_offload_gb=0.01).engine
    a, b = (p + [5] for p in prefixes(2, length=96, seed=11))
    run(engine, a)
    run(engine, b)  # most of a's blocks go to the tier
    req = engine.make_request(a + list(range(3, 40)), PARAMS)  # a's 6 blocks + 38 more prompt tokens
    assert engine.kv_manager.get_computed_blocks(req)[1] < 96
    load = engine.add_remote(req, RemotePrefill(req.num_prompt_tokens, (7,)))
    assert load is not None and load.num_local_hit_tokens == 96  # restored from the tier, not pulled
    assert load.num_external_tokens == req.num_prompt_tokens - 96
    assert engine.begin_load(req.request_id)
    engine.finish_load(req.request_id, ok=False)  # nothing was pulled: it recomputes here
    while engine.has_unfinished():
        engine.step()
    engine.handover.check_invariants()
    assert engine.kv_usage().free_blocks == 10


# -- the disk tier ------------------------------------------------------------------------------
def disk_tiers(tmp_path, events: list, host: int = 2, disk: int = 3) -> OffloadTier:  # noqa: ANN001
    spill = OffloadTier(disk, 8, 16, events.append, storage=FileSlots(str(tmp_path), disk, 8))
    return OffloadTier(host, 8, 16, events.append, spill=spill)


def test_blocks_the_host_tier_drops_go_to_disk_and_come_back(tmp_path) -> None:  # noqa: ANN001
    events: list = []
    tier = disk_tiers(tmp_path, events)
    blocks = {bytes([i]) * 16: torch.full((8,), i, dtype=torch.uint8) for i in range(6)}
    hashes = list(blocks)
    for h in hashes[:5]:
        tier.store(h, blocks[h])
    disk = tier.spill
    assert [h in tier._slots for h in hashes[:5]] == [False, False, False, True, True]  # noqa: SLF001
    assert [h in disk for h in hashes[:5]] == [True, True, True, False, False]
    assert tier.match(hashes) == 5 and hashes[5] not in tier
    out = torch.empty(8, dtype=torch.uint8)
    for h in hashes[:5]:  # from whichever tier holds it, bytes intact
        tier.load(h, out)
        assert torch.equal(out, blocks[h])
    # A full disk tier drops its least recently used block: hashes[0] was loaded first.
    tier.store(hashes[5], blocks[hashes[5]])  # host drops hashes[3] into disk, disk drops its LRU
    assert hashes[0] not in tier and hashes[3] in disk
    stored = [e.block_hashes[0] for e in events if isinstance(e, BlockStored) and e.medium == DISK_MEDIUM]
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == DISK_MEDIUM for h in e.block_hashes]
    assert stored == [hashes[0], hashes[1], hashes[2], hashes[3]] and removed == [hashes[0]]
    tier.check_invariants()
    assert disk.stats() == TierStats(3, 3, 4, 1, 3, 0) and tier.stats().stored == 6
    tier.close()


def test_a_changed_disk_block_is_detected_and_dropped(tmp_path) -> None:  # noqa: ANN001
    events: list = []
    tier = disk_tiers(tmp_path, events, host=1, disk=2)
    a, b = bytes([1]) * 16, bytes([2]) * 16
    tier.store(a, torch.full((8,), 1, dtype=torch.uint8))
    tier.store(b, torch.full((8,), 2, dtype=torch.uint8))  # a goes to disk
    disk = tier.spill
    slot = disk._slots[a]  # noqa: SLF001
    os.pwrite(disk.storage._fd, b"\xff", slot * 8 + 3)  # noqa: SLF001 - the file changes behind the tier's back
    with pytest.raises(TierCorruptionError, match=a.hex()):
        tier.load(a, torch.empty(8, dtype=torch.uint8))
    assert a not in tier and tier.num_corrupted == 1 and events[-1] == BlockRemoved([a], DISK_MEDIUM)
    tier.check_invariants()
    tier.close()


def test_the_disk_tier_file_is_private_and_leaves_nothing_behind(tmp_path) -> None:  # noqa: ANN001
    tier = disk_tiers(tmp_path, [])
    assert os.listdir(tmp_path) == []  # unnamed: no other process can open it by path
    st = os.fstat(tier.spill.storage._fd)  # noqa: SLF001
    assert st.st_size == 3 * 8 and stat.S_IMODE(st.st_mode) & 0o077 == 0
    tier.close()
    with pytest.raises(ValueError, match="cannot create the disk tier"):
        FileSlots(str(tmp_path / "missing"), 1, 8)


def test_disk_io_failures_lose_a_block_never_a_slot_or_an_eviction(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """ENOSPC on a write and EIO on a read: the eviction goes on, the block is not kept (no
    DISK_TIER event claims it), the load fails cleanly, and every slot is accounted for."""
    import errno

    events: list = []
    tier = disk_tiers(tmp_path, events, host=1, disk=2)
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    tier.store(a, torch.full((8,), 1, dtype=torch.uint8))

    def no_space(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)
    tier.store(b, torch.full((8,), 2, dtype=torch.uint8))  # a spills: the disk write fails
    monkeypatch.undo()
    assert a not in tier and b in tier
    assert not any(isinstance(e, BlockStored) and e.medium == DISK_MEDIUM for e in events)
    assert events[-2] == BlockRemoved([a], MEDIUM)  # the host let go of it: Redis drops the holder
    tier.store(c, torch.full((8,), 3, dtype=torch.uint8))  # b spills, written this time
    assert b in tier.spill

    def io_error(*_: object) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", io_error)
    with pytest.raises(TierCorruptionError, match="could not be read"):
        tier.load(b, torch.empty(8, dtype=torch.uint8))
    monkeypatch.undo()
    assert b not in tier and tier.num_corrupted == 1 and events[-1] == BlockRemoved([b], DISK_MEDIUM)
    tier.check_invariants()
    tier.close()
    with pytest.raises(OSError, match="closed"):  # a closed file's descriptor number is never reused here
        tier.spill.storage.read(0)


def test_a_failing_or_changed_spill_keeps_the_host_tier_whole(tmp_path) -> None:  # noqa: ANN001
    events: list = []
    tier = disk_tiers(tmp_path, events, host=1, disk=2)
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    tier.store(a, torch.full((8,), 1, dtype=torch.uint8))
    tier.data[tier._slots[a]][0] ^= 0xFF  # noqa: SLF001 - a's host copy changes
    tier.store(b, torch.full((8,), 2, dtype=torch.uint8))  # a is dropped, not spilled, and counted
    assert a not in tier and tier.num_corrupted == 1 and events[-2] == BlockRemoved([a], MEDIUM)

    def broken(*_: object) -> None:
        raise RuntimeError("spill tier broke")

    tier.spill.store = broken  # anything, not only an OSError
    tier.store(c, torch.full((8,), 3, dtype=torch.uint8))  # b's spill raises: the eviction still completes
    assert b not in tier and c in tier and events[-2] == BlockRemoved([b], MEDIUM)
    tier.check_invariants()
    tier.close()


def test_a_bad_host_copy_falls_back_to_the_disk_copy(tmp_path) -> None:  # noqa: ANN001
    tier = disk_tiers(tmp_path, [], host=1, disk=2)
    a, b = bytes([1]) * 16, bytes([2]) * 16
    block = torch.full((8,), 1, dtype=torch.uint8)
    tier.store(a, block)
    tier.store(b, torch.full((8,), 2, dtype=torch.uint8))  # a: disk only
    out = torch.empty(8, dtype=torch.uint8)
    tier.store(a, block)  # a again in the host tier (b spills): a copy in each tier
    assert a in tier._slots and a in tier.spill  # noqa: SLF001
    tier.data[tier._slots[a]][5] ^= 0xFF  # noqa: SLF001
    tier.load(a, out)
    assert torch.equal(out, block) and tier.num_corrupted == 1 and a not in tier._slots  # noqa: SLF001
    tier.check_invariants()
    tier.close()


def test_disk_tier_config_is_checked() -> None:
    with pytest.raises(ValueError, match="needs kv_offload_gb"):
        CacheConfig(kv_offload_disk_gb=1.0)
    with pytest.raises(ValueError, match="kv_offload_disk_gb must be a number"):
        CacheConfig(kv_offload_gb=1.0, kv_offload_disk_gb=-1.0)


def test_prefixes_come_back_from_disk_with_the_same_tokens(tiny_model: str, tmp_path) -> None:  # noqa: ANN001
    """Eight 6-block prefixes through a 12-block pool and a 6-block host tier: most come back from
    the disk tier behind it, restored, with the tokens of an engine that never evicted."""
    prompts = [p + [5] for p in prefixes(8, seed=21)]
    expected = [o.token_ids for o in LLM(tiny_model, num_blocks=256).generate(prompts, PARAMS)]
    block_gb = LLM(tiny_model, num_blocks=1).engine.layout.block_nbytes / 1024**3
    llm = LLM(tiny_model, num_blocks=12, kv_offload_gb=6 * block_gb, kv_offload_disk_gb=0.01,
              kv_offload_disk_dir=str(tmp_path))  # fmt: skip
    engine = llm.engine
    first = [llm.generate([p], PARAMS)[0] for p in prompts]
    again = [llm.generate([p], PARAMS)[0] for p in prompts]
    assert [o.num_cached_tokens for o in again] == [96] * 8
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
    stats = engine.stats()
    assert stats.offload_blocks == 6 and stats.offload_disk_used_blocks >= 8 * 6 - 12 - 6
    assert engine.tier.spill.stats().loaded >= 5 * 6  # most prefixes came from disk
    engine.handover.check_invariants()
    engine.tier.check_invariants()
    usage = engine.kv_usage()
    assert usage.free_blocks == usage.num_blocks and usage.requests == 0


def test_redis_names_the_disk_tier_and_keeps_its_holders(tiny_model: str, redis_server, tmp_path) -> None:  # noqa: ANN001
    cfg = IndexConfig(redis_server.url, namespace=unique_namespace())
    client = cfg.client()
    publisher = KVEventPublisher(cfg, "w0")
    block_gb = LLM(tiny_model, num_blocks=1).engine.layout.block_nbytes / 1024**3
    cache = CacheConfig(16, 8, kv_offload_gb=block_gb, kv_offload_disk_gb=3 * block_gb,
                        kv_offload_disk_dir=str(tmp_path))  # fmt: skip
    engine = LLMEngine(EngineConfig(tiny_model, device="cpu", cache=cache), event_sink=publisher)
    a, b = (p + [5] for p in prefixes(2, length=96, seed=7))
    run(engine, a)
    run(engine, b)  # a's blocks: pool -> 1-block host tier -> 3-block disk tier -> gone
    assert publisher.flush(10)
    hashes_a = engine.make_request(a, PARAMS).block_hashes
    disk = engine.tier.spill
    on_disk = [h for h in hashes_a if h in disk]
    gone = [h for h in hashes_a if h not in engine.tier and engine.kv_manager.pool.get_cached_block(h) is None]
    assert len(on_disk) == 3 and gone
    assert all(client.hexists(cfg.block_key(h), "w0") for h in on_disk)
    assert not any(client.hexists(cfg.block_key(h), "w0") for h in gone)
    stream = [f for _, f in client.xrange(cfg.events_key)]
    assert {f["medium"] for f in stream} == {"CPU", MEDIUM, DISK_MEDIUM}
    disk_stored = {h for f in stream if f["type"] == "BlockStored" and f["medium"] == DISK_MEDIUM
                   for h in json.loads(f["block_hashes"])}  # fmt: skip
    assert {h.hex() for h in on_disk} <= disk_stored
    publisher.close()
