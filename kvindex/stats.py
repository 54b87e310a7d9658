"""Hit-rate counters: ``StatsRecorder`` (writes) and ``read_stats`` (reads).

The counters of docs/redis.md live in the hashes ``{ns}:stats`` (cluster),
``{ns}:stats:worker:<id>`` and ``{ns}:stats:tenant:<digest>`` (``tenant_digest(cache_salt)``).
The hit rate is always ``prefix_hit_tokens / prompt_tokens`` of summed counters.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping

import redis

from pdserve.kvindex.config import IndexConfig, tenant_digest
from pdserve.kvindex.writer import BackgroundWriter

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


def hit_rate(counters: Mapping[str, int]) -> float:
    """``prefix_hit_tokens / prompt_tokens`` of summed counters (0.0 when nothing was prompted)."""
    prompt = counters.get("prompt_tokens", 0)
    return counters.get("prefix_hit_tokens", 0) / prompt if prompt else 0.0


# Counters (key, field) an outage keeps for the resync, at most (about 200 bytes each).
MAX_LOST_COUNTERS = 20_000


class StatsRecorder(BackgroundWriter):
    """HINCRBY the ``STATS_FIELDS`` counters on the cluster, worker and tenant hashes.

    ``record`` never blocks on I/O and never raises on Redis trouble (unknown counter names do raise:
    that is a bug). A batch's increments are summed and written in one MULTI/EXEC; increments that
    could not be written are kept and written when Redis returns, so totals survive an outage
    (the cluster's and the workers' whole; tenants' and time buckets' within ``MAX_LOST_COUNTERS``).
    A tenant's hash expires ``stats_tenant_ttl_s`` after its last write, a time bucket's
    ``stats_retention_s`` after.
    A batch is never retried at once (its client has no retries) and waits up to 5 s for Redis
    (off the serving path), but a batch whose EXEC ran and whose reply was then lost (the
    connection dropped, or no answer within 5 s) is written again by the resync and counted
    twice: a lost reply cannot be told from a lost command.
    """

    client_retries = 0
    client_timeout_s = 5.0

    def __init__(self, config: IndexConfig, worker_id: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        """``clock``: unix time, which files each increment in its time bucket."""
        self.worker_id = worker_id
        self._clock = clock
        self._lost: Counter[tuple[str, str]] = Counter()
        self.unsaved = 0  # increments of tenants and time buckets an outage lost (MAX_LOST_COUNTERS)
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
            # The same increments in this time bucket, for rates over recent windows.
            bucket = int(self._clock()) // cfg.stats_bucket_s * cfg.stats_bucket_s
            wkey = cfg.stats_window_key(bucket)
            scopes = ["cluster", *([f"worker:{wid}"] if wid else []),
                      *([f"tenant:{tenant_digest(cache_salt)}"] if cache_salt is not None else [])]  # fmt: skip
            incr.update({(wkey, f"{scope}:{name}"): int(n) for scope in scopes for name, n in counters.items() if n})
            with self._cv:
                self._enqueue(incr)

    def _write(self, pipe: redis.client.Pipeline, batch: list) -> None:
        total: Counter[tuple[str, str]] = Counter()
        for incr in batch:
            total.update(incr)
        pipe.multi()  # all counters of a batch or none: sums stay consistent across keys
        self._queue_increments(pipe, total)

    def _queue_increments(self, pipe: redis.client.Pipeline, total: Counter[tuple[str, str]]) -> None:
        cfg = self.config
        window_prefix, tenant_prefix = cfg.stats_window_key(0)[:-1], cfg.stats_key_prefix("tenant")
        for (key, name), n in total.items():
            pipe.hincrby(key, name, n)
        # Every write sets their expiry again: a bucket written late (after an outage) expires too,
        # and a tenant's counters last while it keeps sending.
        for key in {key for key, _ in total}:
            if key.startswith(window_prefix):
                pipe.expire(key, cfg.stats_retention_s + cfg.stats_bucket_s)
            elif key.startswith(tenant_prefix):
                pipe.expire(key, cfg.stats_tenant_ttl_s)

    def _dropped(self, batch: list) -> None:
        for incr in batch:
            self._keep(incr)

    def _keep(self, incr: Mapping[tuple[str, str], int]) -> None:
        """Keep ``incr`` for the resync (``self._cv`` held), within MAX_LOST_COUNTERS: the cluster's and
        workers' counters always (a few dozen), a tenant's or a time bucket's only while there is room.
        A long outage under many tenants (a client may send a new cache_salt with every request) would
        otherwise grow this without bound; what does not fit is counted in ``unsaved`` and lost."""
        tenant_prefix, window_prefix = self.config.stats_key_prefix("tenant"), self.config.stats_window_key(0)[:-1]
        lost = self._lost
        for (key, name), n in incr.items():
            room = len(lost) < MAX_LOST_COUNTERS or (key, name) in lost
            if room or not key.startswith((tenant_prefix, window_prefix)):
                lost[key, name] += n
            else:
                self.unsaved += n

    def _resync(self, client: redis.Redis) -> None:
        with self._cv:
            lost, self._lost = self._lost, Counter()
        try:
            if lost:
                pipe = client.pipeline(transaction=True)
                self._queue_increments(pipe, lost)
                pipe.execute()
        except BaseException:
            with self._cv:
                self._keep(lost)  # within the bound too: drops may have filled it meanwhile
            raise


def read_stats(client: redis.Redis, index: IndexConfig) -> dict:
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

    out: dict = {"cluster": counters(client.hgetall(index.stats_key)), "workers": {}, "tenants": {}}
    out["hit_rate"] = hit_rate(out["cluster"])
    for kind in ("worker", "tenant"):
        prefix = index.stats_key_prefix(kind)
        keys = sorted(as_str(k) for k in client.scan_iter(match=prefix + "*", count=1000))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        for key, raw in zip(keys, pipe.execute() if keys else []):
            out[f"{kind}s"][key[len(prefix) :]] = counters(raw)
    return out


def read_window(client: redis.Redis, index: IndexConfig, seconds: int, now: float | None = None) -> dict:
    """The counters recorded in the last ``seconds`` (whole buckets of ``stats_bucket_s``, the
    current partial one included), as ``{"seconds": the time the buckets cover up to now, "cluster": {...}, "hit_rate": float,
    "workers": {id: {...}}, "tenants": {digest: {...}}}``; ``seconds`` is capped at the retention.
    Increments are filed by the time they were recorded (a request counts when it ends)."""
    if seconds < 1:
        raise ValueError(f"a stats window must be >= 1 second, got {seconds}")
    step = index.stats_bucket_s
    seconds = min(seconds, index.stats_retention_s)
    last = int(time.time() if now is None else now) // step * step  # the current (partial) bucket
    buckets = range(last - (-(-seconds // step) - 1) * step, last + 1, step)
    pipe = client.pipeline(transaction=False)
    for b in buckets:
        pipe.hgetall(index.stats_window_key(b))
    t_now = time.time() if now is None else now
    out: dict = {"seconds": max(t_now - buckets[0], 1.0), "cluster": dict.fromkeys(STATS_FIELDS, 0), "workers": {},
                 "tenants": {}}  # fmt: skip
    for raw in pipe.execute():
        for field_name, value in raw.items():
            field_name = field_name.decode() if isinstance(field_name, bytes) else field_name
            scope, _, name = field_name.rpartition(":")
            kind, _, ident = scope.partition(":")
            if name not in STATS_FIELDS:
                continue
            if kind == "cluster":
                target = out["cluster"]
            elif kind in ("worker", "tenant"):
                target = out[f"{kind}s"].setdefault(ident, dict.fromkeys(STATS_FIELDS, 0))
            else:
                continue
            target[name] += int(value)
    out["hit_rate"] = hit_rate(out["cluster"])
    return out
