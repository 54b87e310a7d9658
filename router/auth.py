"""The API key of the router's public edges (``router.api_key``, ``pdserve up --api-key``).

With a key, an HTTP request must carry ``Authorization: Bearer KEY`` (``ApiKeyAuth``: else 401
with an OpenAI error object, before its body is read) and a gRPC call the metadata
``authorization: Bearer KEY`` (``ApiKeyInterceptor``: else ``UNAUTHENTICATED``, before its
request is parsed). Open without it: HTTP ``/health`` and ``/metrics`` (probes and scrapers
carry no key) and the gRPC health service. Keys are compared in constant time
(``hmac.compare_digest``); the key is never logged and never echoed.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from pdserve.router.http_limits import EdgeState

# HTTP paths that answer without the key: load balancers' probes and Prometheus carry none.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})  # /ping: /health by vLLM's other name
# gRPC services that answer without the key (health checking, as /health).
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)

HTTP_MESSAGE = "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'"
GRPC_MESSAGE = "incorrect or missing API key: send the metadata 'authorization: Bearer <key>'"


def bearer_matches(value: str | bytes | None, key: bytes) -> bool:
    """True when the ``Authorization`` value ``value`` is ``Bearer <key>`` (the scheme in any
    case, as RFC 7235 has it). The key part is compared in constant time."""
    if value is None:
        return False
    raw = value.encode("latin-1", "replace") if isinstance(value, str) else value
    scheme, _, token = raw.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


class ApiKeyAuth:
    """ASGI middleware: 401 (``invalid_api_key``, ``WWW-Authenticate: Bearer``, connection
    closed) for an HTTP request outside ``OPEN_PATHS`` without the right key, answered from its
    head alone; counted in ``state.rejected["unauthorized"]``. Without a key it is not installed."""

    def __init__(self, app: Any, key: str, state: EdgeState) -> None:
        self.app = app
        self.key = key.encode("ascii")
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        self.state.rejected["unauthorized"] += 1
        body = json.dumps({"error": {"message": HTTP_MESSAGE, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()  # fmt: skip
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"www-authenticate", b"Bearer"), (b"connection", b"close")]  # fmt: skip
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict[str, Any]) -> bool:
        values = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        return len(values) == 1 and bearer_matches(values[0], self.key)


def _metadata_value(metadata: Sequence[tuple[str, str | bytes]] | None, name: str) -> list[str | bytes]:
    return [v for k, v in (metadata or ()) if k.lower() == name]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a gRPC call outside ``OPEN_GRPC_PREFIXES`` whose metadata lacks
    ``authorization: Bearer <key>`` with ``UNAUTHENTICATED``; its request is never deserialized."""

    def __init__(self, key: str) -> None:
        self.key = key.encode("ascii")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method or ""
        values = _metadata_value(details.invocation_metadata, "authorization")
        if method.startswith(OPEN_GRPC_PREFIXES) or (len(values) == 1 and bearer_matches(values[0], self.key)):
            return await continuation(details)
        handler = await continuation(details)
        return None if handler is None else _refusing(handler)


async def _refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, GRPC_MESSAGE)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED, taking the request as bytes."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)
