"""router.kv_policy "auto": RouterCore learns, from what its workers take, whether pulling a
prompt's KV beats recomputing it on the decode worker. Scripted workers (plain Python objects
standing for the fleet) take real time to prefill and to pull; the pulls report their bytes as a
decode worker does. Redis is the real embedded server."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from pdserve.engine.config import CacheConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvindex.stats import StatsRecorder
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from tests.support.redis import unique_namespace

KV_BYTES_PER_TOKEN = 1000


class TimedWorkers:
    """The prefill worker computes at ``prefill_s`` per token, the decode worker at ``local_s``
    per token; a pull moves a token's KV in ``pull_s``."""

    prefill_ids = ["p0"]
    decode_ids = ["d0"]

    def __init__(self, prefill_s: float, local_s: float, pull_s: float) -> None:
        self.prefill_s, self.local_s, self.pull_s = prefill_s, local_s, pull_s
        self.paths: list[str] = []
        self.prefetched: list[tuple[str, str, str]] = []

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult:
        await asyncio.sleep(self.prefill_s * len(spec.prompt_token_ids))
        return PrefillResult(spec.request_id, 7, False, None, "lease", "127.0.0.1:1", worker_id,
                             len(spec.prompt_token_ids), 0)  # fmt: skip

    async def decode(self, worker_id: str, spec: RequestSpec, prefill: PrefillResult | None) -> AsyncIterator[DecodeEvent]:
        n = len(spec.prompt_token_ids)
        if prefill is None:
            self.paths.append("recompute")
            await asyncio.sleep(self.local_s * n)
            yield DecodeEvent(spec.request_id, (1,), True, "length")
        else:
            self.paths.append("pull")
            await asyncio.sleep(self.pull_s * n)
            yield DecodeEvent(spec.request_id, (1,), True, "length", 0, n, pull_bytes=n * KV_BYTES_PER_TOKEN)

    def prefetch(self, decode_id: str, spec: RequestSpec, prefill_id: str) -> None:
        self.prefetched.append((decode_id, spec.request_id, prefill_id))  # no KV moves between these workers

    def release(self, worker_id: str, lease_id: str) -> None:
        pass


async def _serve(core: RouterCore, count: int) -> None:
    rng = random.Random(0)
    for i in range(count):
        n = rng.randrange(100, 300)
        spec = RequestSpec(f"r{i}", tuple(rng.randrange(256) for _ in range(n)), SamplingParams(max_tokens=1))
        async for _ in core.generate(spec):
            pass


@pytest.mark.parametrize(("pull_s", "expected"), [(2e-3, "recompute"), (1e-6, "pull")], ids=["slow-link", "fast-link"])
def test_auto_learns_which_path_is_sooner(redis_server, pull_s: float, expected: str) -> None:  # noqa: ANN001
    """The prefill worker is 2.5x faster than the decode worker. Over a slow link (2 ms a token's
    KV) recomputing wins; over a fast one pulling does. The router starts on the threshold, tries
    both paths, then takes the sooner one (exploring the other now and then)."""
    index = IndexConfig(redis_server.url, namespace=unique_namespace())
    workers = TimedWorkers(prefill_s=2e-4, local_s=5e-4, pull_s=pull_s)
    core = RouterCore(RouterConfig(kv_policy="auto", local_prefill_threshold=8), CacheConfig(block_size=16),
                      workers, PrefixLookup(index), StatsRecorder(index))  # fmt: skip
    try:
        asyncio.run(_serve(core, 30))
    finally:
        core.close()
    assert set(workers.paths[:12]) == {"pull", "recompute"}  # both were measured early
    last = workers.paths[-12:]
    assert last.count(expected) >= 10, workers.paths


def test_fixed_policies_take_one_path(redis_server) -> None:  # noqa: ANN001
    for policy, path in (("pull", "pull"), ("recompute", "recompute")):
        index = IndexConfig(redis_server.url, namespace=unique_namespace())
        workers = TimedWorkers(prefill_s=0, local_s=0, pull_s=0)
        core = RouterCore(RouterConfig(kv_policy=policy), CacheConfig(block_size=16), workers, PrefixLookup(index),
                          StatsRecorder(index))  # fmt: skip
        try:
            asyncio.run(_serve(core, 4))
        finally:
            core.close()
        assert workers.paths == [path] * 4
    with pytest.raises(ValueError, match="kv_policy must be one of threshold, auto, pull, recompute"):
        RouterConfig(kv_policy="sometimes")


def test_long_prompts_pulled_from_a_prefill_worker_are_prefetched_beside_it(redis_server) -> None:  # noqa: ANN001
    """A prompt of at least ``kv_prefetch_min_tokens`` that goes to a prefill worker has its decode
    worker asked to prefetch it, before the prefill ends; shorter ones, recomputed ones, or with
    prefetching off (0) are not."""
    for min_tokens, policy, prefetched in ((150, "pull", ["r1"]), (0, "pull", []), (150, "recompute", [])):
        index = IndexConfig(redis_server.url, namespace=unique_namespace())
        workers = TimedWorkers(prefill_s=0, local_s=0, pull_s=0)
        config = RouterConfig(kv_policy=policy, kv_prefetch_min_tokens=min_tokens)
        core = RouterCore(config, CacheConfig(block_size=16), workers, PrefixLookup(index), StatsRecorder(index))

        async def serve() -> None:
            for rid, n in (("r0", 100), ("r1", 200)):
                async for _ in core.generate(RequestSpec(rid, tuple(range(n)), SamplingParams(max_tokens=1))):
                    pass

        try:
            asyncio.run(serve())
        finally:
            core.close()
        assert [rid for _, rid, _ in workers.prefetched] == prefetched
        assert all(d == "d0" and p == "p0" for d, _, p in workers.prefetched)
    with pytest.raises(ValueError, match="kv_prefetch_min_tokens"):
        RouterConfig(kv_prefetch_min_tokens=-1)
