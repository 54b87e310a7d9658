"""The NIXL transport (``kvtransfer/nixl*.py``): real NIXL agents (UCX) and real gRPC over loopback,
holders in this process (``shm_support.Holder``, whose servicer a test can bend) or in their own
(``tests/support/transfer_peer.py --nixl``). Without the library these tests skip, except the ones
that show everything goes by gRPC then."""

from __future__ import annotations

import sys
import threading
from dataclasses import replace

import grpc
import numpy as np
import pytest
import torch

from pdserve.engine.kv_handover import KVHandover
from pdserve.engine.kv_tensor import KVTensor
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import ChecksumError, PeerUnavailableError
from pdserve.kvtransfer import nixl_server
from pdserve.kvtransfer.nixl import NixlAgent, NixlUnavailable, load_nixl, nixl_installed, split_ranges
from pdserve.kvtransfer.pull import pull_kv
from pdserve.kvtransfer.wire import PullStats
from pdserve.v1 import kvtransfer_pb2 as pb
from tests.kvtransfer.shm_support import SECRET, Holder
from tests.kvtransfer.test_transfer import (
    CHUNK,
    LAYOUT,
    LOCAL_BLOCKS,
    Peer,
    assert_no_leak,
    decode_request,
    expected,
    local_worker,
    pull,
    running,
)
from tests.support.polling import wait_until
from tests.support.transfer_peer import block_data

requires_nixl = pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed (pip install 'pdserve[nixl]')")
NB = LAYOUT.block_nbytes  # 1 KiB
# The puller's region holds two windows of 3 blocks: a pull of 8 goes in windows of 3, 3 and 2.
NIXL = TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=20.0, shm=False, nixl=True, nixl_region_bytes=6 * NB + 100)


def nixl_client(address: str, config: TransferConfig = NIXL) -> KVTransferClient:
    client = KVTransferClient(address, config)
    client.metadata()  # what negotiates the transport (a worker's check_compatible does it)
    return client


def pull_lease(holder: Holder, client: KVTransferClient, request_id: str, num_tokens: int) -> tuple[PullStats, str]:
    """Lease ``num_tokens`` on the holder and pull them into a fresh local pool as a decode worker
    does; check every block's bytes, end the load and check the pool is whole again; the stats
    and the lease."""
    lease = holder.lease(request_id, num_tokens)
    manager, handover = local_worker()
    req = Request(request_id, list(range(num_tokens)), SamplingParams(), LAYOUT.block_size)
    load = handover.reserve(req, num_tokens)
    assert load is not None
    try:
        stats = pull_kv(client, handover.kv_tensor, load, lease_id=lease)
        for j, block_id in enumerate(load.block_ids):
            assert torch.equal(handover.kv_tensor.block(block_id), expected(request_id, j)), j
    finally:
        handover.complete(req, load, ok=False)  # frees the blocks: the bytes were checked above
    assert_no_leak(manager)
    return stats, lease


def all_released(holder: Holder, leases: list[str]) -> bool:
    """The leases released (they were the holder's only ones), every block is back in its pool: no
    pull left a pin."""
    assert all(holder.source.release(lease) for lease in leases)
    return wait_until(lambda: holder.manager.num_free_blocks() == LOCAL_BLOCKS)


# -- from a holder in its own process ------------------------------------------------------
@pytest.fixture(scope="module")
def nixl_peers():
    if not nixl_installed():
        pytest.skip("NIXL is not installed (pip install 'pdserve[nixl]')")
    with running({"main": Peer("--nixl"),
                  "stall": Peer("--nixl", "--stall-nixl-from-block", "1", "--stall-s", "30")}) as started:  # fmt: skip
        yield started


