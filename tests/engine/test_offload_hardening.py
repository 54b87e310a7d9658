"""The offload tier's edges: a restore that makes room in the pool keeps the blocks it restores,
a tier without prefix caching is refused, and a tier too large for the host is refused by name."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.kv_offload import OffloadTier

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def _block(i: int) -> tuple[bytes, torch.Tensor]:
    return bytes([i]) * 16, torch.full((8,), i, dtype=torch.uint8)


def test_a_protected_block_is_never_dropped_for_room(tmp_path: Path) -> None:
    """Inside ``protected``, ``store`` drops the other blocks first, and keeps nothing new rather
    than drop a protected one; in the disk tier behind too."""
    from pdserve.engine.kv_slots import FileSlots

    disk = OffloadTier(1, 8, 16, storage=FileSlots(str(tmp_path), 1, 8))
    tier = OffloadTier(2, 8, 16, spill=disk)
    (a, da), (b, db), (c, dc), (d, dd) = (_block(i) for i in range(4))
    tier.store(a, da)
    tier.store(b, db)
    with tier.protected([a]):
        tier.store(c, dc)  # b (not a, the LRU) makes room, into the disk tier
        assert a in tier._slots and c in tier._slots and b in disk  # noqa: SLF001
        with tier.protected([c]):
            tier.store(d, dd)  # both host blocks protected: d is not kept
        assert d not in tier and a in tier and c in tier
        tier.store(d, dd)  # c is no longer protected: it goes to disk, b is dropped from there
        assert c in disk and b not in tier
    with disk.protected([c]):
        tier.store(b, db)  # a spills; the disk tier keeps c and refuses a
        assert c in disk and a not in tier
    out = torch.empty(8, dtype=torch.uint8)
    for h, data in ((b, db), (c, dc), (d, dd)):
        tier.load(h, out)
        assert torch.equal(out, data)
    tier.check_invariants()
    tier.close()


def test_restoring_a_prefix_does_not_push_it_out_of_a_full_tier(tiny_model: str) -> None:
    """A 4-block tier holds all of prefix A; the pool (6 blocks) holds B's cached blocks. Restoring
    A evicts B's blocks from the pool into the tier: they must not push A's blocks out of it."""
    rng = random.Random(0)
    a = [rng.randrange(3, 250) for _ in range(17)]  # 4 full blocks of 4, and one token to compute
    b = [rng.randrange(3, 250) for _ in range(17)]
    expected = LLM(tiny_model, num_blocks=64, block_size=4).generate([a], PARAMS)[0].token_ids
    probe = LLM(tiny_model, num_blocks=6, block_size=4, max_model_len=24)
    nbytes = probe.engine.layout.block_nbytes
    probe.close()
    llm = LLM(tiny_model, num_blocks=6, block_size=4, max_model_len=24, kv_offload_gb=4 * nbytes / 1024**3)
    try:
        engine = llm.engine
        assert engine.tier is not None and engine.tier.num_blocks == 4
        assert llm.generate([a], PARAMS)[0].token_ids == expected
        pool = engine.kv_manager.pool
        pool.free_blocks(pool.get_new_blocks(pool.get_num_free_blocks()))  # every cached block evicted
        assert engine.tier.stats().used_blocks == 4  # A's four blocks
        llm.generate([b], PARAMS)  # B's blocks now cached in the pool
        again = llm.generate([a], PARAMS)[0]
        assert again.num_cached_tokens == 16  # restored from the tier, not recomputed
        assert again.token_ids == expected
        assert engine.num_tier_hit_tokens == 16
        engine.tier.check_invariants()
        engine.kv_manager.check_invariants()
    finally:
        llm.close()


def test_a_tier_without_prefix_caching_is_refused_by_name(tiny_model: str) -> None:
    """Without prefix caching no block has a hash: the tier would hold its memory and disk for nothing."""
    from pdserve.engine.config import CacheConfig

    message = "kv_offload_gb needs enable_prefix_caching=True"
    with pytest.raises(ValueError, match=message):
        CacheConfig(enable_prefix_caching=False, kv_offload_gb=0.01)
    with pytest.raises(ValueError, match=message):
        CacheConfig(enable_prefix_caching=False, kv_offload_gb=0.01, kv_offload_disk_gb=1)
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, num_blocks=12, enable_prefix_caching=False, kv_offload_gb=0.01)
    CacheConfig(enable_prefix_caching=False)  # no tier: prefix caching may be off
    CacheConfig(kv_offload_gb=0.01)


def test_a_tier_larger_than_the_host_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A size above the host's available memory is refused before allocating; one the allocator
    refuses (its available memory unknown here) is refused with the same names, not torch's error."""
    from pdserve.engine import kv_slots
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.kv_offload import offload_tiers

    config = CacheConfig(kv_offload_gb=1e5, kv_offload_disk_gb=0.01, kv_offload_disk_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"kv_offload_gb=100000(\.0)?: 100000\.00 GiB of host memory asked for, "
                                         r"the host has [\d.]+ GiB available \(MemAvailable\); lower kv_offload_gb"):
        offload_tiers(config, 2048, None, pin_memory=False)
    monkeypatch.setattr(kv_slots, "host_memory_available", lambda: None)
    with pytest.raises(ValueError, match=r"kv_offload_gb=100000(\.0)?: cannot allocate 100000\.00 GiB of host "
                                         r"memory: .*; lower kv_offload_gb"):
        offload_tiers(config, 2048, None, pin_memory=False)


def test_the_engine_refuses_a_tier_larger_than_the_host(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="kv_offload_gb=100000.*MemAvailable"):
        LLM(tiny_model, num_blocks=12, kv_offload_gb=1e5)
