"""Replay attacks on the KV-transfer plane's tokens, performed against a real holder over gRPC.

The attacker has captured the exact ``pdserve-auth`` metadata (and request bytes) of a cluster
member's legitimate Pull, as someone reading a plaintext network would. Each token binds one call:
resent verbatim, put on another request body or another method, or sent late, it gets
``UNAUTHENTICATED`` and no bytes; the members' own pulls keep working; the holder's memory of used
nonces stays bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from pdserve.kvtransfer import client as client_module
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import AuthError, TransferError
from pdserve.security import AUTH_METADATA_KEY, AuthRefused, ClusterAuth, NonceTable
from pdserve.v1 import kvtransfer_pb2 as pb
from tests.kvtransfer.test_security import SECRET, Holder, dest

PULL = "/pdserve.v1.KVTransfer/Pull"
GET_METADATA = "/pdserve.v1.KVTransfer/GetMetadata"
RELEASE = "/pdserve.v1.KVTransfer/Release"


class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Keeps (method, metadata, request bytes) of every call that goes through the channel."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, bytes]] = []

    def _record(self, details: grpc.ClientCallDetails, request: Any) -> None:
        self.calls.append((details.method, tuple(details.metadata or ()), bytes(request)))

    def intercept_unary_unary(self, continuation, client_call_details, request):  # noqa: ANN001, ANN201
        self._record(client_call_details, request)
        return continuation(client_call_details, request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # noqa: ANN001, ANN201
        self._record(client_call_details, request)
        return continuation(client_call_details, request)

    def last(self, method: str) -> tuple[tuple, bytes]:
        return next((m, b) for name, m, b in reversed(self.calls) if name == method)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Every ``KVTransferClient`` made in the test sends through a recording interceptor."""
    rec = Recorder()
    real: Callable[..., grpc.Channel] = grpc.insecure_channel

    def recording_channel(target: str, options: Any = None) -> grpc.Channel:
        return grpc.intercept_channel(real(target, options=options), rec)

    monkeypatch.setattr(client_module.grpc, "insecure_channel", recording_channel)
    return rec


def raw_pull(address: str, body: bytes, metadata: tuple, method: str = PULL) -> tuple[grpc.StatusCode, int]:
    """Send ``body`` verbatim with ``metadata`` verbatim; (status, messages received)."""
    with grpc.insecure_channel(address) as channel:
        call: Iterator[bytes] = channel.unary_stream(method)(body, timeout=10, metadata=metadata)
        received = 0
        try:
            for _ in call:
                received += 1
        except grpc.RpcError as exc:
            return exc.code(), received
        return grpc.StatusCode.OK, received


