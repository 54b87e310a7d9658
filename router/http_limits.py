"""What the HTTP edge bounds below the application: connections, slow request heads, and the
access log of requests it refuses.

``EdgeState`` is one server's shared state (one event loop, so no locks): its limits, the open
connections, the request body bytes held in memory (``router/body_limit.py`` keeps that count)
and refusals by reason, exported as metrics. ``guarded_protocol`` is uvicorn's h11 protocol with
what uvicorn does not do itself:

- a cap on open connections: a connection over ``max_connections`` is answered 503 and closed
  as it is accepted, before it can send (or hold) anything;
- a deadline on a request's head: a connection that opened, or started its next request, must
  complete the request line and headers within ``header_timeout_s``, or it is closed (408 when it
  had sent part of them). uvicorn's own keep-alive timeout only covers the time between requests;
- a deadline on the client's reading: a connection whose output waits (the socket's buffers
  full) for ``send_timeout_s`` without the client taking any is closed at once, which ends its
  request (its stream is cancelled: admission slot and KV blocks back) and frees what it held.
  uvicorn would wait on it forever, its output piling up in the router.

Refusals here and in the application write one line on the access log (``log_rejected``), with
the fields of the router core's, where known.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.router.openai_responses import error_body

access_log = logging.getLogger("pdserve.access")

# A request body up to this size is never refused for the shared budget of buffered bytes, so
# ordinary requests get through while large bodies have used it up (the worst case this adds is
# max_connections times this, and uvicorn buffers about as much per connection itself).
SMALL_BODY_BYTES = 64 * 1024

# The access log's status for a refusal the router core never saw, by HTTP status.
_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "too_large",
            429: "overloaded", 503: "unavailable"}  # fmt: skip


@dataclass(frozen=True)
class HttpLimits:
    """``max_request_bytes`` per body; the head and the body must each arrive within their
    timeout; at most ``max_connections`` open and ``max_buffered_bytes`` of bodies held in all."""

    max_request_bytes: int
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    max_buffered_bytes: int = 256 << 20
    send_timeout_s: float = 30.0


class EdgeState:
    """One HTTP server's limits and counters. ``access_log``: write refusals on ``pdserve.access``."""

    def __init__(self, limits: HttpLimits, access_log: bool = True) -> None:
        self.limits = limits
        self.access_log = access_log
        self.connections = 0
        self.buffered_bytes = 0
        self.rejected: Counter[str] = Counter()

    def snapshot(self) -> dict[str, Any]:
        """The counters as plain data (for tests and ``Router.http_state``)."""
        return {"connections": self.connections, "buffered_bytes": self.buffered_bytes,
                "rejected": dict(self.rejected)}  # fmt: skip

    def families(self) -> list[Metric]:
        conns = GaugeMetricFamily("pdserve_http_connections", "Open connections of the HTTP API.")
        conns.add_metric([], self.connections)
        held = GaugeMetricFamily("pdserve_http_buffered_body_bytes",
                                 "Request body bytes the HTTP API holds in memory (requests in progress).")  # fmt: skip
        held.add_metric([], self.buffered_bytes)
        refused = CounterMetricFamily("pdserve_http_rejected", "Connections and requests the HTTP API refused "
                                      "below the router core, by reason.", labels=["reason"])  # fmt: skip
        for reason, n in sorted(self.rejected.items()):
            refused.add_metric([reason], n)
        return [conns, held, refused]


MAX_LOGGED_PATH = 256


