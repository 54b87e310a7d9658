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
from pdserve.kvindex.config import tenant_digest
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvindex.stats import StatsRecorder
from pdserve.router.admission import Admission, Draining, Overloaded
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import pick_worker, prefill_locally
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec

logger = logging.getLogger(__name__)
access_log = logging.getLogger("pdserve.access")


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
class Outcome:
    """How a consumer that stopped reading ended the request (a stop string it found ends it
    with ``"stop"``); without it, a closed stream counts as the client leaving (``"abort"``)."""

    finish_reason: str | None = None


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
        stats: StatsRecorder, metrics: RouterMetrics | None = None,
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
        self.metrics = metrics or RouterMetrics()
        self.metrics.watch_admission(lambda: self.admission.in_flight, lambda: self.admission.queued)

    def redis_outages(self) -> list[tuple[str, int]]:
        """(client, lifetime outages) of the router's Redis clients."""
        return [("prefix-lookup", self.lookup.outages), ("stats", self.stats.outages)]

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

    async def generate(self, spec: RequestSpec, outcome: Outcome | None = None) -> AsyncIterator[StreamEvent]:
        """Stream one request's tokens, once admission gives it a slot (``Overloaded`` /
        ``Draining`` otherwise, before any work). Counters go to Redis exactly once per request,
        when it ends (finished, failed or cancelled), credited to the worker that did the work. A
        lease that no decode worker pulled is released when the request ends, whatever the reason."""
        t_arrive = time.perf_counter()
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(self.admission.slot(spec.cache_salt or ""))
            except (Overloaded, Draining) as exc:
                reason = "overloaded" if isinstance(exc, Overloaded) else "draining"
                self.metrics.rejected.labels(reason=reason).inc()
                self._access(spec, f"rejected:{reason}", {}, 0, None, t_arrive, t_arrive)
                raise
            t_admit = time.perf_counter()
            self.metrics.queue.observe(t_admit - t_arrive)
            async with contextlib.aclosing(self._generate(spec, t_arrive, t_admit, outcome)) as events:
                async for event in events:
                    yield event

    def _access(self, spec: RequestSpec, status: str, usage: dict[str, int], generated: int, ttft_ms: float | None,
                t_arrive: float, t_admit: float) -> None:  # fmt: skip
        """One access-log line per request (logger ``pdserve.access``); its fields are record
        attributes, which a JSON log shows as keys. No prompt text: the tenant is a digest."""
        if not (self.config.access_log and access_log.isEnabledFor(logging.INFO)):
            return
        now = time.perf_counter()
        fields = {
            "request_id": spec.request_id,
            "tenant": tenant_digest(spec.cache_salt) if spec.cache_salt is not None else "-",
            "status": status,
            "prompt_tokens": len(spec.prompt_token_ids),
            "cached_tokens": usage.get("cached_tokens", 0),
            "transferred_tokens": usage.get("transferred_tokens", 0),
            "generated_tokens": generated,
            "ttft_ms": None if ttft_ms is None else round(ttft_ms, 2),
            "queue_ms": round((t_admit - t_arrive) * 1000, 2),
            "e2e_ms": round((now - t_arrive) * 1000, 2),
        }
        access_log.info("request %s %s", spec.request_id, status, extra=fields)

    async def _generate(self, spec: RequestSpec, t0: float, t_admit: float,
                        outcome: Outcome | None) -> AsyncIterator[StreamEvent]:  # fmt: skip
        cfg = self.config
        bs = self.cache.block_size
        m = self.metrics
        status = "abort"  # until it finishes or fails
        first_ms: float | None = None
        last_t = t0
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
                last_t = time.perf_counter()
                ttft = first_ms = (last_t - t0) * 1000
                m.ttft.observe(ttft / 1000)
                sent = 1
                if prefill.finished:
                    status = prefill.finish_reason or "stop"
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
                            ttft = None
                            if ev.token_ids:
                                now = time.perf_counter()
                                if sent == 0:
                                    ttft = first_ms = (now - t0) * 1000
                                    m.ttft.observe(ttft / 1000)
                                    m.observe_token_gap(0.0, len(ev.token_ids) - 1)  # arrived with the first
                                else:
                                    m.observe_token_gap(now - last_t, len(ev.token_ids))
                                last_t = now
                            sent += len(ev.token_ids)
                            if ev.finished:
                                status = ev.finish_reason or "stop"
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
        except (GeneratorExit, asyncio.CancelledError):
            if status == "abort" and outcome is not None and outcome.finish_reason:
                status = outcome.finish_reason  # the consumer ended it (a stop string), not the client
            raise
        except BaseException:
            if status == "abort":
                status = "error"
            raise
        finally:
            m.observe_end(status, prompt_len, sent,
                          usage["cached_tokens"], usage["transferred_tokens"], time.perf_counter() - t0)
            self._access(spec, status, usage, sent, first_ms, t0, t_admit)
            if prefill is not None and prefill.lease_id and not back:
                # No decode worker reported pulling it (cancelled, failed, or never started):
                # release it now. Idempotent, and deferred while a pull still streams.
                self.workers.release(prefill.worker_id, prefill.lease_id)
            self.stats.record(front, spec.cache_salt, front_worker)
            if back:
                self.stats.record(back, spec.cache_salt, d)