@requires_nixl
def test_a_lease_pull_goes_by_nixl_in_windows_bit_exact(nixl_peers: dict[str, Peer]) -> None:
    """Leases of 3 blocks (the last partial) through a region of two windows of 2: two windows each."""
    peer = nixl_peers["main"]
    with nixl_client(peer.address, replace(NIXL, nixl_region_bytes=4 * NB)) as client:
        assert client.metadata().nixl
        for rid in ("lease-0", "lease-2"):  # 10 and 9 tokens
            manager, handover = local_worker()
            req = decode_request(peer, rid)
            load = handover.reserve(req, req.num_tokens)
            assert load is not None
            stats = pull_kv(client, handover.kv_tensor, load, lease_id=peer.request(rid)["lease_id"])
            for j, block_id in enumerate(load.block_ids):
                assert torch.equal(handover.kv_tensor.block(block_id), block_data(LAYOUT, 0, rid, j)), (rid, j)
            assert stats.transport == "nixl" and stats.num_chunks == 2  # two windows
            assert stats.num_tokens == req.num_tokens and stats.blocks[-1].block_hash == b""
            handover.complete(req, load, ok=True)
            assert req.num_computed_tokens == req.num_tokens
            manager.free(req)
            assert_no_leak(manager)


@requires_nixl
def test_a_pull_by_hash_goes_by_nixl(nixl_peers: dict[str, Peer]) -> None:
    peer = nixl_peers["main"]
    entry = peer.request("cached-0")  # 16 tokens: 4 full blocks in the peer's prefix cache
    hashes = [bytes.fromhex(h) for h in entry["block_hashes"]]
    _, handover = local_worker()
    dest = list(range(3, 3 + len(hashes)))  # any blocks of the local tensor: the client writes where told
    with nixl_client(peer.address) as client:
        stats = client.pull_into(handover.kv_tensor, dest, block_hashes=hashes)
    assert stats.transport == "nixl" and stats.num_chunks == 2 and [b.block_hash for b in stats.blocks] == hashes
    for j, block_id in enumerate(dest):
        assert torch.equal(handover.kv_tensor.block(block_id), block_data(LAYOUT, 0, "cached-0", j))


@requires_nixl
def test_a_prefix_pull_goes_by_nixl_and_takes_what_the_holder_has(nixl_peers: dict[str, Peer]) -> None:
    """A prefetch's pull (``prefix_wait_s``): the first window alone learns that the holder has 4 of the
    6 named blocks; the pull is those 4, in two windows of 2."""
    peer = nixl_peers["main"]
    hashes = [bytes.fromhex(h) for h in peer.request("cached-0")["block_hashes"]] + [bytes([9]) * 16] * 2
    _, handover = local_worker()
    with nixl_client(peer.address, replace(NIXL, nixl_region_bytes=4 * NB)) as client:
        stats = client.pull_into(handover.kv_tensor, list(range(6)), block_hashes=hashes, prefix_wait_s=0.05)
    assert (stats.transport, stats.num_blocks, stats.num_chunks, stats.num_tokens) == ("nixl", 4, 2, 16)
    for j in range(4):
        assert torch.equal(handover.kv_tensor.block(j), block_data(LAYOUT, 0, "cached-0", j))


@requires_nixl
def test_a_holder_killed_mid_pull_fails_it_and_every_block_is_returned(nixl_peers: dict[str, Peer]) -> None:
    """The holder dies after the first window landed: the pull fails (no fallback can reach a dead
    holder), and the decode side's blocks all go back."""
    peer = nixl_peers["stall"]
    manager, handover = local_worker()
    req = decode_request(peer, "lease-1")  # 7 tokens: 2 blocks, one per window
    errors: list[BaseException] = []
    with nixl_client(peer.address, replace(NIXL, nixl_region_bytes=NB)) as client:

        def run() -> None:
            try:
                pull(handover, req, client, req.num_tokens, lease_id=peer.request("lease-1")["lease_id"])
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        assert peer.wait_line("STALL") == "nixl"
        peer.kill()
        t.join(30)
        assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], PeerUnavailableError), errors
    assert_no_leak(manager)


@requires_nixl
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
def test_gpu_memory_moves_by_nixl_between_two_processes() -> None:
    """The holder's KV on the GPU (registered as device memory, written from it), the puller's on the
    same GPU, in two processes: the blocks land bit-exact."""
    peer = Peer("--nixl", "--device", "cuda")
    try:
        manager = KVCacheManager(LOCAL_BLOCKS, LAYOUT.block_size)
        handover = KVHandover(manager, KVTensor(LAYOUT, LOCAL_BLOCKS, device="cuda"))
        req = decode_request(peer, "lease-0")
        load = handover.reserve(req, req.num_tokens)
        assert load is not None
        with nixl_client(peer.address) as client:
            stats = pull_kv(client, handover.kv_tensor, load, lease_id=peer.request("lease-0")["lease_id"])
        assert stats.transport == "nixl"
        for j, block_id in enumerate(load.block_ids):
            assert torch.equal(handover.kv_tensor.block(block_id).cpu(), block_data(LAYOUT, 0, "lease-0", j))
        handover.complete(req, load, ok=False)
        assert_no_leak(manager)
    finally:
        peer.kill()


