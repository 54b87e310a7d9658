"""BodyLimit: an ASGI middleware that reads a request's whole body before the app parses any of
it, and refuses what would cost the server without bound:

- a body over ``max_request_bytes``: 413 (``request_too_large``), whether the client declared
  its length or streams it chunked;
- a body that has not arrived ``body_timeout_s`` after its head: 408 (``request_timeout``);
- a body over ``SMALL_BODY_BYTES`` while the bodies held in memory (``EdgeState.buffered_bytes``,
  of every request in progress) would go over ``max_buffered_bytes``: 503 at once
  (``server_busy``), before its bytes are read where its declared length already does not fit.

Each refusal closes the connection (``Connection: close``): the rest of the body is never read.
A body counts as held from its first byte until the app is done with the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from pdserve.router.http_limits import SMALL_BODY_BYTES, EdgeState

Scope = dict[str, Any]
Message = dict[str, Any]


class _Refused(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.type_, self.code, self.reason = status, type_, code, reason


class BodyLimit:
    def __init__(self, app: Any, state: EdgeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = 0  # this request's share of state.buffered_bytes

        def hold(n: int) -> None:
            nonlocal held
            held += n
            self.state.buffered_bytes += n

        try:
            try:
                body = await self._read(scope, receive, hold)
            except _Refused as r:
                self.state.buffered_bytes -= held
                held = 0
                self.state.rejected[r.reason] += 1
                await _refuse(send, r)
                return
            if body is None:  # the client went away
                return
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # later calls (disconnect detection) go to the server

            await self.app(scope, replay, send)
        finally:
            self.state.buffered_bytes -= held

    async def _read(self, scope: Scope, receive: Any, hold: Any) -> bytes | None:
        """The whole body (None if the client left), or ``_Refused``."""
        limits = self.state.limits
        declared = _content_length(scope)
        if declared is not None:
            if declared > limits.max_request_bytes:
                raise _too_large(limits.max_request_bytes, f"of {declared} bytes")
            if declared > SMALL_BODY_BYTES and self.state.buffered_bytes + declared > limits.max_buffered_bytes:
                raise _busy(limits.max_buffered_bytes)
        deadline = time.monotonic() + limits.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise _Refused(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                               "invalid_request_error", "request_timeout", "body_timeout") from None  # fmt: skip
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limits.max_request_bytes:
                raise _too_large(limits.max_request_bytes, "of more bytes")
            if size > SMALL_BODY_BYTES and self.state.buffered_bytes + len(chunk) > limits.max_buffered_bytes:
                raise _busy(limits.max_buffered_bytes)
            hold(len(chunk))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def _too_large(limit: int, size: str) -> _Refused:
    return _Refused(413, f"request body {size} exceeds the limit of {limit} bytes", "invalid_request_error",
                    "request_too_large", "too_large")  # fmt: skip


def _busy(limit: int) -> _Refused:
    return _Refused(503, f"the server holds {limit} bytes of request bodies, its limit: try again later",
                    "service_unavailable_error", "server_busy", "buffer_full")  # fmt: skip


async def _refuse(send: Any, r: _Refused) -> None:
    body = json.dumps({"error": {"message": str(r), "type": r.type_, "param": None, "code": r.code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]  # fmt: skip
    await send({"type": "http.response.start", "status": r.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
