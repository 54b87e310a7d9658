"""Transport security shared by the KV-transfer plane and the router: TLS and cluster authentication.

``TLSConfig`` turns user-supplied PEM files into gRPC credentials (server and channel), with
mutual TLS when a CA is given to check clients against.

``ClusterAuth`` authenticates the calls between the processes of one cluster with a shared
secret, without ever sending it. Each call carries one token bound to that call::

    pdserve-auth: v3.<unix ms>.<nonce>.<call mac>.<body mac>.<caller>

``nonce`` is 32 random hex digits, ``caller`` the signer's name (``CALLER_RE``; it may contain
dots, it is the last field). Both MACs are hex HMAC-SHA256 under the secret: ``call mac`` of
``"v3\ncall\n<method>\n<caller>\n<unix ms>\n<nonce>"`` (the full method name), ``body mac`` of
``"v3\nbody\n<call mac>\n<sha256 hex of the request bytes>"`` (the serialized request message
exactly as it travels). A holder admits a call from its headers alone, before it waits for the
request: the call MAC matches the method it serves, the time is within ``max_skew_s`` of its own
clock, and the nonce is new, which spends it (it remembers each nonce until its timestamp leaves
the window, in a table of at most ``max_nonces`` entries, and refuses rather than grows when full).
Then the body MAC must match the bytes it received. A captured token is therefore good for nothing:
not again (nonce), not for another request or method (MACs), not later (time); and a caller
without the secret is refused before its request is read, so calls that never send one cannot hold
the holder's threads.

The caller name is asserted by a holder of the secret, not proven to a third party: it names
the member in logs. The MAC does not hide anything: someone reading the traffic sees requests
and block bytes; TLS (mutual TLS) is the answer to that.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

logger = logging.getLogger(__name__)

AUTH_METADATA_KEY = "pdserve-auth"
_VERSION = "v3"
MIN_SECRET_CHARS = 16
CALLER_RE = re.compile(r"[A-Za-z0-9_.:@/+-]{1,128}")
_NONCE_RE = re.compile(r"[0-9a-f]{32}")
_MAC_RE = re.compile(r"[0-9a-f]{64}")
_MAX_TS_DIGITS = 15  # unix ms until the year 33658
DEFAULT_MAX_NONCES = 1 << 17  # ~2,000 calls/s sustained per holder at the default 60 s window; ~15 MB at most


@dataclass(frozen=True)
class TLSConfig:
    """PEM files for gRPC over TLS.

    ``cert_file``/``key_file``: this process's certificate chain and key (the server's; with
    mutual TLS also what it presents as a client). ``ca_file``: the CA that signed the peers'
    certificates; a server given one requires and checks client certificates (mutual TLS), a
    client verifies the server against it (without it, the system's roots). ``server_name``:
    the name to check the server certificate for, when peers are dialled by IP address.
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")

    @staticmethod
    def _read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert_file is None:
            raise ValueError("a TLS server needs cert_file and key_file")
        pair = (self._read(self.key_file), self._read(self.cert_file))
        ca = self._read(self.ca_file)
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca_file),
            private_key=self._read(self.key_file),
            certificate_chain=self._read(self.cert_file),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def check_secret(secret: str | None, what: str = "cluster_secret") -> None:
    if secret is not None and (not isinstance(secret, str) or len(secret) < MIN_SECRET_CHARS):
        raise ValueError(f"{what} must be a string of at least {MIN_SECRET_CHARS} characters")


def default_caller() -> str:
    """``<host>/<pid>``, cut to what ``CALLER_RE`` allows: the caller name when none is given."""
    name = re.sub(r"[^A-Za-z0-9_.:@/+-]", "_", f"{socket.gethostname()}/{os.getpid()}")
    return name[-128:] or "unknown"


class AuthRefused(Exception):
    """A call that ``ClusterAuth.authenticate`` refuses: ``reason`` for logs, ``caller`` as claimed
    (None when the token did not parse; unverified unless the MAC matched)."""

    def __init__(self, reason: str, caller: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.caller = caller


class NonceTable:
    """The nonces accepted within the window, each until its expiry; at most ``capacity`` of them.

    ``add`` is thread-safe. It first drops the entries whose expiry is before ``now``, then
    refuses a nonce it holds (``"replayed"``) or any new one when full (``"full"``); None: added.
    Memory is O(capacity) whatever the callers do.
    """

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"the nonce table's capacity must be an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._expiry: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []  # (expiry, nonce), exactly the dict's entries
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._expiry)

    def add(self, nonce: str, expires_at: int, now: int) -> str | None:
        with self._lock:
            self._prune(now)
            if nonce in self._expiry:
                return "replayed"
            if len(self._expiry) >= self.capacity:
                return "full"
            self._expiry[nonce] = expires_at
            heapq.heappush(self._heap, (expires_at, nonce))
            return None

    def _prune(self, now: int) -> None:
        while self._heap and self._heap[0][0] < now:
            _, nonce = heapq.heappop(self._heap)
            del self._expiry[nonce]


