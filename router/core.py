"""RouterCore: route one request through a prefill worker and a decode worker, stream its tokens.

Plain Python over two narrow dependencies: a ``WorkerClient`` (how to call workers;
Ray in production) and a ``PrefixLookup`` (Redis). The gRPC servicer converts proto
messages at the edge and iterates ``RouterCore.generate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.config import CacheConfig
from pdserve.engine.kvcache.hashing import block_hashes
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvindex.stats import StatsRecorder
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.policy import pick_worker, prefill_locally
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec

logger = logging.getLogger(__name__)


class WorkerUnavailableError(RuntimeError):
    """A worker died or cannot be reached."""


class WorkerClient(Protocol):
    prefill_ids: list[str]
    decode_ids: list[str]

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult: ...

    def decode(self, worker_id: str, spec: RequestSpec, prefill: PrefillResult | None) -> AsyncIterator[DecodeEvent]: ...

    def release(self, worker_id: str, lease_id: str) -> None:
        """Fire and forget: end a lease that no decode worker will pull."""


@dataclass
class StreamEvent:
    """New tokens of one request. ``usage`` (prompt, cached and transferred tokens) is what is
    known so far, final when ``finished``; ``ttft_ms`` is set on the first event with a token."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    ttft_ms: float | None = None
    usage: dict[str, int] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the params ask for them


@dataclass
class _Load:
    queued: dict[str, int] = field(default_factory=dict)

    def add(self, w: str, n: int) -> None:
        self.queued[w] = self.queued.get(w, 0) + n