# -- from a holder in this process, bent where a test says ---------------------------------
@requires_nixl
def test_a_failed_nixl_write_falls_back_to_grpc_and_every_pin_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder's second window fails (as a write to a vanished peer does): the same pull is made
    over gRPC into the same blocks, bit-exact; the puller's region is ended; the holder's pins go."""
    with Holder(nixl=True) as holder, nixl_client(holder.address) as client:
        exporter = holder.servicer.nixl
        assert exporter is not None
        real, calls = exporter.write, []

        def second_fails(*args: object) -> None:
            calls.append(args)
            if len(calls) == 2:
                raise NixlUnavailable("the NIXL write to the puller failed: nixlRemoteDisconnectError")
            real(*args)

        monkeypatch.setattr(exporter, "write", second_fails)
        stats, first = pull_lease(holder, client, "r", 30)  # 8 blocks: windows of 3, 3, 2
        assert stats.transport == "grpc" and len(calls) >= 2  # the third may have been asked for meanwhile
        assert not client.nixl.has_region
        monkeypatch.setattr(exporter, "write", real)
        stats, second = pull_lease(holder, client, "s", 30)  # a new region, and NIXL again
        assert stats.transport == "nixl" and stats.num_chunks == 3
        assert all_released(holder, [first, second])


@requires_nixl
def test_blocks_larger_than_a_descriptor_go_in_pieces_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """With descriptors of at most 300 bytes, each 1 KiB block goes as pieces of 300, 300, 300 and 124."""
    monkeypatch.setattr(nixl_server, "DESC_BYTES", 300)
    with Holder(nixl=True) as holder, nixl_client(holder.address) as client:
        stats, lease = pull_lease(holder, client, "r", 30)  # checks every block's bytes
        assert stats.transport == "nixl" and stats.num_chunks == 3
        assert all_released(holder, [lease])


@requires_nixl
def test_one_pullers_windows_are_written_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two windows are asked for at once; the first write waits (up to 1 s) for a second to start
    beside it, and none does: the holder writes one puller's windows in turn."""
    with Holder(nixl=True) as holder, nixl_client(holder.address) as client:
        agent = holder.servicer.nixl.agent
        real, lock, active, most, second = agent.write, threading.Lock(), [0], [0], threading.Event()

        def counted(*args: object) -> None:
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
                if active[0] > 1:
                    second.set()
            try:
                second.wait(1.0)  # returns at once where a write runs beside this one
                real(*args)
            finally:
                with lock:
                    active[0] -= 1

        monkeypatch.setattr(agent, "write", counted)
        stats, lease = pull_lease(holder, client, "r", 30)  # windows of 3, 3, 2 blocks, two asked for at once
        assert stats.transport == "nixl" and stats.num_chunks == 3
        assert most[0] == 1
        assert all_released(holder, [lease])