@dataclass(frozen=True)
class Token:
    """A call's ``pdserve-auth`` token, parsed (``ClusterAuth.admit`` returns the one it let in)."""

    ts_ms: int
    nonce: str
    call_mac: str
    body_mac: str
    caller: str


def _parse(metadata: Sequence[tuple[str, Any]] | None) -> Token:
    """The one well-formed ``pdserve-auth`` token of ``metadata``; raises ``AuthRefused``."""
    values = [v for k, v in metadata or () if k == AUTH_METADATA_KEY]
    if not values:
        raise AuthRefused("no credentials")
    if len(values) > 1 or not isinstance(values[0], str):
        raise AuthRefused("malformed credentials")
    parts = values[0].split(".", 5)
    if len(parts) != 6 or parts[0] != _VERSION:
        raise AuthRefused(f"malformed credentials (not {_VERSION})")
    _, ts, nonce, call_mac, body_mac, caller = parts
    caller_ok = CALLER_RE.fullmatch(caller) is not None
    if not caller_ok or not (ts.isascii() and ts.isdigit() and len(ts) <= _MAX_TS_DIGITS):
        raise AuthRefused("malformed credentials", caller if caller_ok else None)
    if not _NONCE_RE.fullmatch(nonce) or not (_MAC_RE.fullmatch(call_mac) and _MAC_RE.fullmatch(body_mac)):
        raise AuthRefused("malformed credentials", caller)
    return Token(int(ts), nonce, call_mac, body_mac, caller)


class ClusterAuth:
    """Signs and checks calls with the cluster's shared secret (module docstring).

    ``caller``: the name this process signs with (default ``default_caller()``). ``max_skew_s``:
    the accepted distance between a token's time and the holder's clock. ``max_nonces``: the
    capacity of the holder's replay table. Thread-safe.
    """

    def __init__(
        self,
        secret: str,
        max_skew_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        *,
        caller: str | None = None,
        max_nonces: int = DEFAULT_MAX_NONCES,
    ) -> None:
        check_secret(secret)
        caller = default_caller() if caller is None else caller
        if not isinstance(caller, str) or CALLER_RE.fullmatch(caller) is None:
            raise ValueError(f"caller must match {CALLER_RE.pattern}, got {caller!r}")
        self._key = secret.encode("utf-8")
        self.max_skew_s = max_skew_s
        self.caller = caller
        self._clock = clock
        self.nonces = NonceTable(max_nonces)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _mac(self, *fields: str) -> str:
        text = "\n".join((_VERSION, *fields))
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def _call_mac(self, method: str, caller: str, ts_ms: int, nonce: str) -> str:
        return self._mac("call", method, caller, str(ts_ms), nonce)

    def _body_mac(self, call_mac: str, body: bytes) -> str:
        return self._mac("body", call_mac, hashlib.sha256(body).hexdigest())

    def metadata(self, method: str, body: bytes) -> tuple[tuple[str, str], ...]:
        """Call metadata for one call of ``method`` (the full name, ``/pdserve.v1.KVTransfer/Pull``)
        whose serialized request is ``body``, exactly the bytes sent. Fresh nonce each time:
        use it for that one call only."""
        ts_ms, nonce = self._now_ms(), secrets.token_hex(16)
        call_mac = self._call_mac(method, self.caller, ts_ms, nonce)
        body_mac = self._body_mac(call_mac, bytes(body))
        return ((AUTH_METADATA_KEY, f"{_VERSION}.{ts_ms}.{nonce}.{call_mac}.{body_mac}.{self.caller}"),)

    def admit(self, method: str, metadata: Sequence[tuple[str, Any]] | None) -> Token:
        """A call of ``method`` admitted from its headers alone, before its request is read; raises
        ``AuthRefused`` unless the token is well formed, in time, its call MAC made for exactly this
        method (constant-time comparison), and its nonce unseen. Admitting spends the nonce: the
        token cannot admit another call, whatever becomes of this one. ``check_body`` must follow."""
        token = _parse(metadata)
        now = self._now_ms()
        skew_ms = int(self.max_skew_s * 1000)
        if abs(now - token.ts_ms) > skew_ms:
            raise AuthRefused("timestamp outside the window", token.caller)
        expected = self._call_mac(method, token.caller, token.ts_ms, token.nonce)
        if not hmac.compare_digest(token.call_mac, expected):
            raise AuthRefused("bad signature (secret or method differ)", token.caller)
        refused = self.nonces.add(token.nonce, token.ts_ms + skew_ms, now)
        if refused == "replayed":
            raise AuthRefused("replayed token (nonce already used)", token.caller)
        if refused == "full":
            raise AuthRefused(f"replay table full ({self.nonces.capacity} tokens in the window)", token.caller)
        return token

    def check_body(self, token: Token, body: bytes) -> str:
        """The verified caller of an admitted call whose request bytes are ``body``; raises
        ``AuthRefused`` unless the token's body MAC was made for exactly these bytes."""
        if not hmac.compare_digest(token.body_mac, self._body_mac(token.call_mac, bytes(body))):
            raise AuthRefused("bad signature (the request differs)", token.caller)
        return token.caller

    def authenticate(self, method: str, metadata: Sequence[tuple[str, Any]] | None, body: bytes) -> str:
        """``admit`` then ``check_body``: the verified caller of a call of ``method`` with request
        bytes ``body``, or ``AuthRefused``."""
        return self.check_body(self.admit(method, metadata), body)


