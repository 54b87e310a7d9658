"""RequestAccount: what one router request did, counted once when it ends.

The router's request path (``router/core.py``) only reports what happens: the first token from
a prefill worker, each decode event, which workers did the work. The account turns that into
the stream's ``usage``, the latency histograms as tokens arrive and, exactly once when the
request ends (finished, failed, cancelled or the client left), the request counters, one
access-log line and the Redis stats, credited to the workers that did the work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdserve.kvindex.config import tenant_digest
from pdserve.kvindex.stats import StatsRecorder
from pdserve.router.metrics import RouterMetrics
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec

access_log = logging.getLogger("pdserve.access")


@dataclass
class Outcome:
    """How a consumer that stopped reading ended the request (a stop string it found ends it
    with ``"stop"``); without it, a closed stream counts as the client leaving (``"abort"``)."""

    finish_reason: str | None = None


def log_access(spec: RequestSpec, status: str, usage: dict[str, int], generated: int, ttft_ms: float | None,
               t_arrive: float, t_admit: float, enabled: bool = True) -> None:  # fmt: skip
    """One access-log line per request (logger ``pdserve.access``); its fields are record
    attributes, which a JSON log shows as keys. No prompt text: the tenant is a digest."""
    if not (enabled and access_log.isEnabledFor(logging.INFO)):
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


class RequestAccount:
    """Counts one admitted request. ``front_worker`` computed (or cached) the prompt; a decode
    worker that continued after a remote prefill is credited with what it reused or pulled."""

    def __init__(self, spec: RequestSpec, t_arrive: float, t_admit: float, metrics: RouterMetrics,
                 stats: StatsRecorder, access_log_enabled: bool) -> None:  # fmt: skip
        self.spec = spec
        self.t_arrive = t_arrive
        self.t_admit = t_admit
        self._metrics = metrics
        self._stats = stats
        self._access = access_log_enabled
        prompt_len = len(spec.prompt_token_ids)
        self.usage = {"prompt_tokens": prompt_len, "cached_tokens": 0, "transferred_tokens": 0}
        self._front = {"requests": 1, "prompt_tokens": prompt_len, "prefix_hit_tokens": 0}
        self._back: dict[str, int] = {}
        self.front_worker = ""
        self.decode_worker = ""
        self.status = "abort"  # until it finishes or fails
        self.sent = 0
        self.first_ms: float | None = None
        self._last_t = t_arrive

    @property
    def decode_took_over(self) -> bool:
        """A decode worker reported continuing after the remote prefill (its pull settles the lease)."""
        return bool(self._back)

    def _tokens_arrived(self, n: int) -> float | None:
        """Latency histograms for ``n`` new tokens; the time to first token (ms) if they are the first."""
        if not n:
            return None
        now = time.perf_counter()
        ttft = None
        if self.sent == 0:
            ttft = self.first_ms = (now - self.t_arrive) * 1000
            self._metrics.ttft.observe(ttft / 1000)
            self._metrics.observe_token_gap(0.0, n - 1)  # arrived with the first
        else:
            self._metrics.observe_token_gap(now - self._last_t, n)
        self._last_t = now
        self.sent += n
        return ttft

    def prefilled(self, prefill: PrefillResult) -> float | None:
        """The prefill worker's first token arrived; returns the time to first token (ms)."""
        self.front_worker = prefill.worker_id
        self.usage["cached_tokens"] = self._front["prefix_hit_tokens"] = prefill.num_cached_tokens
        if prefill.finished:
            self.status = prefill.finish_reason or "stop"
        return self._tokens_arrived(1)

    def decoded(self, ev: DecodeEvent, worker_id: str, remote_prefill: bool) -> float | None:
        """A decode event from ``worker_id``; returns the time to first token (ms) if it carried it."""
        self.decode_worker = worker_id
        if remote_prefill:
            self._back = {"transferred_tokens": ev.num_transferred_tokens,
                          "decode_local_hit_tokens": ev.num_local_hit_tokens}  # fmt: skip
        else:
            self.front_worker = worker_id
            self.usage["cached_tokens"] = self._front["prefix_hit_tokens"] = ev.num_local_hit_tokens
        self.usage["transferred_tokens"] = ev.num_transferred_tokens
        if ev.finished:
            self.status = ev.finish_reason or "stop"
        return self._tokens_arrived(len(ev.token_ids))

    @contextmanager
    def open(self, outcome: Outcome | None) -> Iterator[RequestAccount]:
        """The request's extent: on exit, however it ends, the account is closed exactly once."""
        try:
            yield self
        except BaseException as exc:
            if self.status == "abort":
                if not isinstance(exc, GeneratorExit | asyncio.CancelledError):
                    self.status = "error"
                elif outcome is not None and outcome.finish_reason:
                    self.status = outcome.finish_reason  # the consumer ended it (a stop string), not the client
            raise
        finally:
            self._close()

    def _close(self) -> None:
        prompt_len = self.usage["prompt_tokens"]
        self._metrics.observe_end(self.status, prompt_len, self.sent, self.usage["cached_tokens"],
                                  self.usage["transferred_tokens"], time.perf_counter() - self.t_arrive)  # fmt: skip
        log_access(self.spec, self.status, self.usage, self.sent, self.first_ms, self.t_arrive, self.t_admit,
                   self._access)  # fmt: skip
        self._stats.record(self._front, self.spec.cache_salt, self.front_worker)
        if self._back:
            self._stats.record(self._back, self.spec.cache_salt, self.decode_worker)