class RouterCore:
    """``cache`` is the workers' cache config: its block size and hash seed give the block
    hashes the router looks up in the index."""

    def __init__(
        self, config: RouterConfig, cache: CacheConfig, workers: WorkerClient, lookup: PrefixLookup,
        stats: StatsRecorder,
    ) -> None:  # fmt: skip
        self.config = config
        self.cache = cache
        self.workers = workers
        self.lookup = lookup
        self.stats = stats
        self.prefill_load = _Load()
        self.decode_load = _Load()
        self.admission = Admission(config.max_in_flight, config.max_in_flight_per_tenant, config.max_queued,
                                   config.queue_timeout_s)  # fmt: skip

    def close(self) -> None:
        self.lookup.close()
        self.stats.close()

    async def _prefill(self, spec: RequestSpec, p: str, work: int) -> PrefillResult | None:
        """Run the prefill on ``p``; None when that worker is unavailable (decode will prefill)."""
        self.prefill_load.add(p, work)
        try:
            return await self.workers.prefill(p, spec)
        except WorkerUnavailableError as exc:
            logger.warning("prefill worker %s unavailable (%s); the decode worker prefills %s", p, exc, spec.request_id)
            return None
        finally:
            self.prefill_load.add(p, -work)

    async def generate(self, spec: RequestSpec) -> AsyncIterator[StreamEvent]:
        """Stream one request's tokens, once admission gives it a slot (``Overloaded`` /
        ``Draining`` otherwise, before any work). Counters go to Redis exactly once per request,
        when it ends (finished, failed or cancelled), credited to the worker that did the work. A
        lease that no decode worker pulled is released when the request ends, whatever the reason."""
        async with self.admission.slot(spec.cache_salt or ""):
            async with contextlib.aclosing(self._generate(spec)) as events:
                async for event in events:
                    yield event

    async def _generate(self, spec: RequestSpec) -> AsyncIterator[StreamEvent]:
        cfg = self.config
        bs = self.cache.block_size
        t0 = time.perf_counter()
        prompt_len = len(spec.prompt_token_ids)
        usage = {"prompt_tokens": prompt_len, "cached_tokens": 0, "transferred_tokens": 0}
        front = {"requests": 1, "prompt_tokens": prompt_len, "prefix_hit_tokens": 0}  # who computed the prompt
        back: dict[str, int] = {}  # what the decode worker reused or pulled
        front_worker = self.workers.decode_ids[0]
        prefill: PrefillResult | None = None
        d = front_worker
        sent = 0
        try:
            hashes = block_hashes(spec.prompt_token_ids, bs, self.cache.hash_seed, spec.cache_salt)
            ids = self.workers.prefill_ids + self.workers.decode_ids
            overlaps = await asyncio.to_thread(self.lookup.longest_prefix, hashes, ids) if hashes else {}
            picked = pick_worker(
                self.workers.decode_ids, overlaps, self.decode_load.queued, bs, cfg.load_weight
            )
            assert picked is not None
            d = front_worker = picked
            if not prefill_locally(prompt_len, overlaps.get(d, 0), bs, cfg.local_prefill_threshold):
                p = pick_worker(
                    self.workers.prefill_ids, overlaps, self.prefill_load.queued, bs, cfg.load_weight
                )
                assert p is not None
                prefill = await self._prefill(spec, p, prompt_len - overlaps.get(p, 0) * bs)
            if prefill is not None:
                front_worker = prefill.worker_id
                usage["cached_tokens"] = front["prefix_hit_tokens"] = prefill.num_cached_tokens
                ttft = (time.perf_counter() - t0) * 1000
                sent = 1
                first_lp = None if prefill.first_logprobs is None else [prefill.first_logprobs]
                yield StreamEvent([prefill.first_token], prefill.finished, prefill.finish_reason, ttft, dict(usage),
                                  first_lp)  # fmt: skip
                if prefill.finished:
                    return

            tried: set[str] = set()
            footprint = prompt_len + min(spec.params.max_tokens, cfg.max_output_load_tokens)
            while True:
                cur = d
                tried.add(cur)
                if prefill is None:
                    front_worker = cur
                self.decode_load.add(cur, footprint)
                decoded = 0
                try:
                    async with contextlib.aclosing(self.workers.decode(cur, spec, prefill)) as stream:
                        async for ev in stream:
                            decoded += len(ev.token_ids)
                            if prefill is None:
                                usage["cached_tokens"] = front["prefix_hit_tokens"] = ev.num_local_hit_tokens
                            else:
                                back = {
                                    "transferred_tokens": ev.num_transferred_tokens,
                                    "decode_local_hit_tokens": ev.num_local_hit_tokens,
                                }
                            usage["transferred_tokens"] = ev.num_transferred_tokens
                            ttft = (time.perf_counter() - t0) * 1000 if sent == 0 and ev.token_ids else None
                            sent += len(ev.token_ids)
                            yield StreamEvent(
                                list(ev.token_ids), ev.finished, ev.finish_reason, ttft, dict(usage),
                                None if ev.logprobs is None else list(ev.logprobs),
                            )  # fmt: skip
                            if ev.finished:
                                return
                    raise WorkerUnavailableError(f"decode worker {cur} ended the stream of {spec.request_id} early")
                except WorkerUnavailableError as exc:
                    nxt = pick_worker(
                        self.workers.decode_ids, overlaps, self.decode_load.queued, bs, cfg.load_weight,
                        exclude=frozenset(tried),
                    )  # fmt: skip
                    if decoded or nxt is None or len(tried) > cfg.decode_retries:
                        raise WorkerUnavailableError(
                            f"decode worker {cur} failed after {sent} token(s) of request {spec.request_id}: {exc}"
                        ) from exc
                    logger.warning("decode worker %s failed before any decode token; retrying on %s", cur, nxt)
                    d = nxt
                finally:
                    self.decode_load.add(cur, -footprint)
        finally:
            if prefill is not None and prefill.lease_id and not back:
                # No decode worker reported pulling it (cancelled, failed, or never started):
                # release it now. Idempotent, and deferred while a pull still streams.
                self.workers.release(prefill.worker_id, prefill.lease_id)
            self.stats.record(front, spec.cache_salt, front_worker)
            if back:
                self.stats.record(back, spec.cache_salt, d)
