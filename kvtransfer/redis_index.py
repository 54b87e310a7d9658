"""The Redis block index: who holds which block, the events stream, hit-rate counters.

Keys (design.md "Redis"; ``{ns}`` is ``RedisIndexConfig.namespace``, default ``pdserve``):

- ``{ns}:block:<32 hex>`` hash: worker id -> unix ms when that worker stored the block.
- ``{ns}:events`` stream, capped with ``MAXLEN ~ events_maxlen`` (approximate: Redis trims whole
  stream nodes, so the length may exceed the cap by up to one node, 100 entries by default).
  Every entry has ``type`` (``BlockStored``/``BlockRemoved``/``AllBlocksCleared``), ``worker``,
  ``medium`` and ``ts_ms``. BlockStored adds ``block_hashes`` (JSON list of 32-hex strings),
  ``parent_block_hash`` (32 hex, ``""`` for a chain root), ``token_ids`` (JSON list),
  ``block_size`` and ``lora_name`` (``""`` if none); BlockRemoved adds ``block_hashes``.
- ``{ns}:stats``, ``{ns}:stats:worker:<id>``, ``{ns}:stats:tenant:<digest>`` hashes of the
  ``STATS_FIELDS`` counters; ``<digest>`` is ``tenant_digest(cache_salt)``.

Redis is an index, not the source of truth: writers never block or raise in the caller (a
background thread writes), readers return "nothing known" when Redis is down, and both log an
outage once and count it. A publisher republishes everything it holds when Redis returns.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import redis

from engine.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvtransfer.redis_common import (
    REDIS_ERRORS,
    STATS_FIELDS,
    OutageTracker,
    RedisIndexConfig,
    hit_rate,
    now_ms,
    tenant_digest,
)
from kvtransfer.redis_writer import BackgroundWriter

log = logging.getLogger(__name__)

__all__ = [
    "KVEventPublisher",
    "PrefixLookup",
    "RedisIndexConfig",
    "StatsRecorder",
    "STATS_FIELDS",
    "REDIS_ERRORS",
    "hit_rate",
    "read_stats",
    "remove_worker_blocks",
    "tenant_digest",
]


class KVEventPublisher(BackgroundWriter):
    """Event sink of one worker's BlockPool: ``pool.add_event_sink(publisher)``.

    Calling it never blocks on I/O and never raises. It tracks the hashes the worker holds (as the
    events say) so that after an outage it can rebuild its holder fields: HSET every held hash,
    HDEL every hash whose removal was lost. Also bumps ``blocks_stored``/``blocks_evicted`` on the
    cluster and worker stats. Attach it before the pool emits its first event.
    """

    def __init__(self, config: RedisIndexConfig, worker_id: str) -> None:
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        self.worker_id = worker_id
        self._held: dict[bytes, int] = {}  # hash -> unix ms stored
        self._lost_removals: set[bytes] = set()
        self._lost_counters: Counter[str] = Counter()
        super().__init__(config, f"kv-publisher[{worker_id}]")

    @property
    def held_hashes(self) -> set[bytes]:
        with self._cv:
            return set(self._held)

    def __call__(self, event: KVCacheEvent) -> None:
        try:
            ms = now_ms()
            with self._cv:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        self._held[h] = ms
                    self._enqueue((event, ms, ()))
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        self._held.pop(h, None)
                    self._enqueue((event, ms, ()))
                elif isinstance(event, AllBlocksCleared):
                    # The hashes to HDEL are the ones held now; the writer thread cannot know them later.
                    cleared = tuple(self._held)
                    self._held.clear()
                    self._enqueue((event, ms, cleared))
        except Exception:  # noqa: BLE001 - a sink must never break the pool
            log.exception("%s: event dropped", self.name)

    def _write(self, pipe: redis.client.Pipeline, batch: list) -> None:
        cfg, wid = self.config, self.worker_id
        stored = evicted = 0
        for event, ms, cleared in batch:
            fields: dict[str, str | int] = {"type": type(event).__name__, "worker": wid, "medium": event.medium,
                                            "ts_ms": ms}  # fmt: skip
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    pipe.hset(cfg.block_key(h), wid, ms)
                stored += len(event.block_hashes)
                parent = event.parent_block_hash
                fields.update(
                    block_hashes=json.dumps([h.hex() for h in event.block_hashes]),
                    parent_block_hash=parent.hex() if parent is not None else "",
                    token_ids=json.dumps(list(event.token_ids)),
                    block_size=event.block_size,
                    lora_name=event.lora_name or "",
                )
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    pipe.hdel(cfg.block_key(h), wid)
                evicted += len(event.block_hashes)
                fields["block_hashes"] = json.dumps([h.hex() for h in event.block_hashes])
            else:
                for h in cleared:
                    pipe.hdel(cfg.block_key(h), wid)
            pipe.xadd(cfg.events_key, fields, maxlen=cfg.events_maxlen, approximate=True)
        self._incr_counters(pipe, {"blocks_stored": stored, "blocks_evicted": evicted})

    def _incr_counters(self, pipe: redis.client.Pipeline, counters: Mapping[str, int]) -> None:
        for key in (self.config.stats_key, self.config.worker_stats_key(self.worker_id)):
            for name, n in counters.items():
                if n:
                    pipe.hincrby(key, name, n)

    def _dropped(self, batch: list) -> None:
        for event, _ms, cleared in batch:
            if isinstance(event, BlockStored):
                self._lost_counters["blocks_stored"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._lost_removals.update(event.block_hashes)
                self._lost_counters["blocks_evicted"] += len(event.block_hashes)
            else:
                self._lost_removals.update(cleared)

    def _resync(self, client: redis.Redis) -> None:
        with self._cv:
            held = dict(self._held)
            removals = self._lost_removals - held.keys()
            counters = dict(self._lost_counters)
            self._lost_removals = set()
            self._lost_counters = Counter()
        try:
            pipe = client.pipeline(transaction=False)
            for h in removals:
                pipe.hdel(self.config.block_key(h), self.worker_id)
            for h, ms in held.items():
                pipe.hset(self.config.block_key(h), self.worker_id, ms)
            self._incr_counters(pipe, counters)
            pipe.execute()
        except BaseException:
            with self._cv:  # not written: keep it for the next attempt
                self._lost_removals |= removals
                self._lost_counters.update(counters)
            raise
        log.info("%s: republished %d held blocks (%d lost removals)", self.name, len(held), len(removals))


class StatsRecorder(BackgroundWriter):
    """HINCRBY the ``STATS_FIELDS`` counters on the cluster, worker and tenant hashes.

    ``record`` never blocks on I/O and never raises on Redis trouble (unknown counter names do raise:
    that is a bug). A batch's increments are summed and written in one MULTI/EXEC; increments that
    could not be written are kept and written when Redis returns, so totals survive an outage.
    A batch is never retried at once (its client has no retries) and waits up to 5 s for Redis
    (off the serving path), but a batch whose EXEC ran and whose reply was then lost (the
    connection dropped, or no answer within 5 s) is written again by the resync and counted
    twice: a lost reply cannot be told from a lost command.
    """

    client_retries = 0
    client_timeout_s = 5.0

    def __init__(self, config: RedisIndexConfig, worker_id: str | None = None) -> None:
        self.worker_id = worker_id
        self._lost: Counter[tuple[str, str]] = Counter()
        super().__init__(config, f"stats[{worker_id or 'cluster'}]")

    def record(self, counters: Mapping[str, int], cache_salt: str | None = None,
               worker_id: str | None = None) -> None:  # fmt: skip
        """Add ``counters`` to the cluster stats, the worker's (``worker_id`` or the recorder's) and,
        given a ``cache_salt``, the tenant's."""
        unknown = set(counters) - set(STATS_FIELDS)
        if unknown:
            raise ValueError(f"unknown stats counters {sorted(unknown)}; known: {STATS_FIELDS}")
        cfg = self.config
        keys = [cfg.stats_key]
        wid = worker_id or self.worker_id
        if wid:
            keys.append(cfg.worker_stats_key(wid))
        if cache_salt is not None:
            keys.append(cfg.tenant_stats_key(cache_salt))
        incr = Counter({(k, name): int(n) for k in keys for name, n in counters.items() if n})
        if incr:
            with self._cv:
                self._enqueue(incr)

    def _write(self, pipe: redis.client.Pipeline, batch: list) -> None:
        total: Counter[tuple[str, str]] = Counter()
        for incr in batch:
            total.update(incr)
        pipe.multi()  # all counters of a batch or none: sums stay consistent across keys
        for (key, name), n in total.items():
            pipe.hincrby(key, name, n)

    def _dropped(self, batch: list) -> None:
        for incr in batch:
            self._lost.update(incr)

    def _resync(self, client: redis.Redis) -> None:
        with self._cv:
            lost, self._lost = self._lost, Counter()
        try:
            if lost:
                pipe = client.pipeline(transaction=True)
                for (key, name), n in lost.items():
                    pipe.hincrby(key, name, n)
                pipe.execute()
        except BaseException:
            with self._cv:
                self._lost.update(lost)
            raise


