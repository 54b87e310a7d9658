"""Driving a KVCacheManager the way the scheduler does, for the pure-Python kvcache tests."""

from __future__ import annotations

from pdserve.engine.kvcache import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), BS, cache_salt=salt)


def admit(m: KVCacheManager, r: Request) -> int:
    """Schedule the whole prompt at once (prefix hit first), as the scheduler does; returns the hit."""
    hit, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, n, hit) is not None
    r.num_computed_tokens = r.num_tokens
    return n
