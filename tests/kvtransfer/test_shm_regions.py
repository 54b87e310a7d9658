"""The same-host transport's regions and tickets, over real gRPC and the holder's real Unix socket,
with in-process holders (tests/kvtransfer/shm_support.py): attach and pull tickets are good once, on
their own region; a region is only ever used by the holder it was given to; concurrent pulls through
one client; the pool freed when the client closes; a pull larger than its region."""

from __future__ import annotations

import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from pdserve.engine.kv_tensor import KVTensor
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.shm import TICKET_BYTES, ShmUnavailable, create_region, host_id
from pdserve.kvtransfer.shm_frames import GO, REFUSED, SLOT, recv_frame, send_frame
from pdserve.kvtransfer.shm_socket import attach_region
from pdserve.v1 import kvtransfer_pb2 as pb
from tests.kvtransfer.shm_support import (
    REGION,
    SHM,
    Holder,
    nothing_mapped,
    pool_size,
    region_fds,
    region_maps,
    shm_client,
)
from tests.kvtransfer.test_transfer import LAYOUT, LOCAL_BLOCKS, expected, local_worker
from tests.support.polling import wait_until

pytestmark = pytest.mark.skipif(not host_id(), reason="no readable kernel boot id: no same-host transport")


def test_attach_tickets_are_good_once_within_their_ttl_and_only_as_issued() -> None:
    with Holder(shm_ticket_ttl_s=0.3) as holder:
        path = holder.shm.socket_path
        grant = holder.call("AttachRegion", pb.AttachRegionRequest(host_id=host_id(), region_bytes=REGION))
        assert not grant.refused and len(grant.ticket) == TICKET_BYTES and grant.ticket_ttl_ms == 300
        fd = create_region(REGION)
        try:
            with pytest.raises(ShmUnavailable, match="admits a region of 4096 bytes, not 8192"):
                attach_region(path, grant.ticket, fd, 2 * REGION, 5)  # another size than granted: spent
            grant = holder.call("AttachRegion", pb.AttachRegionRequest(host_id=host_id(), region_bytes=REGION))
            sock, region_id = attach_region(path, grant.ticket, fd, REGION, 5)
            assert len(holder.shm) == 1 and holder.shm.region(region_id) is not None
            for ticket in (grant.ticket, secrets.token_bytes(TICKET_BYTES)):  # used, made up
                with pytest.raises(ShmUnavailable, match="refused the region: unknown, used or expired") as err:
                    attach_region(path, ticket, fd, REGION, 5)
                assert not err.value.permanent
            late = holder.call("AttachRegion", pb.AttachRegionRequest(host_id=host_id(), region_bytes=REGION))
            assert wait_until(lambda: len(holder.shm.attach_tickets) == 0)  # the reaper dropped it
            with pytest.raises(ShmUnavailable, match="unknown, used or expired"):
                attach_region(path, late.ticket, fd, REGION, 5)
        finally:
            os.close(fd)
        sock.close()  # the puller lets the region go: so does the holder
        assert wait_until(lambda: len(holder.shm) == 0)
        for request in (pb.AttachRegionRequest(host_id="another-boot-id/0", region_bytes=REGION),
                        pb.AttachRegionRequest(host_id=host_id(), region_bytes=1 << 31)):  # fmt: skip
            assert holder.call("AttachRegion", request).refused
        assert len(holder.shm.attach_tickets) == 0


def test_pull_tickets_are_good_once_and_on_their_own_region_only() -> None:
    with Holder() as holder:
        lease = holder.lease("r", 10)
        (sock_a, region_a), (sock_b, region_b) = holder.attach(), holder.attach()
        offer = holder.pull_region(lease, region_a)
        assert not offer.refused and len(offer.ticket) == TICKET_BYTES
        assert holder.pull_region(lease, region_a).refused == "the region carries another pull"
        send_frame(sock_b, GO, offer.ticket)  # on another region's channel: refused, and spent
        assert recv_frame(sock_b)[0] == REFUSED
        send_frame(sock_a, GO, offer.ticket)
        assert recv_frame(sock_a)[0] == REFUSED
        assert wait_until(lambda: holder.source.leases.active_pulls(lease) == 0)  # the refused pull's pins are gone
        offer = holder.pull_region(lease, region_a)
        for ticket in (secrets.token_bytes(TICKET_BYTES), b"short"):  # made up, malformed
            send_frame(sock_a, GO, ticket)
            assert recv_frame(sock_a)[0] == REFUSED
        send_frame(sock_a, GO, offer.ticket)
        assert recv_frame(sock_a)[0] == SLOT  # redeemed on its own region, it runs
        sock_a.close()  # the puller vanishes mid-pull: the holder drops the region and the pins
        assert wait_until(lambda: len(holder.shm) == 1 and holder.source.leases.active_pulls(lease) == 0)
        assert holder.pull_region(lease, region_a).refused == "unknown region"
        refused = holder.pull_region(lease, region_b, host="another-boot-id/0").refused
        assert refused == "the puller runs on another host"
        sock_b.close()


