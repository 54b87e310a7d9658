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
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

log = logging.getLogger(__name__)
_W = TypeVar("_W", bound="BackgroundWriter")

STATS_FIELDS: tuple[str, ...] = (
    "requests",
    "prompt_tokens",
    "prefix_hit_tokens",
    "prefill_computed_tokens",
    "transferred_tokens",
    "decode_local_hit_tokens",
    "blocks_stored",
    "blocks_evicted",
    "transfer_failures",
    "recomputed_tokens",
)
# Errors that mean "the index is unreachable or refuses writes", never the caller's fault.
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")  # no glob characters: read_stats SCANs by pattern


def now_ms() -> int:
    return int(time.time() * 1000)


def tenant_digest(cache_salt: str) -> str:
    """Tenant id in key names: ``xxh3_64`` of the UTF-8 salt as 16 hex chars (the salt never appears)."""
    return xxhash.xxh3_64_hexdigest(cache_salt.encode("utf-8"))


def hit_rate(counters: Mapping[str, int]) -> float:
    """``prefix_hit_tokens / prompt_tokens`` of summed counters (0.0 when nothing was prompted)."""
    prompt = counters.get("prompt_tokens", 0)
    return counters.get("prefix_hit_tokens", 0) / prompt if prompt else 0.0


@dataclass(frozen=True, repr=False)
class RedisIndexConfig:
    """Where the index lives and how its clients behave.

    ``url`` is handed to ``redis.Redis.from_url`` as is, so ``redis://:pw@host:port/db``,
    ``redis://user:pw@...`` and ``rediss://`` (TLS) work. ``repr`` hides the password.
    """

    url: str
    namespace: str = "pdserve"
    events_maxlen: int = 10000
    socket_timeout_s: float = 1.0  # bounds every Redis call, so a hung server costs at most this
    batch_max: int = 256  # events per pipeline round trip
    max_queue: int = 100_000  # queued writes beyond this are dropped (and covered by a republish)
    retry_initial_s: float = 0.05
    retry_max_s: float = 2.0

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {self.redacted_url!r}")
        if not _NAMESPACE_RE.match(self.namespace):
            raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}, got {self.namespace!r}")
        for name in ("events_maxlen", "batch_max", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("socket_timeout_s", "retry_initial_s", "retry_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.retry_initial_s > self.retry_max_s:
            raise ValueError("retry_initial_s must be <= retry_max_s")

    @property
    def redacted_url(self) -> str:
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return urlunsplit(parts._replace(netloc=netloc))

    def __repr__(self) -> str:
        return f"RedisIndexConfig(url={self.redacted_url!r}, namespace={self.namespace!r})"

    def client(self) -> redis.Redis:
        """A new client with str replies and one immediate retry (which re-dials a stale pooled socket)."""
        return redis.Redis.from_url(
            self.url,
            decode_responses=True,
            socket_timeout=self.socket_timeout_s,
            socket_connect_timeout=self.socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )

    # -- key names (design.md) ------------------------------------------------------------
    def block_key(self, block_hash: bytes) -> str:
        return f"{self.namespace}:block:{block_hash.hex()}"

    @property
    def events_key(self) -> str:
        return f"{self.namespace}:events"

    @property
    def workers_key(self) -> str:
        return f"{self.namespace}:workers"

    @property
    def stats_key(self) -> str:
        return f"{self.namespace}:stats"

    def worker_stats_key(self, worker_id: str) -> str:
        return f"{self.namespace}:stats:worker:{worker_id}"

    def tenant_stats_key(self, cache_salt: str) -> str:
        return f"{self.namespace}:stats:tenant:{tenant_digest(cache_salt)}"


class OutageTracker:
    """Logs an outage once (warning) and its end once (info); counts outages."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.outages = 0
        self.down_since: float | None = None

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, exc: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages += 1
            log.warning("%s: Redis unavailable (%s: %s); serving goes on without the index", self.what,
                        type(exc).__name__, exc)  # fmt: skip

    def ok(self) -> None:
        if self.down_since is not None:
            log.info("%s: Redis reachable again after %.1fs", self.what, time.monotonic() - self.down_since)
            self.down_since = None


class BackgroundWriter:
    """A queue the caller fills without blocking and a daemon thread that writes it in batches.

    Subclasses implement ``_write(pipe, batch)`` (queue the commands of a batch on a pipeline)
    and may override ``_dropped(batch)`` (remember what a batch that could not be written would
    have changed) and ``_resync(client)`` (write that back once Redis answers again). All three
    run on the writer thread; ``_dropped`` and the caller share ``self._cv``, which subclasses
    also use to guard their own state. On failure the whole queue is dropped (it is covered by the
    resync) and retried with exponential backoff; ``outages``, ``dropped_batches`` and
    ``dropped_items`` count what happened.
    """

    def __init__(self, config: RedisIndexConfig, name: str) -> None:
        self.config = config
        self.name = name
        self._client = config.client()
        self._cv = threading.Condition()
        self._items: deque = deque()
        self._unfinished = 0  # items enqueued and not yet written or dropped
        self._resync_pending = False
        self._busy = False  # the thread holds a batch or runs a resync (flush must wait for it)
        self._closed = False
        self._stop = threading.Event()
        self._outage = OutageTracker(name)
        self.dropped_batches = 0
        self.dropped_items = 0
        self.resyncs = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def outages(self) -> int:
        return self._outage.outages

    def _enqueue(self, item: object) -> None:
        """Queue one item; the caller holds ``self._cv``. Never blocks on I/O, never raises."""
        if self._closed:
            return
        if len(self._items) >= self.config.max_queue:
            # Redis is too slow to keep up: drop, and let a resync restore the state later.
            self._dropped([item])
            self.dropped_items += 1
            self._resync_pending = True
        else:
            self._items.append(item)
            self._unfinished += 1
        self._cv.notify_all()

    def _write(self, pipe: redis.client.Pipeline, batch: list) -> None:
        raise NotImplementedError

    def _dropped(self, batch: list) -> None:
        """Called with ``self._cv`` held for items that will never be written."""

    def _resync(self, client: redis.Redis) -> None:
        """Restore in Redis what dropped items would have written."""

    def _run(self) -> None:
        delay = self.config.retry_initial_s
        while True:
            with self._cv:
                while not self._items and not self._resync_pending and not self._closed:
                    self._cv.wait()
                if self._closed and (self._outage.down or not (self._items or self._resync_pending)):
                    return
                batch = [self._items.popleft() for _ in range(min(len(self._items), self.config.batch_max))]
                resync = self._resync_pending
                self._busy = True
            try:
                if resync:
                    with self._cv:
                        self._resync_pending = False  # a drop during the resync sets it again
                    self._resync(self._client)
                    self.resyncs += 1
                if batch:
                    pipe = self._client.pipeline(transaction=False)
                    self._write(pipe, batch)
                    pipe.execute()
                self._outage.ok()
                delay = self.config.retry_initial_s
                self._finish(len(batch))
            except Exception as exc:  # noqa: BLE001 - the writer thread must survive anything
                if not isinstance(exc, REDIS_ERRORS):
                    log.exception("%s: unexpected error writing to Redis; batch dropped", self.name)
                self._outage.failed(exc)
                with self._cv:
                    # The rest of the queue would fail too: drop it now, the resync covers it.
                    rest = list(self._items)
                    self._items.clear()
                    self._dropped(batch + rest)
                    self.dropped_batches += 1
                    self.dropped_items += len(batch) + len(rest)
                    self._resync_pending = True
                self._finish(len(batch) + len(rest))
                self._stop.wait(delay)
                delay = min(delay * 2, self.config.retry_max_s)

    def _finish(self, n: int) -> None:
        with self._cv:
            self._unfinished -= n
            self._busy = False
            self._cv.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued item is handled and nothing awaits a resync; False on timeout.

        During an outage this returns False (a resync is pending until Redis answers).
        """
        with self._cv:
            return self._cv.wait_for(
                lambda: self._unfinished == 0 and not self._resync_pending and not self._busy, timeout
            )

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued if Redis answers (bounded by ``timeout``), then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._stop.set()
        self._thread.join(timeout)
        self._client.close()

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    could not be written are kept and written when Redis returns, so totals survive an outage
    (a connection lost after EXEC was sent may count a batch twice).
    """

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
        self._client = config.client()
        self._outage = OutageTracker("prefix-lookup")
        self._retry_at = 0.0
        self._delay = config.retry_initial_s

    @property
    def outages(self) -> int:
        return self._outage.outages

    def longest_prefix(self, block_hashes: Sequence[bytes], worker_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Worker id -> number of leading blocks of ``block_hashes`` it holds, in one round trip.

        Without ``worker_ids`` only workers holding at least block 0 appear; with them, exactly those
        workers appear (0 when they hold nothing). Returns ``{}`` when Redis is unreachable (logged
        once per outage; during backoff Redis is not even tried), so the caller routes by load.
        """
        wanted = set(worker_ids) if worker_ids is not None else None
        result = dict.fromkeys(wanted, 0) if wanted is not None else {}
        if not block_hashes:
            return result
        if self._outage.down and time.monotonic() < self._retry_at:
            return {}
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
