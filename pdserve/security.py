"""Transport security shared by the KV-transfer plane and the router: TLS and cluster authentication.

``TLSConfig`` turns user-supplied PEM files into gRPC credentials (server and channel), with
mutual TLS when a CA is given to check clients against.

``ClusterAuth`` authenticates the calls between the processes of one cluster with a shared
secret, without ever sending it: each call carries ``pdserve-auth: v1.<unix ms>.<hmac>``, the
HMAC-SHA256 of ``"<method>\\n<unix ms>"`` under the secret. A holder accepts a call whose MAC
matches and whose time is within ``max_skew_s`` of its own clock; anything else is refused with
``UNAUTHENTICATED`` before any handler runs. Someone who can read the traffic could replay a
call of the same method within that window: on a network you do not trust, use TLS as well.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

AUTH_METADATA_KEY = "pdserve-auth"
_VERSION = "v1"
MIN_SECRET_CHARS = 16


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


class ClusterAuth:
    """Signs and checks calls with the cluster's shared secret (module docstring)."""

    def __init__(self, secret: str, max_skew_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        check_secret(secret)
        self._key = secret.encode("utf-8")
        self.max_skew_s = max_skew_s
        self._clock = clock

    def _mac(self, method: str, ts_ms: str) -> str:
        return hmac.new(self._key, f"{method}\n{ts_ms}".encode(), hashlib.sha256).hexdigest()

    def metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        """Call metadata for ``method`` (the full name, ``/pdserve.v1.KVTransfer/Pull``)."""
        ts_ms = str(int(self._clock() * 1000))
        return ((AUTH_METADATA_KEY, f"{_VERSION}.{ts_ms}.{self._mac(method, ts_ms)}"),)

    def verify(self, method: str, metadata: tuple | list | None) -> bool:
        value = next((v for k, v in metadata or () if k == AUTH_METADATA_KEY), None)
        if not isinstance(value, str):
            return False
        parts = value.split(".")
        if len(parts) != 3 or parts[0] != _VERSION or not parts[1].isdigit():
            return False
        if abs(self._clock() * 1000 - int(parts[1])) > self.max_skew_s * 1000:
            return False
        return hmac.compare_digest(parts[2], self._mac(method, parts[1]))


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call that ``auth`` does not verify with ``UNAUTHENTICATED``; no handler runs."""

    def __init__(self, auth: ClusterAuth) -> None:
        self.auth = auth

    def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201 - grpc's signature
        if self.auth.verify(handler_call_details.method, handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None

        def refuse(request_or_iterator, context: grpc.ServicerContext):  # noqa: ANN001, ANN202
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this call needs the cluster's credentials")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)
