"""RouterConfig: how the router picks workers (router/policy.py explains the formula) and what it
admits (router/admission.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve import envs
from pdserve.security import TLSConfig

MiB = 1 << 20
KV_POLICIES = ("threshold", "auto", "pull", "recompute")


@dataclass(frozen=True)
class RouterConfig:
    # Pull the KV from a prefill worker or prefill on the decode worker? "threshold": the decode
    # worker prefills when it lacks at most local_prefill_threshold tokens; "auto": whichever the
    # measured costs say is sooner (router/cost_model.py; the threshold until measured); "pull" /
    # "recompute": always (for comparisons: pdserve bench).
    kv_policy: str = "threshold"
    # Uncached prompt tokens at or below this are prefilled on the decode worker (no transfer).
    local_prefill_threshold: int = 32
    # A prompt with at least this many tokens to prefill on a prefill worker is also prefetched: its
    # decode worker pulls the blocks the prefill worker has computed while later chunks compute
    # (decode_worker/prefetch.py), so only the last chunk's blocks cross after the prefill. 0: never.
    kv_prefetch_min_tokens: int = 1024
    # score = overlap_tokens - load_weight * queued_tokens
    load_weight: float = 1.0
    # A decode worker's queued tokens count each request's prompt and at most this many of its
    # max_tokens (an upper bound, often the whole context, that would drown the prefix overlap).
    max_output_load_tokens: int = 512
    # Retries on another decode worker while no decode token was sent.
    decode_retries: int = 1
    # A worker whose call failed as unavailable (dead actor, lost node) gets no requests until it
    # answers a ping; down workers are pinged every health_probe_interval_s, each ping given
    # health_probe_timeout_s (router/health.py).
    health_probe_interval_s: float = 1.0
    health_probe_timeout_s: float = 5.0
    # A request message larger than this is refused before it is read (RESOURCE_EXHAUSTED).
    max_request_bytes: int = 1 * MiB
    # Admission: requests running at once, of them per tenant (cache_salt), and waiting for a slot.
    max_in_flight: int = 256
    max_in_flight_per_tenant: int = 64
    max_queued: int = 1024
    queue_timeout_s: float = 30.0
    # On SIGTERM, in-flight streams get this long to finish before the router stops.
    drain_timeout_s: float = 30.0
    # Threads that tokenize requests (text, chat templates) for both edges.
    tokenizer_threads: int = 2
    # TLS on the router's gRPC port and the HTTP port; None: plaintext.
    tls: TLSConfig | None = None
    # The model's name in the HTTP API ("model" of a request); None: the model directory's or
    # file's name (the path it was loaded from is accepted too).
    served_model_name: str | None = None
    # One line per request on the logger "pdserve.access" (at INFO).
    access_log: bool = True
    # HTTP API: a request's head (request line and headers) and its body must each arrive within
    # these (else 408, connection closed); at most this many connections open (more: 503 and
    # closed); request bodies held in memory at once, in all (a body over 64 KiB that would go
    # over it: 503 at once).
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    http_max_connections: int = 1024
    http_max_buffered_bytes: int = 256 * MiB
    # A client that takes none of its response for this long while the router has more to send
    # (HTTP: the connection's buffers full; gRPC: a message not taken) is disconnected, which ends
    # its request: it cannot hold an admission slot, a connection or its output forever.
    send_timeout_s: float = 30.0
    # Tokens come from each decode worker on one event channel per router, which the router renews
    # every quarter of this; a worker ends the requests of a channel not renewed for this long (a
    # router that died: Ray does not end a dead caller's tasks).
    decode_channel_ttl_s: float = 30.0
    # The key every client of the HTTP API (``Authorization: Bearer KEY``) and of the gRPC API
    # (metadata ``authorization: Bearer KEY``) must present; /health, /ping and /metrics stay open, and
    # so does gRPC health checking. None: open to anyone who reaches the ports. Default
    # ``PDSERVE_API_KEY``; never logged (no repr), never in the state file.
    api_key: str | None = field(default_factory=envs.api_key, repr=False)

    def __post_init__(self) -> None:
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")
        for name in ("local_prefill_threshold", "decode_retries", "max_queued", "kv_prefetch_min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("max_request_bytes", "max_in_flight", "max_in_flight_per_tenant", "max_output_load_tokens",
                     "tokenizer_threads", "http_max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("load_weight", "queue_timeout_s", "drain_timeout_s"):
            w = getattr(self, name)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {w!r}")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "send_timeout_s", "health_probe_interval_s",
                     "health_probe_timeout_s", "decode_channel_ttl_s"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {t!r}")
        check_api_key(self.api_key)
        b = self.http_max_buffered_bytes
        if not isinstance(b, int) or isinstance(b, bool) or b < self.max_request_bytes:
            raise ValueError(f"http_max_buffered_bytes must be an integer >= max_request_bytes "
                             f"({self.max_request_bytes}), got {b!r}")


def check_api_key(key: str | None) -> None:
    """ValueError unless ``key`` is None or what a header can carry after ``Bearer ``: visible
    ASCII, no spaces. The message never shows the key."""
    if key is None:
        return
    if not isinstance(key, str) or not key or not all("!" <= c <= "~" for c in key):
        raise ValueError("api_key must be a non-empty string of visible ASCII characters (no spaces)")