@requires_nixl
def test_a_stalled_puller_does_not_hold_up_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first puller's write hangs until the second puller's whole pull has gone by NIXL."""
    with Holder(nixl=True) as holder, nixl_client(holder.address) as first, nixl_client(holder.address) as second:
        agent = holder.servicer.nixl.agent
        real, stalled, second_done = agent.write, [], threading.Event()

        def first_peer_stalls(local, remote, lengths, peer, *rest) -> None:  # type: ignore[no-untyped-def]
            if not stalled:
                stalled.append(peer)
            if peer == stalled[0]:
                second_done.wait(20.0)
            real(local, remote, lengths, peer, *rest)

        monkeypatch.setattr(agent, "write", first_peer_stalls)
        out: list[tuple[PullStats, str]] = []
        t = threading.Thread(target=lambda: out.append(pull_lease(holder, first, "a", 12)))
        t.start()
        assert wait_until(lambda: bool(stalled))  # the first puller's write is under way
        stats, lease_b = pull_lease(holder, second, "b", 30)
        done_while_stalled = not second_done.is_set() and t.is_alive()
        second_done.set()
        t.join(30)
        assert done_while_stalled and stats.transport == "nixl"
        assert out and out[0][0].transport == "nixl"
        assert all_released(holder, [out[0][1], lease_b])


def test_ranges_split_into_pieces_that_cover_them() -> None:
    local, remote = np.array([4096, 100_000], dtype=np.uint64), np.array([0, 1000], dtype=np.uint64)
    assert [a.tolist() for a in split_ranges(local, remote, 1000, 1000)] == [[4096, 100_000], [0, 1000], [1000, 1000]]
    pieces = split_ranges(local, remote, 1000, 300)
    assert [a.tolist() for a in pieces] == [
        [4096, 4396, 4696, 4996, 100_000, 100_300, 100_600, 100_900],
        [0, 300, 600, 900, 1000, 1300, 1600, 1900],
        [300, 300, 300, 100] * 2,
    ]


@requires_nixl
def test_a_missing_notification_falls_back_to_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes land but the notification names another tag: the puller does not take the window."""
    with Holder(nixl=True) as holder, nixl_client(holder.address, replace(NIXL, stall_timeout_s=0.3)) as client:
        exporter = holder.servicer.nixl
        assert exporter is not None
        real = exporter.write
        monkeypatch.setattr(exporter, "write", lambda md, addr, ids, tag: real(md, addr, ids, b"not-" + tag))
        stats, lease = pull_lease(holder, client, "r", 12)
        assert stats.transport == "grpc"
        assert all_released(holder, [lease])


@requires_nixl
def test_a_wrong_checksum_fails_the_pull() -> None:
    """A checksum that does not match the landed bytes is a failed pull, not a fallback."""

    with Holder(nixl=True) as holder, nixl_client(holder.address) as client:
        real = holder.servicer._write_window  # bending the test's own holder

        def corrupt(*args: object) -> pb.PullNixlResponse:
            answer = real(*args)
            answer.blocks[0].checksum ^= 1
            return answer

        holder.servicer._write_window = corrupt  # type: ignore[method-assign]
        lease = holder.lease("r", 8)
        _, handover = local_worker()
        with pytest.raises(ChecksumError):
            client.pull_into(handover.kv_tensor, [0, 1], lease_id=lease)
        assert not client.nixl.has_region  # a failed pull ends the region
        assert all_released(holder, [lease])


# -- attacks: a caller gets nothing written beyond what it is granted ----------------------------
def call_progressing(
    holder: Holder, agent: NixlAgent, request: pb.PullNixlRequest, secret: str | None
) -> pb.PullNixlResponse:
    """A PullNixl by hand, the caller's agent progressed meanwhile (as ``NixlPuller`` does)."""
    done = threading.Event()

    def progress() -> None:
        while not done.is_set():
            agent.poll_notifs()
            done.wait(0.0005)

    t = threading.Thread(target=progress)
    t.start()
    try:
        return holder.call("PullNixl", request, secret)
    finally:
        done.set()
        t.join()


def window(lease: str, metadata: bytes, region: torch.Tensor, num_blocks: int = 2, offset: int = 0,
           region_bytes: int | None = None) -> pb.PullNixlRequest:  # fmt: skip
    return pb.PullNixlRequest(pull=pb.PullRequest(lease_id=lease), num_blocks=num_blocks, agent_metadata=metadata,
                              region_addr=region.data_ptr() + offset, notif_tag=b"tag",
                              region_bytes=region.numel() - offset if region_bytes is None else region_bytes)  # fmt: skip


@pytest.fixture
def caller() -> NixlAgent:
    """A caller's own agent, as a puller has one."""
    if not nixl_installed():
        pytest.skip("NIXL is not installed (pip install 'pdserve[nixl]')")
    agent = NixlAgent("pdserve-puller-test-caller")
    yield agent
    agent.close()


