"""Shared pieces of the Redis side: the index config and key names, counter names, outage tracking."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

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
    lookup_timeout_s: float = 0.25  # the router's prefix lookup sits on each request's critical path
    restart_check_s: float = 2.0  # how often writers ask whether Redis restarted (and lost the index)
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
        for name in ("socket_timeout_s", "lookup_timeout_s", "restart_check_s", "retry_initial_s", "retry_max_s"):
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

    def client(self, retries: int = 1, timeout_s: float | None = None) -> redis.Redis:
        """A new client with str replies, ``timeout_s`` (default ``socket_timeout_s``) on every
        call, and ``retries`` immediate retries (one re-dials a stale pooled socket; writes that
        are not idempotent want none: a timed-out command may still have run)."""
        timeout = timeout_s or self.socket_timeout_s
        return redis.Redis.from_url(
            self.url,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), retries),
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
