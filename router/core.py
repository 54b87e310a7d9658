"""RouterCore: route one request through a prefill worker and a decode worker, stream its tokens.

A request's path reads top to bottom in ``_generate``: route (prefix lookup, pick workers) ->
prefill (first token, KV under a lease) -> decode with retry (another decode worker when one
fails before its first token). A ``RequestAccount`` (``router/accounting.py``) counts what it
did, once, when it ends; a ``_LeaseHold`` owns the prefill worker's lease on the router side
until a decode worker takes it over.

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
from pdserve.router.accounting import Outcome, RequestAccount, log_access
from pdserve.router.admission import Admission, Draining, Overloaded
from pdserve.router.config import RouterConfig
from pdserve.router.cost_model import CostModel
from pdserve.router.health import WorkerHealth
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policy import pick_worker
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec

logger = logging.getLogger(__name__)

__all__ = ["Outcome", "RouterCore", "StreamEvent", "WorkerClient", "WorkerUnavailableError"]


class WorkerUnavailableError(RuntimeError):
    """A worker died or cannot be reached."""


class WorkerClient(Protocol):
    prefill_ids: list[str]
    decode_ids: list[str]

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult: ...

    def decode(self, worker_id: str, spec: RequestSpec, prefill: PrefillResult | None) -> AsyncIterator[DecodeEvent]: ...

    def release(self, worker_id: str, lease_id: str) -> None:
        """Fire and forget: end a lease that no decode worker took over."""

    def prefetch(self, decode_id: str, spec: RequestSpec, prefill_id: str) -> None:
        """Fire and forget: have the decode worker pull the prompt's blocks from the prefill worker
        while it prefills them (a no-op where the client cannot, e.g. the prefill worker's address
        is not known yet)."""

    async def ping(self, worker_id: str) -> object:
        """Returns when the worker answers; raises when it cannot (asked only of workers that are down)."""


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
        self.cost = CostModel(fallback_threshold=config.local_prefill_threshold)
        self.health = WorkerHealth(lambda w: self.workers.ping(w), config.health_probe_interval_s,
                                   config.health_probe_timeout_s)  # fmt: skip
        self.metrics = metrics or RouterMetrics()
        self.metrics.watch_admission(lambda: self.admission.in_flight, lambda: self.admission.queued)

    def redis_outages(self) -> list[tuple[str, int]]:
        """(client, lifetime outages) of the router's Redis clients."""
        return [("prefix-lookup", self.lookup.outages), ("stats", self.stats.outages)]

    def close(self) -> None:
        self.health.close()
        self.lookup.close()
        self.stats.close()

    async def _prefill(self, spec: RequestSpec, p: str, work: int) -> PrefillResult | None:
        """Run the prefill on ``p``; None when that worker is unavailable (decode will prefill)."""
        self.prefill_load.add(p, work)
        t0 = time.perf_counter()
        try:
            result = await self.workers.prefill(p, spec)
            self.cost.observe_prefill(p, result.num_prompt_tokens - result.num_cached_tokens, time.perf_counter() - t0)
            return result
        except WorkerUnavailableError as exc:
            self.health.mark_down(p, exc.__cause__ or exc)  # Ray's error, for the log
            logger.warning("prefill worker %s unavailable; the decode worker prefills %s", p, spec.request_id)
            return None
        finally:
            self.prefill_load.add(p, -work)

    async def generate(self, spec: RequestSpec, outcome: Outcome | None = None) -> AsyncIterator[StreamEvent]:
        """Stream one request's tokens, once admission gives it a slot (``Overloaded`` /
        ``Draining`` otherwise, before any work). Counters go to Redis exactly once per request,
        when it ends (finished, failed or cancelled), credited to the worker that did the work. A
        lease that no decode worker took over is released when the request ends, whatever the reason."""
        t_arrive = time.perf_counter()
        async with contextlib.AsyncExitStack() as stack:
            try:
                await stack.enter_async_context(self.admission.slot(spec.cache_salt or ""))
            except (Overloaded, Draining) as exc:
                reason = "overloaded" if isinstance(exc, Overloaded) else "draining"
                self.metrics.rejected.labels(reason=reason).inc()
                log_access(spec, f"rejected:{reason}", {}, 0, None, t_arrive, t_arrive, self.config.access_log)
                raise
            t_admit = time.perf_counter()
            self.metrics.queue.observe(t_admit - t_arrive)
            account = RequestAccount(spec, t_arrive, t_admit, self.metrics, self.stats, self.config.access_log)
            with account.open(outcome):
                async with contextlib.aclosing(self._generate(spec, account)) as events:
                    async for event in events:
                        yield event

    async def _generate(self, spec: RequestSpec, account: RequestAccount) -> AsyncIterator[StreamEvent]:
        route = await self._route(spec)
        account.front_worker = route.decode
        # The decode worker's load counts the request from now (not only once its decode starts), so
        # that requests arriving together are spread over the decode workers while they prefill.
        footprint = self._decode_footprint(spec)
        self.decode_load.add(route.decode, footprint)
        try:
            prefill = await self._prefill_first(spec, route)
        finally:
            self.decode_load.add(route.decode, -footprint)
        async with _LeaseHold(self.workers, prefill, account) as lease:
            if prefill is not None:
                ttft = account.prefilled(prefill)
                first_lp = None if prefill.first_logprobs is None else [prefill.first_logprobs]
                yield StreamEvent([prefill.first_token], prefill.finished, prefill.finish_reason, ttft,
                                  dict(account.usage), first_lp)  # fmt: skip
                if prefill.finished:
                    return
            async for event in self._decode_with_retry(spec, route, prefill, account, lease):
                yield event

    async def _route(self, spec: RequestSpec) -> _Route:
        """Who holds the prompt's longest prefix (Redis), and the decode worker that should take it."""
        cfg, bs = self.config, self.cache.block_size
        hashes = block_hashes(spec.prompt_token_ids, bs, self.cache.hash_seed, spec.cache_salt)
        ids = self.workers.prefill_ids + self.workers.decode_ids
        overlaps = await asyncio.to_thread(self.lookup.longest_prefix, hashes, ids) if hashes else {}
        down = self.health.down()
        d = pick_worker(self.workers.decode_ids, overlaps, self.decode_load.queued, bs, cfg.load_weight, exclude=down)
        if d is None:
            if not self.workers.decode_ids:
                raise WorkerUnavailableError("no decode worker is registered")
            raise WorkerUnavailableError(
                f"no decode worker is available: {', '.join(sorted(down & set(self.workers.decode_ids)))} down")
        return _Route(overlaps, d)

    async def _prefill_first(self, spec: RequestSpec, route: _Route) -> PrefillResult | None:
        """The prefill on the best prefill worker; None when the decode worker prefills itself (what
        it lacks is short) or the prefill worker is unavailable."""
        cfg, bs = self.config, self.cache.block_size
        prompt_len = len(spec.prompt_token_ids)
        p = pick_worker(self.workers.prefill_ids, route.overlaps, self.prefill_load.queued, bs, cfg.load_weight,
                        exclude=self.health.down())  # fmt: skip
        if p is None:
            return None  # no prefill worker up: the decode worker prefills
        missing_on_decode = prompt_len - route.overlaps.get(route.decode, 0) * bs
        computed_on_prefill = prompt_len - route.overlaps.get(p, 0) * bs
        if not self._pulls(route.decode, missing_on_decode, p, computed_on_prefill):
            return None
        min_tokens = cfg.kv_prefetch_min_tokens
        if min_tokens and computed_on_prefill >= min_tokens and missing_on_decode >= min_tokens:
            self.workers.prefetch(route.decode, spec, p)  # beside the prefill: its blocks as they are computed
        return await self._prefill(spec, p, computed_on_prefill)

    def _pulls(self, d: str, missing_on_decode: int, p: str, computed_on_prefill: int) -> bool:
        """The KV policy (``router.kv_policy``): prefill on ``p`` and pull, or prefill on ``d``?"""
        policy = self.config.kv_policy
        if policy == "auto":
            return self.cost.choose(d, missing_on_decode, p, computed_on_prefill).pull
        if policy == "threshold":
            # Conditional disaggregation: what the decode worker lacks is short enough to prefill there.
            return missing_on_decode > self.config.local_prefill_threshold
        return policy == "pull"

    async def _decode_with_retry(self, spec: RequestSpec, route: _Route, prefill: PrefillResult | None,
                                 account: RequestAccount, lease: _LeaseHold) -> AsyncIterator[StreamEvent]:  # fmt: skip
        """Stream the decode worker's tokens; a worker that fails before its first decode token is
        replaced by the next best worker that is up (up to ``decode_retries``), one that fails later
        fails the request. A failed worker is marked down (``WorkerHealth``) either way."""
        cfg, bs = self.config, self.cache.block_size
        tried: set[str] = set()
        footprint = self._decode_footprint(spec)
        nxt: str | None = route.decode
        while nxt is not None:
            d = nxt
            tried.add(d)
            self.decode_load.add(d, footprint)
            decoded = 0
            t0 = time.perf_counter()
            try:
                async with contextlib.aclosing(self.workers.decode(d, spec, prefill)) as stream:
                    async for ev in stream:
                        if not decoded:
                            self._observe_decode_start(d, spec, prefill, ev, time.perf_counter() - t0)
                        decoded += len(ev.token_ids)
                        ttft = account.decoded(ev, d, remote_prefill=prefill is not None)
                        yield StreamEvent(list(ev.token_ids), ev.finished, ev.finish_reason, ttft, dict(account.usage),
                                          None if ev.logprobs is None else list(ev.logprobs))  # fmt: skip
                        if ev.finished:
                            return
                raise WorkerUnavailableError(f"decode worker {d} ended the stream of {spec.request_id} early")
            except WorkerUnavailableError as exc:
                self.health.mark_down(d, exc.__cause__ or exc)  # Ray's error, for the log
                lease.taker_failed()
                nxt = pick_worker(self.workers.decode_ids, route.overlaps, self.decode_load.queued, bs,
                                  cfg.load_weight, exclude=frozenset(tried) | self.health.down())  # fmt: skip
                if decoded or nxt is None or len(tried) > cfg.decode_retries:
                    raise WorkerUnavailableError(
                        f"decode worker {d} failed after {account.sent} token(s) of request {spec.request_id}: {exc}"
                    ) from exc
                logger.warning("decode worker %s failed before any decode token; retrying on %s", d, nxt)
            finally:
                self.decode_load.add(d, -footprint)


    def _decode_footprint(self, spec: RequestSpec) -> int:
        """The tokens a request adds to its decode worker's load: its prompt and at most
        ``max_output_load_tokens`` of its output."""
        return len(spec.prompt_token_ids) + min(spec.params.max_tokens, self.config.max_output_load_tokens)

    def _observe_decode_start(self, d: str, spec: RequestSpec, prefill: PrefillResult | None, ev: DecodeEvent,
                              seconds: float) -> None:  # fmt: skip
        """What the decode worker's first event measured, from the call to it (``seconds``): its own
        prefill (no remote prefill), or taking the KV over (the pull with everything around it, up to
        the first decode step: what the client waits for on that path, beside the prefill)."""
        if prefill is None:
            self.cost.observe_prefill(d, len(spec.prompt_token_ids) - ev.num_local_hit_tokens, seconds)
        elif ev.pull_bytes:
            self.cost.observe_pull(prefill.worker_id, d, ev.pull_bytes, ev.num_transferred_tokens, seconds)


@dataclass(frozen=True)
class _Route:
    overlaps: dict[str, int]  # worker id -> blocks of the prompt's prefix it holds (Redis)
    decode: str  # the decode worker picked first


class _LeaseHold:
    """The router's side of a prefill worker's lease: from the prefill's result until a decode
    worker takes it over (reports continuing after the remote prefill; its own ``DecodeCall``
    settles it then). If none did when the request ends (finished on the first token, cancelled,
    every decode worker failed), or a decode worker that took it over failed (it died with the
    lease unsettled), the lease is released here. Release is idempotent on the holder, deferred
    there while a pull still streams, and the lease's TTL is the backstop."""

    def __init__(self, workers: WorkerClient, prefill: PrefillResult | None, account: RequestAccount) -> None:
        self._workers = workers
        self._prefill = prefill
        self._account = account
        self._taker_failed = False

    def taker_failed(self) -> None:
        """A decode worker given this lease failed: it may never settle it."""
        self._taker_failed = True

    async def __aenter__(self) -> _LeaseHold:
        return self

    async def __aexit__(self, *exc: object) -> None:
        p = self._prefill
        if p is not None and p.lease_id and (self._taker_failed or not self._account.decode_took_over):
            self._workers.release(p.worker_id, p.lease_id)