def raw_unary(address: str, body: bytes, metadata: tuple, method: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(method)(body, timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def hash_pull(hashes: list[bytes]) -> bytes:
    return pb.PullRequest(block_hashes=pb.BlockHashes(hashes=hashes)).SerializeToString()


def test_a_captured_pull_token_replayed_verbatim_gets_nothing(recorder: Recorder,
                                                              caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    """The reported attack: one header captured from a decode worker's pull, reused 20 times."""
    with Holder(TransferConfig(cluster_secret=SECRET)) as holder:
        kv = dest()
        with KVTransferClient(holder.address, TransferConfig(cluster_secret=SECRET), caller="decode-7") as member:
            assert member.pull_into(kv, list(range(4)), block_hashes=holder.hashes).num_blocks == 4
        metadata, body = recorder.last(PULL)
        token = dict(metadata)[AUTH_METADATA_KEY]
        assert token.startswith("v3.") and token.endswith(".decode-7")
        with caplog.at_level(logging.WARNING, logger="pdserve.security"):
            for _ in range(20):
                assert raw_pull(holder.address, body, metadata) == (grpc.StatusCode.UNAUTHENTICATED, 0)
        assert "replayed token" in caplog.text and "'decode-7'" in caplog.text and PULL in caplog.text
        assert holder.idle()  # nothing was pinned for the replays


def test_a_token_is_bound_to_its_request_body(recorder: Recorder) -> None:
    """A captured token on other hashes or a lease id, and a fresh token on a body other than the
    one it signs: refused before any lookup (an authenticated call would get NOT_FOUND)."""
    with Holder(TransferConfig(cluster_secret=SECRET)) as holder:
        with KVTransferClient(holder.address, TransferConfig(cluster_secret=SECRET)) as member:
            member.pull_into(dest(), list(range(2)), block_hashes=holder.hashes[:2])
        captured, _ = recorder.last(PULL)
        others = (hash_pull(holder.hashes), hash_pull(holder.hashes[2:]),
                  pb.PullRequest(lease_id="another-lease").SerializeToString())  # fmt: skip
        for body in others:
            assert raw_pull(holder.address, body, captured) == (grpc.StatusCode.UNAUTHENTICATED, 0)
        # Fresh tokens, so only the body can be what is wrong. A token is spent as its call is
        # admitted from the headers, before the body arrives: refused for its body, it stays spent.
        signed = hash_pull(holder.hashes[:1])
        for body in (*others, signed + b"\x18\x01"):  # ... also the signed body with a field added
            fresh = ClusterAuth(SECRET).metadata(PULL, signed)
            assert raw_pull(holder.address, body, fresh) == (grpc.StatusCode.UNAUTHENTICATED, 0)
            assert raw_pull(holder.address, signed, fresh) == (grpc.StatusCode.UNAUTHENTICATED, 0)
        assert raw_pull(holder.address, signed, ClusterAuth(SECRET).metadata(PULL, signed)) == (grpc.StatusCode.OK, 1)
        assert holder.idle()


def test_a_token_is_bound_to_its_method(recorder: Recorder) -> None:
    with Holder(TransferConfig(cluster_secret=SECRET)) as holder:
        body = hash_pull(holder.hashes)
        for_get_metadata = ClusterAuth(SECRET).metadata(GET_METADATA, body)
        assert raw_pull(holder.address, body, for_get_metadata) == (grpc.StatusCode.UNAUTHENTICATED, 0)
        for_pull = ClusterAuth(SECRET).metadata(PULL, body)
        for method in (GET_METADATA, RELEASE):
            assert raw_unary(holder.address, body, for_pull, method) == grpc.StatusCode.UNAUTHENTICATED
        assert raw_pull(holder.address, body, for_pull)[0] == grpc.StatusCode.OK  # still unspent
        # A captured Release token cannot pull, nor release another lease.
        with KVTransferClient(holder.address, TransferConfig(cluster_secret=SECRET)) as member:
            assert member.release("some-lease") is False
        release_md, release_body = recorder.last(RELEASE)
        assert raw_pull(holder.address, release_body, release_md) == (grpc.StatusCode.UNAUTHENTICATED, 0)
        other_release = pb.ReleaseRequest(lease_id="another-lease").SerializeToString()
        assert raw_unary(holder.address, other_release, release_md, RELEASE) == grpc.StatusCode.UNAUTHENTICATED


def test_stale_and_future_tokens_are_refused() -> None:
    with Holder(TransferConfig(cluster_secret=SECRET)) as holder:
        body = hash_pull(holder.hashes)
        for offset_s in (-61.0, 61.0, -3600.0):
            md = ClusterAuth(SECRET, clock=lambda o=offset_s: time.time() + o).metadata(PULL, body)
            assert raw_pull(holder.address, body, md) == (grpc.StatusCode.UNAUTHENTICATED, 0)
        md = ClusterAuth(SECRET, clock=lambda: time.time() - 30).metadata(PULL, body)  # within the window
        assert raw_pull(holder.address, body, md)[0] == grpc.StatusCode.OK


@pytest.mark.parametrize("value", [
    "v1.1.00",  # older formats
    "v2." + ".".join(["1", "0" * 32, "0" * 64, "c"]),
    "v3.1.00.00.00",
    "v3." + ".".join(["1", "0" * 32, "0" * 64, "0" * 64, "bad caller"]),
    "v3." + ".".join(["x1", "0" * 32, "0" * 64, "0" * 64, "c"]),
    "v3." + ".".join(["1", "0" * 32, "0" * 64, "0" * 63, "c"]),
    "now",  # well formed, in time, wrong MACs
])  # fmt: skip
def test_malformed_tokens_are_refused(value: str) -> None:
    auth = ClusterAuth(SECRET)
    if value == "now":
        value = "v3." + ".".join([str(int(time.time() * 1000)), "0" * 32, "0" * 64, "0" * 64, "c"])
    with pytest.raises(AuthRefused):
        auth.authenticate(PULL, ((AUTH_METADATA_KEY, value),), b"")
    good = auth.metadata(PULL, b"")
    with pytest.raises(AuthRefused, match="malformed"):  # two tokens: ambiguous
        auth.authenticate(PULL, good + ((AUTH_METADATA_KEY, value),), b"")
    assert len(auth.nonces) == 0


def test_members_pull_many_times_in_a_row_and_concurrently() -> None:
    config = TransferConfig(cluster_secret=SECRET, max_pulls_per_peer=4)
    with Holder(config) as holder, KVTransferClient(holder.address, config, caller="decode-0") as member:
        auth = holder.server.auth
        assert auth is not None
        accepted = []  # calls the holder authenticated, whatever their method
        check_body = auth.check_body

        def counted(*args: object, **kwargs: object) -> object:
            out = check_body(*args, **kwargs)
            accepted.append(1)
            return out

        auth.check_body = counted  # type: ignore[method-assign]
        rows = holder.handover.kv_tensor.tensor[[holder.manager.pool.get_cached_block(h).block_id
                                                 for h in holder.hashes]]  # fmt: skip
        for _ in range(30):
            kv = dest()
            assert member.pull_into(kv, list(range(4)), block_hashes=holder.hashes).num_blocks == 4
            assert torch.equal(kv.tensor[:4], rows)
        errors: list[BaseException] = []

        def pull_some() -> None:
            try:
                for _ in range(8):
                    kv = dest()
                    member.pull_into(kv, list(range(4)), block_hashes=holder.hashes)
                    assert torch.equal(kv.tensor[:4], rows)
                    member.metadata()
            except (TransferError, AssertionError) as exc:
                errors.append(exc)

        threads = [threading.Thread(target=pull_some) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        # Every call spent its own nonce: the pulls and metadata calls, the AttachRegion calls for
        # the member's staging regions, and a same-host pull the holder turned away before its
        # stream (all regions busy) spends one more.
        regions = member.shm.pool.size if member.shm.pool is not None else 0
        assert 1 <= regions <= 4 and len(accepted) >= 30 + 8 * 8 * 2 + regions
        assert len(holder.server.auth.nonces) == len(accepted)


def test_the_nonce_table_is_bounded_and_forgets_with_the_window() -> None:
    now = [1_000.0]
    auth = ClusterAuth(SECRET, max_skew_s=60.0, clock=lambda: now[0], max_nonces=8)
    for i in range(8):
        auth.authenticate(PULL, auth.metadata(PULL, b"%d" % i), b"%d" % i)
    md = auth.metadata(PULL, b"x")
    with pytest.raises(AuthRefused, match="table full"):
        auth.authenticate(PULL, md, b"x")
    assert len(auth.nonces) == 8
    now[0] += 61.0  # the eight tokens left the window: their nonces are forgotten
    md = auth.metadata(PULL, b"y")
    assert auth.authenticate(PULL, md, b"y") == auth.caller
    assert len(auth.nonces) == 1
    with pytest.raises(AuthRefused, match="replayed"):
        auth.authenticate(PULL, md, b"y")
    table = NonceTable(4)
    assert [table.add(f"{i:032x}", 10, 0) for i in range(6)] == [None] * 4 + ["full"] * 2
    assert table.add("0" * 32, 10, 11) is None and len(table) == 1  # all expired, then one added


def test_a_holder_refuses_rather_than_grows_when_its_nonce_table_is_full() -> None:
    config = TransferConfig(cluster_secret=SECRET, auth_max_nonces=5)
    with Holder(config) as holder, KVTransferClient(holder.address, config) as member:
        for _ in range(5):
            member.pull_into(dest(), list(range(4)), block_hashes=holder.hashes)
        with pytest.raises(AuthError):
            member.pull_into(dest(), list(range(4)), block_hashes=holder.hashes)
        assert len(holder.server.auth.nonces) == 5 and holder.idle()