@requires_nixl
def test_an_unauthenticated_caller_gets_nothing(caller: NixlAgent) -> None:
    """Unsigned or signed with another secret: UNAUTHENTICATED, no byte written, the caller's
    metadata never loaded. The same call signed as a cluster member gets the blocks."""
    with Holder(nixl=True, cluster_secret=SECRET) as holder:
        lease = holder.lease("victim", 8)
        region = torch.zeros(4 * NB, dtype=torch.uint8)
        metadata = caller.partial_metadata(caller.register(region))
        for secret in (None, "not-the-cluster-secret-but-long-enough"):
            with pytest.raises(grpc.RpcError) as err:
                call_progressing(holder, caller, window(lease, metadata, region), secret)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not region.any() and holder.servicer.nixl is not None and len(holder.servicer.nixl) == 0
        answer = call_progressing(holder, caller, window(lease, metadata, region), SECRET)
        assert not answer.refused and [b.index for b in answer.blocks] == [0, 1]
        landed = region[: 2 * NB].view(LAYOUT.dtype).view(2, *expected("victim", 0).shape)
        assert torch.equal(landed[0], expected("victim", 0)) and torch.equal(landed[1], expected("victim", 1))
        assert all_released(holder, [lease])


@requires_nixl
def test_a_window_beyond_what_the_caller_registered_lands_nowhere(caller: NixlAgent) -> None:
    """A member's window aimed at memory its metadata does not grant (another registration of its
    own agent, or past the end of its region) is refused, nothing written; a window larger than the
    region it names, or of a lease that is not there, is an error."""
    with Holder(nixl=True, cluster_secret=SECRET) as holder:
        lease = holder.lease("victim", 8)
        granted, other = torch.zeros(4 * NB, dtype=torch.uint8), torch.zeros(4 * NB, dtype=torch.uint8)
        metadata = caller.partial_metadata(caller.register(granted))
        caller.register(other)  # this agent's too, but not in the metadata the holder gets
        answer = call_progressing(holder, caller, window(lease, metadata, other), SECRET)
        assert answer.refused and not answer.blocks and not other.any()
        past_end = window(lease, metadata, granted, offset=3 * NB, region_bytes=8 * NB)  # block 2 of 2 past it
        answer = call_progressing(holder, caller, past_end, SECRET)
        assert answer.refused and not granted.any()
        for request, code in ((window(lease, metadata, granted, num_blocks=5), grpc.StatusCode.INVALID_ARGUMENT),
                              (window("no-such-lease", metadata, granted), grpc.StatusCode.NOT_FOUND)):  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                call_progressing(holder, caller, request, SECRET)
            assert err.value.code() == code
        assert not granted.any() and not other.any()
        assert all_released(holder, [lease])


# -- lifetimes, limits and the library's absence ---------------------------------------------
@requires_nixl
def test_an_idle_region_is_ended_and_the_next_pull_makes_one() -> None:
    with Holder(nixl=True) as holder, nixl_client(holder.address, replace(NIXL, shm_region_idle_s=0.05)) as client:
        first = pull_lease(holder, client, "r", 8)
        assert first[0].transport == "nixl" and client.nixl.has_region
        assert wait_until(lambda: client.nixl.trim() == 1) and not client.nixl.has_region
        second = pull_lease(holder, client, "s", 8)
        assert second[0].transport == "nixl"
        assert all_released(holder, [first[1], second[1]])