def read_stats(client: redis.Redis, namespace: str = "pdserve") -> dict:
    """Counters as ``{"cluster": {...}, "hit_rate": float, "workers": {id: {...}}, "tenants": {digest: {...}}}``.

    Every counter dict has all ``STATS_FIELDS`` as ints; ``hit_rate`` is the cluster's ratio of sums.
    Raises on Redis errors (it is for ``pdserve stats`` and tests, not the serving path).
    """

    def as_str(x: str | bytes) -> str:
        return x.decode() if isinstance(x, bytes) else x

    def counters(raw: Mapping) -> dict[str, int]:
        out = dict.fromkeys(STATS_FIELDS, 0)
        out.update({as_str(k): int(v) for k, v in raw.items()})
        return out

    out: dict = {"cluster": counters(client.hgetall(f"{namespace}:stats")), "workers": {}, "tenants": {}}
    out["hit_rate"] = hit_rate(out["cluster"])
    for kind in ("worker", "tenant"):
        prefix = f"{namespace}:stats:{kind}:"
        keys = sorted(as_str(k) for k in client.scan_iter(match=prefix + "*", count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        for key, raw in zip(keys, pipe.execute() if keys else []):
            out[f"{kind}s"][key[len(prefix) :]] = counters(raw)
    return out


def remove_worker_blocks(client: redis.Redis, namespace: str, worker_id: str) -> int:
    """HDEL ``worker_id`` from every block key (a worker restarting or gone); returns fields removed.

    A SCAN over all block keys: for worker start-up or clean-up, not the serving path.
    """
    removed = 0
    pipe = client.pipeline(transaction=False)
    for i, key in enumerate(client.scan_iter(match=f"{namespace}:block:*", count=1000), 1):
        pipe.hdel(key, worker_id)
        if i % 1000 == 0:
            removed += sum(pipe.execute())
    removed += sum(pipe.execute())
    return removed


class PrefixLookup:
    """Router side: which workers hold how long a prefix of a block-hash chain."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self.config = config
        # A short timeout and no retry: a hung Redis must cost a request little, not 2 x 1 s.
        self._client = config.client(retries=0, timeout_s=config.lookup_timeout_s)
        self._outage = OutageTracker("prefix-lookup")
        self._retry_at = 0.0
        self._delay = config.retry_initial_s
        self._probe = threading.Lock()  # during an outage one lookup probes, the others skip Redis

    @property
    def outages(self) -> int:
        return self._outage.outages

    def longest_prefix(self, block_hashes: Sequence[bytes], worker_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Worker id -> number of leading blocks of ``block_hashes`` it holds, in one round trip.

        Without ``worker_ids`` only workers holding at least block 0 appear; with them, exactly those
        workers appear (0 when they hold nothing). Returns ``{}`` when Redis is unreachable (logged
        once per outage; during backoff Redis is not even tried, and while one lookup probes whether
        it is back the others do not wait for it), so the caller routes by load. A lookup costs at
        most ``lookup_timeout_s`` of waiting on Redis.
        """
        wanted = set(worker_ids) if worker_ids is not None else None
        result = dict.fromkeys(wanted, 0) if wanted is not None else {}
        if not block_hashes:
            return result
        probing = False
        if self._outage.down:
            if time.monotonic() < self._retry_at or not self._probe.acquire(blocking=False):
                return {}
            probing = True
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in block_hashes:
                pipe.hkeys(self.config.block_key(h))
            rows = pipe.execute()
        except REDIS_ERRORS as exc:
            self._outage.failed(exc)
            self._retry_at = time.monotonic() + self._delay
            self._delay = min(self._delay * 2, self.config.retry_max_s)
            return {}
        finally:
            if probing:
                self._probe.release()
        self._outage.ok()
        self._delay = self.config.retry_initial_s
        alive = set(rows[0]) if wanted is None else set(rows[0]) & wanted
        for depth, row in enumerate(rows, 1):
            if depth > 1:
                alive &= set(row)
            if not alive:
                break
            for w in alive:
                result[w] = depth
        return result

    def close(self) -> None:
        self._client.close()