class _RefusalLog:
    """Warnings about refused calls, at most ``burst`` per ``period_s`` (a flood of bad calls
    must not flood the log); the number left out is told in the next one."""

    def __init__(self, burst: int = 20, period_s: float = 10.0) -> None:
        self.burst, self.period_s = burst, period_s
        self._lock = threading.Lock()
        self._window_start = 0.0
        self._logged = 0
        self._suppressed = 0

    def warn(self, method: str, peer: str, refusal: AuthRefused) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self.period_s:
                self._window_start, self._logged = now, 0
            if self._logged >= self.burst:
                self._suppressed += 1
                return
            self._logged += 1
            suppressed, self._suppressed = self._suppressed, 0
        logger.warning("refused %s from %s (caller %r): %s%s", method, peer, refusal.caller, refusal.reason,
                       f" [{suppressed} more refusals not logged]" if suppressed else "")  # fmt: skip


class AuthInterceptor(grpc.ServerInterceptor):
    """Puts ``auth`` in front of every method of the server (module docstring).

    A call is admitted from its headers as it arrives (``ClusterAuth.admit``, on gRPC's own
    thread, before the call takes one of the server's). A refused call gets a handler that ends it
    with ``UNAUTHENTICATED`` without waiting for its request, so calls that never send one hold no
    thread. An admitted call's handler receives the raw request bytes, checks them against the
    token, and only then deserializes the request and calls the original behaviour. Refusals are
    logged (rate-limited) with the claimed caller and the peer. Request-streaming methods cannot be
    bound to one body and are refused outright.
    """

    def __init__(self, auth: ClusterAuth) -> None:
        self.auth = auth
        self._log = _RefusalLog()

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201 - grpc's signature
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: UNIMPLEMENTED, as without the interceptor
        method = handler_call_details.method
        if handler.request_streaming:
            return self._refusal(handler, method, AuthRefused("streaming requests cannot be authenticated"))
        try:
            token = self.auth.admit(method, tuple(handler_call_details.invocation_metadata or ()))
        except AuthRefused as refusal:
            return self._refusal(handler, method, refusal)
        return self._wrap(method, token, handler)

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, refusal: AuthRefused) -> grpc.RpcMethodHandler:
        """A handler that refuses the call without reading its request: a request-streaming
        handler is called at once, where a unary one would first wait for the whole request."""

        def refuse(request_iterator, context: grpc.ServicerContext):  # noqa: ANN001, ANN202
            self._log.warn(method, context.peer(), refusal)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs the cluster's credentials")

        streaming_out = handler.response_streaming
        make = grpc.stream_stream_rpc_method_handler if streaming_out else grpc.stream_unary_rpc_method_handler
        return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)

    def _wrap(self, method: str, token: Token, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        streaming_out = handler.response_streaming
        inner = handler.unary_stream if streaming_out else handler.unary_unary
        deserializer = handler.request_deserializer

        def behavior(raw: bytes, context: grpc.ServicerContext) -> Any:
            try:
                self.auth.check_body(token, raw)
            except AuthRefused as refusal:
                self._log.warn(method, context.peer(), refusal)
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs the cluster's credentials")
            try:
                request = raw if deserializer is None else deserializer(raw)
            except DecodeError:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "malformed request message")
            return inner(request, context)

        make = grpc.unary_stream_rpc_method_handler if streaming_out else grpc.unary_unary_rpc_method_handler
        # No request_deserializer: gRPC hands ``behavior`` the bytes exactly as received.
        return make(behavior, request_deserializer=None, response_serializer=handler.response_serializer)