@requires_nixl
@pytest.mark.parametrize("ending", ["idle", "failed pull"])
def test_a_holder_reaches_nothing_of_an_ended_region_over_tcp(ending: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack: a holder keeps the metadata of a puller's region and writes to it after the region
    ended (trimmed when idle, or after a failed pull). Over UCX's TCP transport, as between hosts, a
    deregistered region is still reachable by that metadata; ending the puller's agent with it leaves
    the holder nothing: the write is refused and the memory (kept alive here, so the test can look)
    unchanged. The next pull makes a fresh agent and region."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # every agent of this test speaks TCP over loopback
    config = replace(NIXL, shm_region_idle_s=0.05, stall_timeout_s=2.0)
    with Holder(nixl=True) as holder, nixl_client(holder.address, config) as client:
        first = pull_lease(holder, client, "r", 8)
        assert first[0].transport == "nixl"
        region = client.nixl._region  # the test holds the memory, as a process reusing it would
        assert region is not None
        exporter = holder.servicer.nixl
        assert exporter is not None
        (puller,) = exporter.agent.peers()
        leases = [first[1]]
        if ending == "idle":
            assert wait_until(lambda: client.nixl.trim() == 1)
        else:
            real = exporter.write

            def fails(*args: object) -> None:
                raise NixlUnavailable("the NIXL write to the puller failed")

            monkeypatch.setattr(exporter, "write", fails)
            stats, lease = pull_lease(holder, client, "s", 8)  # over gRPC, the region ended
            assert stats.transport == "grpc"
            leases.append(lease)
            monkeypatch.setattr(exporter, "write", real)
        assert not client.nixl.has_region
        before = region.tensor.clone()
        marker = LOCAL_BLOCKS - 1  # a block no lease of this test takes, its bytes unlike anything pulled
        holder.handover.kv_tensor.block_bytes(marker).fill_(0x5A)
        source = np.asarray([exporter._base + marker * NB], dtype=np.uint64)
        late: list[BaseException] = []

        def write_late() -> None:  # over TCP it lands once the puller's agent progresses: during the next pull
            try:
                exporter.agent.write(source, np.asarray([region.addr], dtype=np.uint64), NB, puller, b"late", 3.0)
            except BaseException as exc:  # noqa: BLE001 - what the test looks at
                late.append(exc)

        attacker = threading.Thread(target=write_late)
        attacker.start()
        third = pull_lease(holder, client, "t", 8)
        while attacker.is_alive():  # progress the puller's agent until the late write has its answer
            agent = client.nixl._agent
            if agent is not None:
                agent.poll_notifs()
            attacker.join(0.001)
        assert torch.equal(region.tensor, before)  # nothing landed
        assert len(late) == 1 and isinstance(late[0], NixlUnavailable), late
        assert third[0].transport == "nixl" and client.nixl._region is not region
        assert all_released(holder, [*leases, third[1]])


@requires_nixl
def test_a_holder_keeps_at_most_its_limit_of_pullers_and_each_still_pulls() -> None:
    with Holder(nixl=True, nixl_max_peers=1) as holder, nixl_client(holder.address) as a, \
            nixl_client(holder.address) as b:  # fmt: skip
        leases = [pull_lease(holder, c, f"r{k}", 8) for k, c in enumerate((a, b, a))]
        assert [stats.transport for stats, _ in leases] == ["nixl"] * 3
        assert holder.servicer.nixl is not None and len(holder.servicer.nixl) == 1
        assert all_released(holder, [lease for _, lease in leases])


def hide_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails, as without the package


@requires_nixl
def test_loading_nixl_loads_cuda12_runtime_for_its_gpu_memory_module() -> None:
    """nixl-cu12's UCX links libcudart.so.12 for GPU memory; on a CUDA 13 machine only the
    nvidia-cuda-runtime-cu12 wheel has it. Loading NIXL maps that library into the process (a GPU
    machine's NIXL pull from GPU memory failed to register its memory without it)."""
    pytest.importorskip("nvidia.cuda_runtime", reason="nvidia-cuda-runtime-cu12 is not installed")
    load_nixl()
    maps = open("/proc/self/maps").read()
    assert "libcudart.so.12" in maps


def test_without_the_library_everything_goes_by_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_nixl(monkeypatch)
    with pytest.raises(NixlUnavailable, match=r"pip install 'pdserve\[nixl\]'"):
        load_nixl()
    assert not nixl_installed()
    with Holder(nixl=True) as holder, nixl_client(holder.address) as client:
        assert holder.servicer.nixl is None and not client.metadata().nixl
        stats, lease = pull_lease(holder, client, "r", 12)
        assert stats.transport == "grpc"
        assert all_released(holder, [lease])


@requires_nixl
def test_a_puller_without_the_library_pulls_from_a_nixl_holder_by_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    with Holder(nixl=True) as holder, nixl_client(holder.address) as client:
        assert client.metadata().nixl
        hide_nixl(monkeypatch)
        stats, first = pull_lease(holder, client, "r", 8)
        stats2, second = pull_lease(holder, client, "s", 8)  # NIXL is not tried again
        assert (stats.transport, stats2.transport) == ("grpc", "grpc")
        assert all_released(holder, [first, second])


def test_config_validation() -> None:
    for bad in ({"nixl": "yes"}, {"nixl_region_bytes": 0}, {"nixl_region_bytes": 2 << 30}, {"nixl_max_peers": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TransferConfig(**bad)  # type: ignore[arg-type]