def test_a_region_whose_last_pull_is_still_ending_on_the_holder_is_waited_for() -> None:
    """The puller asks for its next pull once it acknowledged the last slot; the holder's channel
    thread may not have ended that pull yet (a loaded machine): the holder waits, it does not refuse."""
    with Holder() as holder:
        lease = holder.lease("r", 10)
        sock, region_id = holder.attach()
        region = holder.shm.region(region_id)
        assert region is not None and region.reserve()  # the pull before, not yet ended on the holder
        asked, reserve = threading.Event(), region.reserve

        def reserve_seen(wait_s: float = 0.0) -> bool:
            asked.set()
            return reserve(wait_s)

        region.reserve = reserve_seen  # type: ignore[method-assign]
        with ThreadPoolExecutor(1) as pool:
            offer = pool.submit(holder.pull_region, lease, region_id)
            assert asked.wait(10)
            region.end_pull()
            assert not offer.result(timeout=10).refused
        sock.close()  # the puller goes: the holder drops the region and the filed pull's pins
        assert wait_until(lambda: len(holder.shm) == 0 and holder.source.leases.active_pulls(lease) == 0)


def test_a_region_is_only_ever_used_by_the_holder_it_was_given_to() -> None:
    with Holder() as first, Holder() as second:
        lease1, lease2 = first.lease("r", 10), second.lease("s", 10)
        with shm_client(first.address) as client:
            assert client.pull_into(local_worker()[1].kv_tensor, [0, 1, 2], lease_id=lease1).transport == "shm"
            assert client.shm.pool is not None
            region_id = client.shm.pool._idle[0].region_id
            assert first.shm.region(region_id) is not None and len(second.shm) == 0
            # The second holder was never given it: a pull naming it is refused, nothing is pinned.
            assert second.pull_region(lease2, region_id).refused == "unknown region"
            assert second.source.leases.active_pulls(lease2) == 0
            assert region_maps() == 2  # the puller's mapping and the first holder's, nobody else's
        assert wait_until(lambda: len(first.shm) == 0 and nothing_mapped())


def pull_at_once(client: KVTransferClient, leases: dict[str, str], rounds: int = 5) -> list[str]:
    """Every lease pulled by a thread of its own, ``rounds`` times, the threads starting each round
    together, each pull checked bit for bit; the transports that carried them."""
    start = threading.Barrier(len(leases))
    transports: list[str] = []
    errors: list[BaseException] = []

    def pull(rid: str) -> None:
        kv = KVTensor(LAYOUT, LOCAL_BLOCKS)
        try:
            for round_ in range(rounds):
                start.wait(10)
                dest = [(round_ + j) % LOCAL_BLOCKS for j in range(3)]
                kv.tensor.zero_()
                transports.append(client.pull_into(kv, dest, lease_id=leases[rid]).transport)
                for j, block_id in enumerate(dest):
                    assert torch.equal(kv.block(block_id), expected(rid, j))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=pull, args=(rid,)) for rid in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return transports


def test_concurrent_pulls_through_one_client_are_bit_exact() -> None:
    with Holder() as holder:
        leases = {f"r{k}": holder.lease(f"r{k}", 12) for k in range(4)}  # 3 blocks each: 12 of the 16
        for regions in (4, 2):  # a region per pull; then two of them over gRPC at a time
            with shm_client(holder.address, replace(SHM, shm_regions=regions)) as client:
                transports = pull_at_once(client, leases)
                assert 1 <= pool_size(client) <= regions and len(holder.shm) == pool_size(client)
            assert len(transports) == 20 and "shm" in transports and set(transports) <= {"shm", "grpc"}
            assert wait_until(lambda: len(holder.shm) == 0 and nothing_mapped())


