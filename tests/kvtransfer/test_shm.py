"""The same-host transport end to end: PullShm over real gRPC on loopback, the memfd over the
holder's real Unix socket (SCM_RIGHTS), against a holder in another process
(tests/support/transfer_peer.py) and in-process holders whose servicer the tests bend."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.engine.kv_handover import KVHandover
from pdserve.engine.kv_tensor import KVTensor
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import BlockNotFoundError, ChecksumError
from pdserve.kvtransfer.pull import pull_kv
from pdserve.kvtransfer.server import KVTransferServicer, start_transfer_server
from pdserve.kvtransfer.shm import TICKET_BYTES, ShmUnavailable, StagedRegion, host_id
from pdserve.kvtransfer.shm_socket import fetch_region
from pdserve.kvtransfer.source import BlockSource, PinnedBlocks
from pdserve.security import ClusterAuth
from pdserve.v1 import kvtransfer_pb2 as pb
from pdserve.v1 import kvtransfer_pb2_grpc as pb_grpc
from tests.kvtransfer.test_transfer import CHUNK, FP, LAYOUT, LOCAL_BLOCKS, Peer, expected, local_worker
from tests.support.polling import wait_until

SECRET = "a-cluster-secret-for-shm-tests"
SHM = TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=20.0)
GRPC = replace(SHM, shm=False)
PULL_SHM = "/pdserve.v1.KVTransfer/PullShm"

pytestmark = pytest.mark.skipif(not host_id(), reason="no readable kernel boot id: no same-host transport")


def memfds(pid: int | str = "self") -> list[str]:
    """The staged regions a process holds open: its descriptors that are our memfds."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith("/memfd:pdserve-kv"):
            out.append(target)
    return out


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer()
    try:
        assert p.info["port"] > 0
        yield p
    finally:
        p.kill()


class BentServicer(KVTransferServicer):
    """The real servicer, with what a test asks bent: the advertised host id or socket, or one
    block's checksum in every staged region. Counts PullShm calls."""

    def __init__(self, source: BlockSource) -> None:
        super().__init__(source)
        self.host_id: str | None = None
        self.socket: str | None = None
        self.corrupt = False
        self.shm_calls = 0

    def GetMetadata(self, request, context):  # type: ignore[override]
        msg = super().GetMetadata(request, context)
        if self.host_id is not None:
            msg.host_id = self.host_id
        if self.socket is not None:
            msg.shm_socket = self.socket
        return msg

    def PullShm(self, request, context):  # type: ignore[override]
        self.shm_calls += 1
        return super().PullShm(request, context)

    def _stage(self, pinned: PinnedBlocks, progress: Callable[[], None]) -> StagedRegion:
        region = super()._stage(pinned, progress)
        if self.corrupt:  # the bytes stay, the checksum no longer matches them
            region.blocks = (replace(region.blocks[0], checksum=region.blocks[0].checksum ^ 1), *region.blocks[1:])
        return region


class Holder:
    """An in-process holder (a pool behind the KV-handover API) with a ``BentServicer``."""

    def __init__(self, **config: object) -> None:
        defaults: dict[str, object] = {"chunk_bytes": CHUNK, "reap_interval_s": 0.05}
        self.config = TransferConfig(**{**defaults, **config})  # type: ignore[arg-type]
        self.manager = KVCacheManager(LOCAL_BLOCKS, LAYOUT.block_size)
        self.handover = KVHandover(self.manager, KVTensor(LAYOUT, LOCAL_BLOCKS))
        self.source = BlockSource(self.handover, model_fingerprint=FP, worker_id="inproc", config=self.config)
        self.servicer = BentServicer(self.source)
        self.server = start_transfer_server(self.source, self.config, servicer=self.servicer)
        assert self.server.shm is not None
        self.shm = self.server.shm
        self.address = self.server.address

    def lease(self, request_id: str, num_tokens: int) -> str:
        req = Request(request_id, list(range(num_tokens)), SamplingParams(), LAYOUT.block_size)
        assert self.manager.allocate_slots(req, num_tokens) is not None
        req.num_computed_tokens = num_tokens
        for j, block_id in enumerate(self.manager.get_block_ids(request_id)):
            self.handover.kv_tensor.block(block_id).copy_(expected(request_id, j))
        return self.source.lease(self.handover.hold(req, num_tokens))

    def raw_pull_shm(self, lease_id: str, secret: str | None = None, host: str | None = None) -> pb.PullShmResponse:
        """PullShm by hand, as an attacker or a test would call it (signed with ``secret``)."""
        request = pb.PullShmRequest(pull=pb.PullRequest(lease_id=lease_id), host_id=host_id() if host is None else host)
        metadata = ClusterAuth(secret).metadata(PULL_SHM, request.SerializeToString()) if secret else ()
        with grpc.insecure_channel(self.address) as channel:
            return pb_grpc.KVTransferStub(channel).PullShm(request, timeout=10, metadata=metadata)

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        directory = self.shm.fd_server.directory
        self.server.stop()
        assert not os.path.exists(directory)  # the socket's private directory goes with the server
        assert memfds() == []  # nothing staged outlives the server, in holder or puller


