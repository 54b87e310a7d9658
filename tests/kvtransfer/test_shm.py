"""The same-host transport end to end: AttachRegion and PullRegion over real gRPC on loopback, the
regions and their slots over the holder's real Unix socket (SCM_RIGHTS, SO_PEERCRED), against a
holder in another process (tests/support/transfer_peer.py) and in-process holders whose servicer
the tests bend (tests/kvtransfer/shm_support.py): the bytes, when shared memory is used and when it
falls back, failures mid-pull, credentials. Tickets, the regions' pool and their owner:
test_shm_regions.py."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.engine.kv_tensor import KVTensor
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import BlockNotFoundError, ChecksumError, TransferError
from pdserve.kvtransfer.pull import pull_kv
from pdserve.kvtransfer.shm import host_id
from pdserve.kvtransfer.shm_socket import NAMING_GRACE_S
from pdserve.v1 import kvtransfer_pb2 as pb
from tests.kvtransfer.shm_support import (
    GRPC,
    REGION,
    SECRET,
    SHM,
    SLOT_BYTES,
    Holder,
    nothing_mapped,
    pool_size,
    region_fds,
    region_maps,
    shm_client,
)
from tests.kvtransfer.test_transfer import LAYOUT, LOCAL_BLOCKS, Peer, expected, local_worker
from tests.support.polling import wait_until

pytestmark = pytest.mark.skipif(not host_id(), reason="no readable kernel boot id: no same-host transport")


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer()
    try:
        assert p.info["port"] > 0
        yield p
    finally:
        p.kill()


def test_an_shm_pull_lands_the_bytes_of_a_grpc_pull(peer: Peer) -> None:
    lease0, lease2 = peer.request("lease-0")["lease_id"], peer.request("lease-2")["lease_id"]
    hashes = [bytes.fromhex(h) for h in peer.request("cached-0")["block_hashes"]]
    pulls = [  # (destination blocks, pull arguments): a partial last block, first_block > 0, by hash (wraps the ring)
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
        # One region carried every pull: the holder maps it once, as does the puller (each mapping keeps
        # the one descriptor Python's mmap holds, no other).
        assert pool_size(by_shm) == 1
        assert region_maps(peer.proc.pid) == len(region_fds(peer.proc.pid)) == 1
        assert region_maps() == len(region_fds()) == 1
    # Closing the client ends the region on both ends.
    assert nothing_mapped() and wait_until(lambda: nothing_mapped(peer.proc.pid))


def test_shm_is_used_only_for_the_same_host_with_a_socket_and_when_allowed() -> None:
    with Holder() as holder:
        lease = holder.lease("r", 10)
        cases = [  # (bend, client config) -> gRPC, never a region call
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
            assert stats.transport == "grpc" and holder.servicer.attach_calls == holder.servicer.pull_calls == 0
            assert all(torch.equal(kv.block(3 + j), expected("r", j)) for j in range(3))
        holder.servicer.socket = holder.shm.socket_path  # unbent: shared memory
        with shm_client(holder.address) as client:
            assert client.pull_into(local_worker()[1].kv_tensor, [0, 1, 2], lease_id=lease).transport == "shm"
        assert (holder.servicer.attach_calls, holder.servicer.pull_calls) == (1, 1)


def test_a_socket_that_refuses_falls_back_before_writing_and_the_ticket_expires(tmp_path: Path) -> None:
    dead = tmp_path / "dead.sock"  # a socket file nobody listens on: connect() is refused
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))
    with Holder(shm_ticket_ttl_s=0.3) as holder:
        holder.servicer.socket = str(dead)
        lease = holder.lease("r", 10)
        kv = local_worker()[1].kv_tensor
        with shm_client(holder.address) as client:
            assert client.pull_into(kv, [3, 4, 5], lease_id=lease).transport == "grpc"
            assert holder.servicer.attach_calls == 1 and len(holder.shm.attach_tickets) == 1  # granted, never used
            assert client.pull_into(kv, [3, 4, 5], lease_id=lease).transport == "grpc"
            assert holder.servicer.attach_calls == 1 and pool_size(client) == 0  # that socket is not tried again
            assert nothing_mapped()  # the region made for it went with the failed attach
        assert all(torch.equal(kv.block(3 + j), expected("r", j)) for j in range(3))
        assert wait_until(lambda: len(holder.shm.attach_tickets) == 0)  # expired


def test_a_killed_workers_socket_directory_is_swept_by_the_next(tmp_path: Path) -> None:
    dead = tmp_path / "pdserve-kv-dead"  # what a worker killed outright leaves: nobody listens
    dead.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead / "kv.sock"))
    unnamed = tmp_path / "pdserve-kv-unnamed"  # one killed before it named its socket
    unnamed.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(unnamed / "kv.sock.new"))
    old = time.time() - NAMING_GRACE_S - 1
    os.utime(unnamed, (old, old))
    starting = tmp_path / "pdserve-kv-starting"  # one made just now: its worker may be naming it
    starting.mkdir(mode=0o700)
    with Holder(shm_dir=str(tmp_path)) as first:
        assert not dead.exists() and not unnamed.exists() and starting.is_dir()
        starting.rmdir()
        with Holder(shm_dir=str(tmp_path)) as second:  # a live neighbour's directory stays
            assert Path(first.shm.socket_path).is_socket() and Path(second.shm.socket_path).is_socket()
            assert first.shm.server.directory != second.shm.server.directory
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bend", ["corrupt_slot", "fail_slot"])
def test_a_failure_mid_pull_fails_it_and_nothing_leaks(bend: str) -> None:
    with Holder() as holder:
        setattr(holder.servicer, bend, 1)  # the second slot
        lease = holder.lease("r", 10)
        manager, h = local_worker()
        req = Request("r", list(range(10)), SamplingParams(), LAYOUT.block_size)
        load = h.reserve(req, 10)
        assert load is not None
        with shm_client(holder.address) as client:
            with pytest.raises(ChecksumError if bend == "corrupt_slot" else TransferError) as err:
                try:
                    pull_kv(client, h.kv_tensor, load, lease_id=lease)
                finally:
                    h.complete(req, load, ok=False)
            if bend == "fail_slot":
                assert "holder failed the pull: the holder's KV tensor cannot be read" in str(err.value)
            assert manager.num_free_blocks() == LOCAL_BLOCKS and manager.pool.num_cached_hashes == 0
            assert holder.servicer.pull_calls == 1 and len(holder.shm.pull_tickets) == 0
            # The region the failed pull used is gone on both ends, and the holder's pins with it.
            assert pool_size(client) == 0
            assert wait_until(lambda: len(holder.shm) == 0 and nothing_mapped())
            assert holder.source.leases.active_pulls(lease) == 0
            setattr(holder.servicer, bend, -1)
            kv = local_worker()[1].kv_tensor  # the next pull gets a new region
            assert client.pull_into(kv, [0, 1, 2], lease_id=lease).transport == "shm" and pool_size(client) == 1


def test_no_ticket_without_the_clusters_credentials() -> None:
    with Holder(cluster_secret=SECRET) as holder:
        lease = holder.lease("r", 10)
        attach = pb.AttachRegionRequest(host_id=host_id(), region_bytes=REGION)
        pull = pb.PullRegionRequest(pull=pb.PullRequest(lease_id=lease), host_id=host_id(), region_id=bytes(16),
                                    slot_bytes=SLOT_BYTES)  # fmt: skip
        for method, request in (("AttachRegion", attach), ("PullRegion", pull)):
            for secret in (None, "another-cluster-secret-value"):
                with pytest.raises(grpc.RpcError) as err:
                    holder.call(method, request, secret=secret)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert holder.servicer.attach_calls == holder.servicer.pull_calls == 0
        assert len(holder.shm.attach_tickets) == 0 and len(holder.shm) == 0 and nothing_mapped()
        assert holder.call("AttachRegion", attach, secret=SECRET).ticket  # a member gets one
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
        assert holder.servicer.pull_calls == 2  # refused on the shared-memory path itself, no fallback
        # Nothing was written into the region: it stays, free, for the next pull.
        assert pool_size(client) == len(holder.shm) == 1
        lease = holder.lease("r", 10)
        assert client.pull_into(kv, [0, 1, 2], lease_id=lease).transport == "shm" and pool_size(client) == 1


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
    bad_values = ({"shm": "yes"}, {"shm_ticket_ttl_s": 0}, {"shm_dir": ""}, {"shm_region_bytes": 100},
                  {"shm_slot_bytes": 2 * REGION, "shm_region_bytes": REGION}, {"shm_regions": 0},
                  {"shm_max_regions": 0})  # fmt: skip
    for bad in bad_values:
        with pytest.raises(ValueError, match=next(reversed(bad)) if "shm_slot_bytes" not in bad else "shm_slot_bytes"):
            TransferConfig(**bad)  # type: ignore[arg-type]
