"""RouterMetrics: the request-level metrics, measured where clients see them (the router).

TTFT and end-to-end latency are timed from the moment the router holds the request (tokenized,
before it waits for an admission slot) to the events it forwards; inter-token latency between
those events; queue time is the wait for an admission slot. Names are the ``pdserve_`` twins of
vLLM's (README, "Metrics").
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from pdserve.metrics import E2E_BUCKETS, ITL_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS

FINISH_REASONS = ("stop", "length", "abort", "error")


class RouterMetrics:
    """One registry per router (tests make as many as they like). Every ``observe_*`` is cheap
    and never raises on values a request can produce."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token, as the router sends it.",
                              buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds",
                             "Request latency, arrival at the router to last token.", buckets=E2E_BUCKETS,
                             registry=r)  # fmt: skip
        self.queue = Histogram("pdserve_request_queue_time_seconds", "Time a request waited for an admission slot.",
                               buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.prompt_len = Histogram("pdserve_request_prompt_tokens", "Prompt length of finished requests.",
                                    buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.gen_len = Histogram("pdserve_request_generation_tokens", "Generated tokens of finished requests.",
                                 buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.requests = Counter("pdserve_requests", "Requests that ended, by finish reason (abort: the client "
                                "left or cancelled; error: a failure).", ["finish_reason"], registry=r)  # fmt: skip
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)  # every series exists from the start, at 0
        self.rejected = Counter("pdserve_requests_rejected", "Requests refused before any work (overloaded: "
                                "no admission slot; draining: shutting down).", ["reason"], registry=r)  # fmt: skip
        for reason in ("overloaded", "draining"):
            self.rejected.labels(reason=reason)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of requests that ended.", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens sent to clients.", registry=r)
        self.cached_tokens = Counter("pdserve_request_cached_tokens", "Prompt tokens of ended requests served "
                                     "from a prefix cache (any worker's).", registry=r)  # fmt: skip
        self.transferred_tokens = Counter("pdserve_request_transferred_tokens", "Prompt tokens whose KV a decode "
                                          "worker pulled from a prefill worker.", registry=r)  # fmt: skip
        self.in_flight = Gauge("pdserve_router_requests_in_flight", "Requests holding an admission slot.", registry=r)
        self.queued = Gauge("pdserve_router_requests_queued", "Requests waiting for an admission slot.", registry=r)

    def watch_admission(self, in_flight: Callable[[], float], queued: Callable[[], float]) -> None:
        """Read the admission gauges at scrape time from these functions."""
        self.in_flight.set_function(in_flight)
        self.queued.set_function(queued)

    def observe_token_gap(self, seconds: float, n_tokens: int) -> None:
        """``n_tokens`` arrived ``seconds`` after the previous ones: each token's share is one
        inter-token latency (an event with several tokens spreads its gap evenly)."""
        if n_tokens > 0:
            share = max(seconds, 0.0) / n_tokens
            for _ in range(n_tokens):
                self.itl.observe(share)

    def observe_end(self, finish_reason: str, prompt_tokens: int, generated: int, cached: int, transferred: int,
                    e2e_s: float) -> None:  # fmt: skip
        reason = finish_reason if finish_reason in FINISH_REASONS else "stop"
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.cached_tokens.inc(cached)
        self.transferred_tokens.inc(transferred)
        self.prompt_len.observe(prompt_tokens)
        self.gen_len.observe(generated)
        self.e2e.observe(max(e2e_s, 0.0))

    def families(self) -> list[Metric]:
        return list(self.registry.collect())