def test_the_pool_is_freed_when_the_client_closes() -> None:
    with Holder() as holder:
        leases = [holder.lease(f"r{k}", 8) for k in range(2)]
        client = shm_client(holder.address, replace(SHM, shm_regions=2))
        try:
            pool = client.shm.region_pool(holder.shm.socket_path)
            assert pool is not None
            deadline = time.monotonic() + 10
            regions = [pool.take(deadline), pool.take(deadline)]  # two pulls at once make two regions
            assert pool.take(deadline) is None and None not in regions  # a third finds all in use: over gRPC
            for region in regions:
                pool.give(region)
            for k, lease in enumerate(leases):
                assert client.pull_into(local_worker()[1].kv_tensor, [k, k + 2], lease_id=lease).transport == "shm"
            assert pool.size == len(holder.shm) == 2
            assert region_maps() == len(region_fds()) == 4  # each region mapped by puller and holder, nothing else
        finally:
            client.close()  # also when an assertion fails: its regions must not stay mapped into the next test
        assert wait_until(lambda: len(holder.shm) == 0 and nothing_mapped())
        assert pool.size == 0


def test_a_pull_larger_than_the_region_goes_round_its_ring() -> None:
    with Holder() as holder:
        lease = holder.lease("big", 58)  # 15 blocks, the last partial: 15 KiB through a 4 KiB ring of 1.5 KiB slots
        kv = local_worker()[1].kv_tensor
        dest = list(range(15, 0, -1))
        with shm_client(holder.address) as client:
            stats = client.pull_into(kv, dest, lease_id=lease)
        assert stats.transport == "shm" and stats.num_tokens == 58 and stats.num_chunks == 10
        assert all(torch.equal(kv.block(b), expected("big", j)) for j, b in enumerate(dest))


def test_a_region_idle_for_its_time_is_ended_on_both_sides_and_remade_on_demand() -> None:
    with Holder() as holder:
        leases = [holder.lease(f"r{k}", 8) for k in range(2)]
        now = [0.0]
        client = shm_client(holder.address, replace(SHM, shm_regions=2))
        try:
            # The pool's rule, on its own clock: only regions idle for idle_s or longer go.
            pool = client.shm.region_pool(holder.shm.socket_path)
            assert pool is not None
            pool.idle_s, pool._clock = 30.0, lambda: now[0]  # noqa: SLF001 - the test's clock
            deadline = time.monotonic() + 10
            first, second = pool.take(deadline), pool.take(deadline)
            assert first is not None and second is not None
            pool.give(first)
            now[0] = 20.0
            pool.give(second)
            now[0] = 40.0  # first idle 40 s, second 20 s
            assert client.shm.trim() == 1 and pool.size == 1
            assert wait_until(lambda: len(holder.shm) == 1)  # the holder let go of it too
            now[0] = 50.0
            assert pool.trim() == 1 and pool.size == 0
            assert wait_until(lambda: len(holder.shm) == 0 and nothing_mapped())
            # The next pull makes a region again and still goes by shared memory.
            kv = local_worker()[1].kv_tensor
            assert client.pull_into(kv, [1, 3], lease_id=leases[0]).transport == "shm"
            assert torch.equal(kv.block(1), expected("r0", 0)) and pool.size == 1
        finally:
            client.close()
        assert wait_until(lambda: len(holder.shm) == 0 and nothing_mapped())


def test_a_client_ends_a_region_idle_for_shm_region_idle_s() -> None:
    """The config's idle time, through a real client: the region goes once it has been idle that long."""
    with Holder() as holder:
        lease = holder.lease("r0", 8)
        with shm_client(holder.address, replace(SHM, shm_region_idle_s=0.05)) as client:
            assert client.pull_into(local_worker()[1].kv_tensor, [0, 1], lease_id=lease).transport == "shm"
            assert len(holder.shm) == 1
            assert wait_until(lambda: client.shm.trim() == 1)
            assert wait_until(lambda: len(holder.shm) == 0 and nothing_mapped())