def shm_client(address: str, config: TransferConfig = SHM) -> KVTransferClient:
    client = KVTransferClient(address, config)
    client.metadata()  # what negotiates the transport (a worker's check_compatible does it)
    return client


# -- against a holder process ------------------------------------------------------------------
def test_an_shm_pull_lands_the_bytes_of_a_grpc_pull(peer: Peer) -> None:
    lease0, lease2 = peer.request("lease-0")["lease_id"], peer.request("lease-2")["lease_id"]
    hashes = [bytes.fromhex(h) for h in peer.request("cached-0")["block_hashes"]]
    pulls = [  # (destination blocks, pull arguments): a partial last block, first_block > 0, by hash
        ([3, 7, 1], {"lease_id": lease0}),
        ([5, 2], {"lease_id": lease2, "first_block": 1}),
        ([9, 0, 14, 6], {"block_hashes": hashes}),
    ]
    with KVTransferClient(peer.address, SHM) as client:
        meta = client.metadata()
    assert meta.host_id == host_id() and Path(meta.shm_socket).is_socket()
    assert oct(Path(meta.shm_socket).parent.stat().st_mode & 0o777) == "0o700"
    with shm_client(peer.address) as by_shm, KVTransferClient(peer.address, GRPC) as by_grpc:
        for dest, kwargs in pulls:
            kv_shm, kv_grpc = KVTensor(LAYOUT, LOCAL_BLOCKS), KVTensor(LAYOUT, LOCAL_BLOCKS)
            shm = by_shm.pull_into(kv_shm, dest, **kwargs)
            grpc_ = by_grpc.pull_into(kv_grpc, dest, **kwargs)
            assert (shm.transport, grpc_.transport) == ("shm", "grpc")
            assert torch.equal(kv_shm.tensor, kv_grpc.tensor)  # byte for byte, untouched blocks included
            assert (shm.num_blocks, shm.num_bytes, shm.num_tokens, shm.blocks) == (
                grpc_.num_blocks, grpc_.num_bytes, grpc_.num_tokens, grpc_.blocks)  # fmt: skip
        assert [b.num_tokens for b in by_shm.pull_into(kv_shm, [3, 7, 1], lease_id=lease0).blocks] == [4, 4, 2]
        for j, block_id in enumerate([3, 7, 1]):
            assert torch.equal(kv_shm.block(block_id), expected("lease-0", j))
    # The holder closed each region once handed over.
    assert wait_until(lambda: memfds(peer.proc.pid) == []), memfds(peer.proc.pid)


def test_shm_is_used_only_for_the_same_host_with_a_socket_and_when_allowed() -> None:
    with Holder() as holder:
        lease = holder.lease("r", 10)
        cases = [  # (bend, client config) -> gRPC, never a PullShm call
            (lambda s: setattr(s, "host_id", "another-boot-id/0"), SHM),
            (lambda s: setattr(s, "socket", "/nonexistent/pdserve-kv/kv.sock"), SHM),
            (lambda s: None, GRPC),
        ]
        for bend, config in cases:
            holder.servicer.host_id = holder.servicer.socket = None
            bend(holder.servicer)
            kv = local_worker()[1].kv_tensor
            with shm_client(holder.address, config) as client:
                stats = client.pull_into(kv, [3, 4, 5], lease_id=lease)
            assert stats.transport == "grpc" and holder.servicer.shm_calls == 0
            assert all(torch.equal(kv.block(3 + j), expected("r", j)) for j in range(3))
        holder.servicer.socket = holder.shm.socket_path  # unbent: shared memory
        with shm_client(holder.address) as client:
            assert client.pull_into(local_worker()[1].kv_tensor, [0, 1, 2], lease_id=lease).transport == "shm"
        assert holder.servicer.shm_calls == 1


def test_a_socket_that_refuses_falls_back_before_writing_and_the_region_expires(tmp_path: Path) -> None:
    dead = tmp_path / "dead.sock"  # a socket file nobody listens on: connect() is refused
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))
    with Holder(shm_ticket_ttl_s=0.3) as holder:
        holder.servicer.socket = str(dead)
        lease = holder.lease("r", 10)
        kv = local_worker()[1].kv_tensor
        with shm_client(holder.address) as client:
            assert client.pull_into(kv, [3, 4, 5], lease_id=lease).transport == "grpc"
            assert holder.servicer.shm_calls == 1 and len(holder.shm.tickets) == 1  # staged, never redeemed
            assert client.pull_into(kv, [3, 4, 5], lease_id=lease).transport == "grpc"
            assert holder.servicer.shm_calls == 1  # that socket is not tried again
        assert all(torch.equal(kv.block(3 + j), expected("r", j)) for j in range(3))
        assert wait_until(lambda: len(holder.shm.tickets) == 0 and memfds() == [])  # expired: closed


