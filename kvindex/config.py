"""IndexConfig: where the Redis block index lives, how its clients behave, and its key names.

Key names are the contract of docs/redis.md; ``{ns}`` is ``IndexConfig.namespace``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import redis
import xxhash
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from pdserve import envs

# Errors that mean "the index is unreachable or refuses writes", never the caller's fault.
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")  # no glob characters: readers SCAN by pattern


def now_ms() -> int:
    return int(time.time() * 1000)


def tenant_digest(cache_salt: str) -> str:
    """Tenant id in key names: ``xxh3_64`` of the UTF-8 salt as 16 hex chars (the salt never appears)."""
    return xxhash.xxh3_64_hexdigest(cache_salt.encode("utf-8"))


def redact_url(url: str) -> str:
    """``url`` with its passwords replaced by ``***``: the one in ``user:password@`` and the
    values of ``password`` query parameters (redis-py takes both; ``unix://`` URLs need the latter)."""
    parts = urlsplit(url)
    if parts.password is not None:  # the first ":pw@" is the netloc's: the scheme comes before it
        url = url.replace(f":{parts.password}@", ":***@", 1)
    if parts.query:
        query = "&".join(_redact_param(p) for p in parts.query.split("&"))
        url = url.replace(f"?{parts.query}", f"?{query}", 1)
    return url


def _redact_param(param: str) -> str:
    name, sep, _ = param.partition("=")
    return f"{name}=***" if sep and unquote(name).lower() == "password" else param


@dataclass(frozen=True, repr=False)
class IndexConfig:
    """Where the index lives and how its clients behave.

    ``url`` is handed to ``redis.Redis.from_url`` as is, so ``redis://:pw@host:port/db``,
    ``redis://user:pw@...`` and ``rediss://`` (TLS) work. ``None`` means "not configured"
    (``PDSERVE_REDIS_URL`` unset): ``pdserve up`` then starts an embedded server, and
    ``client()`` refuses. ``namespace`` defaults to ``PDSERVE_REDIS_NAMESPACE`` or ``pdserve``.
    ``repr`` hides the password.
    """

    url: str | None = field(default_factory=envs.redis_url)
    namespace: str = field(default_factory=envs.redis_namespace)
    events_maxlen: int = 10000
    # Block events carry the cached tokens (the tenants' prompts) only when the operator opts in.
    events_include_token_ids: bool = False
    socket_timeout_s: float = 1.0  # bounds every Redis call, so a hung server costs at most this
    lookup_timeout_s: float = 0.25  # the router's prefix lookup sits on each request's critical path
    restart_check_s: float = 2.0  # how often writers ask whether Redis restarted (and lost the index)
    batch_max: int = 256  # events per pipeline round trip
    max_queue: int = 100_000  # queued writes beyond this are dropped (and covered by a republish)
    retry_initial_s: float = 0.05
    retry_max_s: float = 2.0
    # Windowed counters (``pdserve stats --window``): per-bucket hashes, kept this long.
    stats_bucket_s: int = 10
    stats_retention_s: int = 3600
    # A tenant's counters (``{ns}:stats:tenant:<digest>``) expire this long after their last write,
    # so tenants that come and go (a client may send a new cache_salt with every request) do not
    # fill Redis; a tenant that keeps sending keeps its counters.
    stats_tenant_ttl_s: int = 7 * 86400

    def __post_init__(self) -> None:
        if self.url is not None:
            if urlsplit(self.url).scheme not in ("redis", "rediss", "unix"):
                raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {self.redacted_url!r}")
            try:
                parse_url(self.url)  # what from_url will do: a bad port or db is refused here, not in a worker
            except ValueError as exc:
                raise ValueError(f"bad Redis URL {self.redacted_url!r}: {exc}") from None
        if not _NAMESPACE_RE.match(self.namespace):
            raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}, got {self.namespace!r}")
        for name in ("events_maxlen", "batch_max", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("socket_timeout_s", "lookup_timeout_s", "restart_check_s", "retry_initial_s", "retry_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.stats_tenant_ttl_s < 1:
            raise ValueError(f"stats_tenant_ttl_s must be >= 1, got {self.stats_tenant_ttl_s}")
        if self.stats_bucket_s < 1 or self.stats_retention_s < self.stats_bucket_s:
            raise ValueError("stats_bucket_s must be >= 1 and stats_retention_s >= stats_bucket_s, got "
                             f"{self.stats_bucket_s} and {self.stats_retention_s}")  # fmt: skip
        if self.retry_initial_s > self.retry_max_s:
            raise ValueError("retry_initial_s must be <= retry_max_s")

    @property
    def redacted_url(self) -> str:
        return "" if self.url is None else redact_url(self.url)

    def __repr__(self) -> str:
        return f"IndexConfig(url={self.redacted_url!r}, namespace={self.namespace!r})"

    def client(self, retries: int = 1, timeout_s: float | None = None) -> redis.Redis:
        """A new client with str replies, ``timeout_s`` (default ``socket_timeout_s``) on every
        call, and ``retries`` immediate retries (one re-dials a stale pooled socket; writes that
        are not idempotent want none: a timed-out command may still have run)."""
        if self.url is None:
            raise ValueError("no Redis URL configured (pass --redis-url or set PDSERVE_REDIS_URL)")
        timeout = timeout_s or self.socket_timeout_s
        return redis.Redis.from_url(
            self.url,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), retries),
        )

    # -- key names (docs/redis.md) --------------------------------------------------------
    def block_key(self, block_hash: bytes) -> str:
        return f"{self.namespace}:block:{block_hash.hex()}"

    @property
    def block_key_pattern(self) -> str:
        return f"{self.namespace}:block:*"

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

    def stats_window_key(self, bucket_start_s: int) -> str:
        """The counters recorded in the bucket of ``stats_bucket_s`` seconds starting at this unix time."""
        return f"{self.namespace}:stats:window:{bucket_start_s}"

    def stats_key_prefix(self, kind: str) -> str:
        """``{ns}:stats:worker:`` or ``{ns}:stats:tenant:``."""
        return f"{self.namespace}:stats:{kind}:"
