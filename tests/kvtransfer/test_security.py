"""Attacks on the KV-transfer plane, performed against a real holder over gRPC: reading KV
without the cluster's credentials, over a plaintext or foreign TLS connection, and stalling the
holder with streams that are never read. Each must fail, and leave the holder serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.engine.kv_handover import KVHandover
from pdserve.engine.kv_tensor import KVLayout, KVTensor
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import AuthError, PeerUnavailableError, TransferError
from pdserve.kvtransfer.server import start_transfer_server
from pdserve.kvtransfer.source import BlockSource
from pdserve.security import AUTH_METADATA_KEY, ClusterAuth, TLSConfig
from pdserve.v1 import kvtransfer_pb2 as pb
from pdserve.v1 import kvtransfer_pb2_grpc as pb_grpc
from tests.support.polling import wait_until
from tests.support.tls import make_certs

SECRET = "a-cluster-secret-of-enough-length"
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)  # 1 KiB blocks


class Holder:
    """A pool whose cached blocks hold a known "prompt", served over gRPC."""

    def __init__(self, config: TransferConfig, layout: KVLayout = SMALL, num_blocks: int = 16,
                 num_tokens: int = 16) -> None:  # fmt: skip
        self.manager = KVCacheManager(num_blocks, layout.block_size)
        self.handover = KVHandover(self.manager, KVTensor(layout, num_blocks))
        self.handover.kv_tensor.tensor.normal_()
        req = Request("secret-prompt", [4, 4, 1, 7] * (num_tokens // 4), SamplingParams(), layout.block_size)
        assert self.manager.allocate_slots(req, num_tokens) is not None
        self.manager.free(req)  # cached and free: what a pull by hash reads
        self.hashes = list(req.block_hashes)
        self.source = BlockSource(self.handover, model_fingerprint="fp", worker_id="holder", config=config)
        self.server = start_transfer_server(self.source, config)
        self.address = f"localhost:{self.server.port}"

    def idle(self) -> bool:
        return self.manager.num_free_blocks() == self.manager.num_blocks

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def dest(layout: KVLayout = SMALL, n: int = 16) -> KVTensor:
    return KVTensor(layout, n)


def test_calls_without_the_clusters_credentials_get_nothing() -> None:
    with Holder(TransferConfig(cluster_secret=SECRET)) as holder:
        for secret in (None, "another-cluster-secret-value"):
            kv = dest()
            with KVTransferClient(holder.address, TransferConfig(cluster_secret=secret)) as client:
                with pytest.raises(AuthError, match="refused the credentials"):
                    client.metadata()
                with pytest.raises(AuthError):
                    client.pull_into(kv, list(range(4)), block_hashes=holder.hashes)
                with pytest.raises(AuthError):
                    client.release("any")
            assert not kv.tensor.any()  # not one byte of KV arrived
        # The raw attack: Pull by hashes read from Redis, with no or a replayed stale signature.
        with grpc.insecure_channel(holder.address) as channel:
            stub = pb_grpc.KVTransferStub(channel)
            request = pb.PullRequest(block_hashes=pb.BlockHashes(hashes=holder.hashes))
            body = request.SerializeToString()
            stale = ClusterAuth(SECRET, clock=lambda: time.time() - 3600).metadata("/pdserve.v1.KVTransfer/Pull", body)
            wrong_method = ClusterAuth(SECRET).metadata("/pdserve.v1.KVTransfer/GetMetadata", body)
            for metadata in ((), stale, wrong_method, ((AUTH_METADATA_KEY, "v1.1.00"),)):
                received = []
                with pytest.raises(grpc.RpcError) as err:
                    received.extend(stub.Pull(request, timeout=10, metadata=metadata))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and received == []
        assert holder.idle()  # nothing was pinned for them
        # A cluster member gets the blocks.
        kv = dest()
        with KVTransferClient(holder.address, TransferConfig(cluster_secret=SECRET)) as client:
            assert client.metadata().worker_id == "holder"
            assert client.pull_into(kv, list(range(4)), block_hashes=holder.hashes).num_blocks == 4
        assert torch.equal(kv.tensor[:4], holder.handover.kv_tensor.tensor[[holder.manager.pool.get_cached_block(h)
                                                                           .block_id for h in holder.hashes]])


def test_tls_and_mutual_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    server_tls = TLSConfig(certs.server_cert, certs.server_key, ca_file=certs.ca)  # mutual: clients need a cert
    member = TLSConfig(certs.client_cert, certs.client_key, ca_file=certs.ca)
    with Holder(TransferConfig(cluster_secret=SECRET, tls=server_tls)) as holder:
        kv = dest()
        with KVTransferClient(holder.address, TransferConfig(cluster_secret=SECRET, tls=member)) as client:
            assert client.pull_into(kv, list(range(4)), block_hashes=holder.hashes).num_blocks == 4
        for tls in (None, TLSConfig(ca_file=certs.ca), TLSConfig(certs.client_cert, certs.client_key,
                                                                  ca_file=certs.other_ca)):
            cfg = TransferConfig(cluster_secret=SECRET, tls=tls, metadata_timeout_s=3)
            with KVTransferClient(holder.address, cfg) as client, pytest.raises(PeerUnavailableError):
                client.metadata()  # plaintext, no client certificate, or the server is not trusted
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        TLSConfig(cert_file=certs.server_cert)
    with pytest.raises(ValueError, match="no such file"):
        TLSConfig(ca_file=str(tmp_path / "missing.pem"))


def test_streams_that_are_never_read_cannot_stall_the_holder() -> None:
    """Eight pulls of 32 MiB whose reader never reads: the holder keeps answering, refuses what
    is over the per-peer limit at once, cancels the stalled streams and serves the next pull."""
    big = KVLayout(num_layers=8, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.float32)  # 512 KiB
    config = TransferConfig(cluster_secret=SECRET, max_pulls_per_peer=4, stall_timeout_s=1.0, chunk_bytes=1 << 20)
    with Holder(config, big, num_blocks=64, num_tokens=64 * 16) as holder:
        auth = ClusterAuth(SECRET)
        channel = grpc.insecure_channel(holder.address, options=config.channel_options())
        stub = pb_grpc.KVTransferStub(channel)
        request = pb.PullRequest(block_hashes=pb.BlockHashes(hashes=holder.hashes))
        body = request.SerializeToString()
        stuck = [stub.Pull(request, timeout=60, metadata=auth.metadata("/pdserve.v1.KVTransfer/Pull", body))
                 for _ in range(8)]  # fmt: skip
        guard = holder.server.servicer.guard
        try:
            # (code() would wait for a call to end: ask only the calls that are done)
            assert wait_until(lambda: sum(c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                                          for c in stuck) == 4)  # fmt: skip
            with KVTransferClient(holder.address, TransferConfig(cluster_secret=SECRET)) as client:
                t0 = time.monotonic()
                assert client.metadata().worker_id == "holder"  # the holder still answers, at once
                assert time.monotonic() - t0 < 2
                # The stalled streams are cut, their pins dropped, and pulls flow again.
                ended = wait_until(lambda: guard.cancelled >= 4 and guard.active() == 0, timeout=30)
                # (what each stream's call says, should a loaded machine ever end one otherwise)
                assert ended, (guard.cancelled, guard.active(), [c.code() if c.done() else "open" for c in stuck])
                assert wait_until(holder.idle)
                kv = dest(big, 64)
                assert client.pull_into(kv, list(range(64)), block_hashes=holder.hashes).num_blocks == 64
        finally:
            for call in stuck:
                call.cancel()
            channel.close()


def test_calls_that_never_send_their_request_cannot_take_the_holders_threads() -> None:
    """Calls without credentials, or with a well-formed token of a wrong MAC, that send their
    headers and never their request: each is refused from its headers at once, so three times as
    many as the holder has threads leave a member's calls served."""
    config = TransferConfig(cluster_secret=SECRET, server_threads=4)
    forged = "v3." + ".".join([str(int(time.time() * 1000)), "0" * 32, "0" * 64, "0" * 64, "decode-0"])
    with Holder(config) as holder, grpc.insecure_channel(holder.address) as channel:
        never_sent = threading.Event()

        def no_request() -> Iterator[bytes]:
            never_sent.wait()
            yield from ()

        calls = []
        for method in ("/pdserve.v1.KVTransfer/Pull", "/pdserve.v1.KVTransfer/GetMetadata"):
            call = channel.stream_stream(method, request_serializer=bytes, response_deserializer=bytes)
            for metadata in ((), ((AUTH_METADATA_KEY, forged),)):
                calls += [call(no_request(), timeout=60, metadata=metadata) for _ in range(3)]
        try:
            assert wait_until(lambda: all(c.done() for c in calls), timeout=30)
            # Each is refused as it arrives; one that comes while the holder's threads are taken by
            # the refusals of others is refused as over the limit instead: none waits for a request.
            codes = {c.code() for c in calls}
            assert grpc.StatusCode.UNAUTHENTICATED in codes
            assert codes <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
            with KVTransferClient(holder.address, TransferConfig(cluster_secret=SECRET)) as client:
                assert client.metadata().worker_id == "holder"
                assert client.pull_into(dest(), list(range(4)), block_hashes=holder.hashes).num_blocks == 4
            assert holder.server.servicer.guard.refused == 0
        finally:
            never_sent.set()
            for call in calls:
                call.cancel()


def test_a_puller_keeps_to_the_per_peer_limit() -> None:
    """The client side waits for one of its pull slots instead of tripping the holder's limit."""
    config = TransferConfig(cluster_secret=SECRET, max_pulls_per_peer=2)
    with Holder(config) as holder, KVTransferClient(holder.address, config) as client:
        errors: list[BaseException] = []

        def pull() -> None:
            try:
                client.pull_into(dest(), list(range(4)), block_hashes=holder.hashes)
            except TransferError as exc:  # noqa: PERF203 - reported to the test thread
                errors.append(exc)

        threads = [threading.Thread(target=pull) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and holder.server.servicer.guard.refused == 0