def test_a_killed_workers_socket_directory_is_swept_by_the_next(tmp_path: Path) -> None:
    dead = tmp_path / "pdserve-kv-dead"  # what a worker killed outright leaves: nobody listens
    dead.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead / "kv.sock"))
    with Holder(shm_dir=str(tmp_path)) as first:
        assert not dead.exists()
        with Holder(shm_dir=str(tmp_path)) as second:  # a live neighbour's directory stays
            assert Path(first.shm.socket_path).is_socket() and Path(second.shm.socket_path).is_socket()
            assert first.shm.fd_server.directory != second.shm.fd_server.directory
    assert list(tmp_path.iterdir()) == []


def test_a_ticket_is_good_once_within_its_ttl_and_only_as_issued() -> None:
    with Holder(shm_ticket_ttl_s=0.3) as holder:
        lease = holder.lease("r", 10)
        path = holder.shm.socket_path
        offer = holder.raw_pull_shm(lease)
        assert not offer.refused and len(offer.ticket) == TICKET_BYTES and offer.ticket_ttl_ms == 300
        fd = fetch_region(path, offer.ticket, 5)
        try:
            assert os.fstat(fd).st_size == offer.region_bytes == 3 * LAYOUT.block_nbytes
            assert os.pread(fd, LAYOUT.block_nbytes, offer.blocks[1].offset) == expected("r", 1).numpy().tobytes()
        finally:
            os.close(fd)
        for ticket in (offer.ticket, secrets.token_bytes(TICKET_BYTES), b"short"):  # used, made up, malformed
            with pytest.raises(ShmUnavailable, match="refused the ticket") as err:
                fetch_region(path, ticket, 5)
            assert not err.value.permanent
        late = holder.raw_pull_shm(lease)
        assert wait_until(lambda: len(holder.shm.tickets) == 0)  # the reaper closed it
        with pytest.raises(ShmUnavailable, match="refused the ticket"):
            fetch_region(path, late.ticket, 5)
        # A holder stages nothing for another host's puller.
        assert holder.raw_pull_shm(lease, host="another-boot-id/0").refused == "the puller runs on another host"
        assert len(holder.shm.tickets) == 0 and memfds() == []


def test_a_corrupted_region_fails_the_pull_and_nothing_leaks() -> None:
    with Holder() as holder:
        holder.servicer.corrupt = True
        lease = holder.lease("r", 10)
        manager, h = local_worker()
        req = Request("r", list(range(10)), SamplingParams(), LAYOUT.block_size)
        load = h.reserve(req, 10)
        assert load is not None
        with shm_client(holder.address) as client, pytest.raises(ChecksumError):
            try:
                pull_kv(client, h.kv_tensor, load, lease_id=lease)
            finally:
                h.complete(req, load, ok=False)
        assert manager.num_free_blocks() == LOCAL_BLOCKS and manager.pool.num_cached_hashes == 0
        assert holder.servicer.shm_calls == 1 and len(holder.shm.tickets) == 0


def test_no_ticket_without_the_clusters_credentials() -> None:
    with Holder(cluster_secret=SECRET) as holder:
        lease = holder.lease("r", 10)
        for secret in (None, "another-cluster-secret-value"):
            with pytest.raises(grpc.RpcError) as err:
                holder.raw_pull_shm(lease, secret=secret)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert holder.servicer.shm_calls == 0 and len(holder.shm.tickets) == 0 and memfds() == []
        assert holder.raw_pull_shm(lease, secret=SECRET).ticket  # a member gets one
        with shm_client(holder.address, replace(SHM, cluster_secret=SECRET)) as client:
            assert client.pull_into(local_worker()[1].kv_tensor, [0, 1, 2], lease_id=lease).transport == "shm"


def test_an_unknown_lease_or_hash_is_not_found_as_over_grpc() -> None:
    with Holder() as holder, shm_client(holder.address) as client:
        kv = local_worker()[1].kv_tensor
        with pytest.raises(BlockNotFoundError) as err:
            client.pull_into(kv, [0, 1], lease_id="no-such-lease")
        assert err.value.code == "NOT_FOUND" and "no-such-lease" in str(err.value)
        unknown = bytes(range(16))
        with pytest.raises(BlockNotFoundError) as err:
            client.pull_into(kv, [0], block_hashes=[unknown])
        assert err.value.missing_hashes == [unknown]
        assert holder.servicer.shm_calls == 2  # refused on the shared-memory path itself, no fallback


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_the_socket() -> None:
    with Holder() as holder:
        pid = os.fork()
        if pid == 0:  # the child: nobody, trying the socket; exit status 0 = kept out
            status = 2
            try:
                os.setgid(65534)
                os.setuid(65534)
                socket.socket(socket.AF_UNIX).connect(holder.shm.socket_path)
                status = 1
            except PermissionError:
                status = 0
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


def test_config_validation() -> None:
    for bad in ({"shm": "yes"}, {"shm_ticket_ttl_s": 0}, {"shm_dir": ""}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TransferConfig(**bad)  # type: ignore[arg-type]