def log_rejected(state: EdgeState, http_status: int, t0: float, method: str = "-", path: str = "-",
                 tenant: str = "-") -> None:  # fmt: skip
    """One access-log line for a request the edge refused before the router core saw it: the
    core's fields (unknown ones None), ``status`` ``rejected:<reason>`` (``error`` for a 500),
    and the HTTP status, method and path (cut at ``MAX_LOGGED_PATH`` characters: the client chose
    it, as it chose any control characters in it, which the log's formatter escapes). Never the body."""
    if not (state.access_log and access_log.isEnabledFor(logging.INFO)):
        return
    if len(path) > MAX_LOGGED_PATH:
        path = path[:MAX_LOGGED_PATH] + "..."
    reason = _REASONS.get(http_status, str(http_status))
    status = "error" if http_status >= 500 and http_status != 503 else f"rejected:{reason}"
    request_id = uuid.uuid4().hex
    fields = {
        "request_id": request_id, "tenant": tenant, "status": status, "prompt_tokens": None, "cached_tokens": None,
        "transferred_tokens": None, "generated_tokens": 0, "ttft_ms": None, "queue_ms": None,
        "e2e_ms": round((time.perf_counter() - t0) * 1000, 2), "http_status": http_status, "method": method,
        "path": path,
    }  # fmt: skip
    access_log.info("request %s %s (HTTP %d %s %s)", request_id, status, http_status, method, path, extra=fields)


def raw_error(status: int, message: str, type_: str, code: str | int) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI error object, that closes the connection:
    for answers written below the application (no request parsed, or none completely)."""
    body = json.dumps(error_body(message, type_, code)).encode()
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the connection cap and the head deadline (see the module)."""

    edge: ClassVar[EdgeState]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # bytes of the next request's head have arrived
        self._counted = False
        self._send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        edge = self.edge
        edge.connections += 1
        self._counted = True
        if edge.connections > edge.limits.max_connections:
            edge.rejected["too_many_connections"] += 1
            log_rejected(edge, 503, time.perf_counter())
            transport.write(raw_error(503, f"the server has {edge.limits.max_connections} connections open, its "
                                      "limit: try again later", "service_unavailable_error", 503))  # fmt: skip
            transport.close()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self.edge.connections -= 1
            self._counted = False
        self._disarm_head_timer()
        self._disarm_send_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The socket's buffers are full: the client must take some within the send deadline."""
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.edge.limits.send_timeout_s, self._send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send_timer()

    def _disarm_send_timer(self) -> None:
        self._send_timer = _cancelled(self._send_timer)

    def _send_timeout(self) -> None:
        self._send_timer = None
        if not self.flow.write_paused:
            return
        self.edge.rejected["send_timeout"] += 1
        self.transport.abort()  # close() would wait for the client to read what is buffered

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._disarm_head_timer()
        elif self.conn.their_state is h11.IDLE:  # (part of) the next request's head, not complete yet
            self._head_started = self._head_started or bool(data)
            if self._head_timer is None:
                self._arm_head_timer()
        else:  # its head is in: the body has its own deadline (BodyLimit)
            self._disarm_head_timer()
            self._head_started = False

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.edge.limits.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        self._head_timer = _cancelled(self._head_timer)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_started:  # a request began and stalled: say so; an idle connection just ends
            edge = self.edge
            edge.rejected["header_timeout"] += 1
            log_rejected(edge, 408, time.perf_counter() - edge.limits.header_timeout_s)
            self.transport.write(raw_error(408, f"the request's head did not arrive within "
                                           f"{edge.limits.header_timeout_s:g} s", "invalid_request_error",
                                           "request_timeout"))  # fmt: skip
        self.transport.close()


def guarded_protocol(edge: EdgeState) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for a server with this state."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"edge": edge})


# Scope keys the application sets: the router core has the request (it writes the access-log
# lines from then on), and the tenant's digest once the body is parsed.
CORE_HAS_IT = "pdserve.core"
TENANT = "pdserve.tenant"


class RejectionLog:
    """ASGI middleware: one access-log line (``log_rejected``) for each HTTP request answered
    with a 4xx/5xx that the router core never saw (unparsable, invalid, too large, too slow, too
    many...); the core writes its own for the rest. 499 (the client left) is not a refusal."""

    def __init__(self, app: Any, state: EdgeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.state.access_log:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0

        async def watch(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if status >= 400 and status != 499 and not scope.get(CORE_HAS_IT):
                log_rejected(self.state, status, t0, scope.get("method", "-"), scope.get("path", "-"),
                             scope.get(TENANT, "-"))  # fmt: skip


def _cancelled(timer: asyncio.TimerHandle | None) -> None:
    """Cancel ``timer`` if there is one; None, for the attribute that held it."""
    if timer is not None:
        timer.cancel()
