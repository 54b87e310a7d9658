"""The KV wire end to end: real gRPC over loopback, holders in separate processes
(tests/support/transfer_peer.py) except where a test must look inside the holder's pool."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pdserve.engine.kv_handover import HeldKV, KVHandover, KVLoad
from pdserve.engine.kv_tensor import KVLayout, KVTensor
from pdserve.engine.kvcache.manager import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.config import TransferConfig
from pdserve.kvtransfer.errors import (
    BlockNotFoundError,
    ChecksumError,
    InvalidPullError,
    LayoutMismatchError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
)
from pdserve.kvtransfer.leases import LeaseNotFoundError, LeaseTable
from pdserve.kvtransfer.protoconv import WireFormatError, chunk_from_proto, chunk_to_proto, decode_chunk, encode_chunk
from pdserve.kvtransfer.pull import pull_kv
from pdserve.kvtransfer.server import KVTransferServicer, start_transfer_server
from pdserve.kvtransfer.source import BlockSource
from pdserve.kvtransfer.wire import Chunk, Piece, plan_chunks
from pdserve.v1 import kvtransfer_pb2 as pb
from tests.support import REPO
from tests.support.polling import wait_until
from tests.support.transfer_peer import block_data

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)  # 1 KiB blocks
FP = "test-model"
CHUNK = 1536  # 1.5 blocks: blocks are split across chunks and chunks carry several pieces
CFG = TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=20.0)
LOCAL_BLOCKS = 16
PEER_ARGS = ["--chunk-bytes", str(CHUNK), "--lease-tokens", "10,7,9,6,5", "--cached-tokens", "16,12"]


# -- peers in separate processes ----------------------------------------------------------
class Peer:
    def __init__(self, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.transfer_peer", *PEER_ARGS, *extra],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self._info: dict | None = None

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def wait_line(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    @property
    def info(self) -> dict:
        if self._info is None:
            self._info = json.loads(self.wait_line("READY"))
        return self._info

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.info['port']}"

    def request(self, request_id: str) -> dict:
        return next(r for r in self.info["requests"] if r["request_id"] == request_id)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@contextmanager
def running(started: dict[str, Peer]) -> Iterator[dict[str, Peer]]:
    """Peers started together (their torch imports overlap), each waited for, all killed at the end."""
    try:
        for p in started.values():
            assert p.info["port"] > 0
        yield started
    finally:
        for p in started.values():
            p.kill()


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    with running({
        "main": Peer(),
        "corrupt": Peer("--corrupt-chunk", "1"),
        "stall": Peer("--stall-after-chunk", "0", "--stall-s", "30"),
        "doomed": Peer("--stall-after-chunk", "0", "--stall-s", "30"),
        "other": Peer("--head-dim", "16"),
    }) as started:  # fmt: skip
        yield started


def local_worker() -> tuple[KVCacheManager, KVHandover]:
    """A decode side's pool behind the KV-handover API (the manager kept for assertions)."""
    manager = KVCacheManager(LOCAL_BLOCKS, LAYOUT.block_size)
    return manager, KVHandover(manager, KVTensor(LAYOUT, LOCAL_BLOCKS))


def decode_request(peer: Peer, request_id: str) -> Request:
    """The decode side's copy of a peer's request: the same prompt."""
    return Request(request_id, peer.request(request_id)["token_ids"], SamplingParams(), LAYOUT.block_size)


def pull(h: KVHandover, req: Request, client: KVTransferClient, num_tokens: int, lease_id: str | None = None) -> KVLoad:
    """What a decode worker does: reserve, pull, complete (freeing everything on failure)."""
    load = h.reserve(req, num_tokens)
    assert load is not None
    ok = False
    try:
        pull_kv(client, h.kv_tensor, load, lease_id=lease_id)
        ok = True
    finally:
        h.complete(req, load, ok)
    return load


def expected(request_id: str, index: int, seed: int = 0) -> torch.Tensor:
    return block_data(LAYOUT, seed, request_id, index)


def assert_no_leak(manager: KVCacheManager) -> None:
    assert manager.num_free_blocks() == LOCAL_BLOCKS
    assert not manager.req_to_blocks
    manager.check_invariants()


# -- pulls from a peer process ------------------------------------------------------------
def test_metadata_and_compatibility(peers: dict[str, Peer]) -> None:
    with KVTransferClient(peers["main"].address, CFG) as client:
        meta = client.check_compatible(LAYOUT, FP)
        assert (meta.worker_id, meta.layout.block_nbytes, meta.layout.dtype) == ("peer", 1024, "float32")
        assert meta.max_chunk_bytes == CHUNK


def test_pull_by_hash_from_prefix_cache(peers: dict[str, Peer]) -> None:
    peer = peers["main"]
    hashes = [bytes.fromhex(h) for h in peer.request("cached-0")["block_hashes"]]
    kv = local_worker()[1].kv_tensor
    dest = [9, 2, 14, 5]  # any order, not contiguous
    with KVTransferClient(peer.address, CFG) as client:
        stats = client.pull_into(kv, dest, block_hashes=hashes)
    assert (stats.num_blocks, stats.num_bytes, stats.num_tokens, stats.num_chunks) == (4, 4096, 16, 3)
    for j, block_id in enumerate(dest):
        assert torch.equal(kv.block(block_id), expected("cached-0", j))
    assert [b.block_hash for b in stats.blocks] == hashes


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_prefix_pull_takes_the_cached_blocks_before_the_first_missing_one(peers: dict[str, Peer],
                                                                            transport: str) -> None:  # fmt: skip
    """``prefix_wait_s``: the holder sends the longest cached prefix of the hashes (the blocks of a
    prompt it is still prefilling), by either transport; none cached within the wait is NOT_FOUND; a
    lease pull cannot ask."""
    peer = peers["main"]
    hashes = [bytes.fromhex(h) for h in peer.request("cached-0")["block_hashes"]]
    later = [bytes([7]) * 16, bytes([8]) * 16]  # blocks the holder has not computed (yet)
    kv = local_worker()[1].kv_tensor
    with KVTransferClient(peer.address, replace(CFG, shm=transport == "shm")) as client:
        client.metadata()  # what negotiates the transport
        stats = client.pull_into(kv, [3, 4, 5, 6, 7, 8], block_hashes=hashes + later, prefix_wait_s=0.05)
        assert stats.transport == transport
        assert (stats.num_blocks, stats.num_tokens) == (4, 16) and [b.block_id for b in stats.blocks] == [3, 4, 5, 6]
        for j in range(4):
            assert torch.equal(kv.block(3 + j), expected("cached-0", j))
        with pytest.raises(BlockNotFoundError):
            client.pull_into(kv, [9], block_hashes=later[:1], prefix_wait_s=0.05)
        with pytest.raises(InvalidPullError, match="by hash only"):
            client.pull_into(kv, [9], lease_id=peer.request("lease-0")["lease_id"], prefix_wait_s=0.05)


def test_pull_by_lease_with_partial_block(peers: dict[str, Peer]) -> None:
    peer = peers["main"]
    manager, h = local_worker()
    kv = h.kv_tensor
    req = decode_request(peer, "lease-0")  # 10 tokens: 2 full blocks + 2 tokens
    lease_id = peer.request("lease-0")["lease_id"]
    with KVTransferClient(peer.address, CFG) as client:
        load = h.reserve(req, 10)
        assert load is not None
        assert (load.num_local_hit_tokens, load.num_external_tokens, len(load.block_ids)) == (0, 10, 3)
        stats = pull_kv(client, kv, load, lease_id=lease_id)
        assert [b.num_tokens for b in stats.blocks] == [4, 4, 2]
        assert stats.blocks[-1].block_hash == b""
        for j, block_id in enumerate(load.block_ids):
            assert torch.equal(kv.block(block_id), expected("lease-0", j))
        assert not any(manager.pool.get_cached_block(x) for x in req.block_hashes)  # not cached while loading
        h.complete(req, load, ok=True)
        # The full blocks are now in the local prefix cache, the request is ready to decode.
        assert req.num_computed_tokens == 10
        assert all(manager.pool.get_cached_block(x) for x in req.block_hashes[:2])
        manager.check_invariants()
        assert client.release(lease_id)  # the decode worker gives the lease back: nothing left to pull
        with pytest.raises(BlockNotFoundError):
            client.pull_into(kv, [15], lease_id=lease_id, first_block=2)


def test_lease_pull_skips_locally_cached_prefix(peers: dict[str, Peer]) -> None:
    peer = peers["main"]
    manager, h = local_worker()
    kv = h.kv_tensor
    # The decode worker already has block 0 of lease-2's prompt in its own prefix cache.
    prior = decode_request(peer, "lease-2")
    manager.allocate_slots(prior, 4)
    kv.block(manager.get_block_ids("lease-2")[0]).copy_(expected("lease-2", 0))
    manager.free(prior)
    req = decode_request(peer, "lease-2")
    with KVTransferClient(peer.address, CFG) as client:
        load = h.reserve(req, 9)
        assert load is not None and (load.num_local_hit_tokens, load.num_external_tokens, load.first_block) == (4, 5, 1)
        stats = pull_kv(client, kv, load, lease_id=peer.request("lease-2")["lease_id"])
        h.complete(req, load, ok=True)
    assert [b.index for b in stats.blocks] == [1, 2]
    for j, block_id in enumerate(manager.get_block_ids("lease-2")):
        assert torch.equal(kv.block(block_id), expected("lease-2", j))
    manager.free(req)
    assert_no_leak(manager)


def test_release_then_pull_is_not_found(peers: dict[str, Peer]) -> None:
    peer = peers["main"]
    lease_id = peer.request("lease-1")["lease_id"]
    kv = local_worker()[1].kv_tensor
    with KVTransferClient(peer.address, CFG) as client:
        assert client.release(lease_id) is True
        assert client.release(lease_id) is False  # idempotent
        with pytest.raises(BlockNotFoundError) as err:
            client.pull_into(kv, [0, 1], lease_id=lease_id)
    assert err.value.code == "NOT_FOUND" and lease_id in str(err.value)


def test_unknown_hash_is_named_and_nothing_leaks(peers: dict[str, Peer]) -> None:
    peer = peers["main"]
    known = [bytes.fromhex(h) for h in peer.request("cached-1")["block_hashes"]]
    unknown = bytes(range(16))
    manager, h = local_worker()
    with KVTransferClient(peer.address, CFG) as client:
        with pytest.raises(BlockNotFoundError) as err:
            client.pull_into(h.kv_tensor, [0, 1, 2], block_hashes=[known[0], unknown, known[1]])
        assert err.value.missing_hashes == [unknown] and unknown.hex() in str(err.value)
        # As a decode worker would: a prompt the holder never saw.
        req = Request("fresh", list(range(100, 117)), SamplingParams(), LAYOUT.block_size)
        with pytest.raises(BlockNotFoundError):
            pull(h, req, client, 16)
    assert_no_leak(manager)


def test_checksum_mismatch_detected_and_nothing_leaks(peers: dict[str, Peer]) -> None:
    peer = peers["corrupt"]
    manager, h = local_worker()
    with KVTransferClient(peer.address, CFG) as client:
        req = decode_request(peer, "lease-0")
        with pytest.raises(ChecksumError):
            pull(h, req, client, 10, lease_id=peer.request("lease-0")["lease_id"])
        assert_no_leak(manager)
        req = decode_request(peer, "cached-0")
        with pytest.raises(ChecksumError):
            pull(h, req, client, 16)
    assert_no_leak(manager)
    assert manager.pool.num_cached_hashes == 0  # nothing half-written was cached


def test_peer_killed_mid_stream(peers: dict[str, Peer]) -> None:
    peer = peers["doomed"]
    manager, h = local_worker()
    req = decode_request(peer, "lease-0")
    outcome: list[BaseException | object] = []

    def run() -> None:
        with KVTransferClient(peer.address, CFG) as client:
            try:
                outcome.append(pull(h, req, client, 10, lease_id=peer.request("lease-0")["lease_id"]))
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                outcome.append(exc)

    t = threading.Thread(target=run)
    t.start()
    peer.wait_line("STALL", timeout=20)  # first chunk sent, the holder sleeps before the next
    peer.kill()
    t.join(20)
    assert not t.is_alive()
    assert isinstance(outcome[0], TransferError), outcome
    assert isinstance(outcome[0], PeerUnavailableError), outcome  # UNAVAILABLE on a dead socket
    assert_no_leak(manager)


def test_deadline_exceeded(peers: dict[str, Peer]) -> None:
    peer = peers["stall"]
    manager, h = local_worker()
    req = decode_request(peer, "lease-0")
    client = KVTransferClient(peer.address, TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=1.0))
    t0 = time.monotonic()
    with client, pytest.raises(TransferTimeoutError):
        pull(h, req, client, 10, lease_id=peer.request("lease-0")["lease_id"])
    assert time.monotonic() - t0 < 10
    assert_no_leak(manager)


def test_a_stopped_holder_is_given_up_after_its_silence_not_the_pull_deadline() -> None:
    """A hung holder (here: SIGSTOP, its sockets open and silent) holds a pull for ``holder_silence_s``
    on either transport, not for the whole ``pull_timeout_s``, and nothing leaks."""
    peer = Peer()
    lease_id = peer.request("lease-0")["lease_id"]
    base = TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=120.0, stall_timeout_s=2.0)
    clients = {"grpc": KVTransferClient(peer.address, replace(base, shm=False)),
               "shm": KVTransferClient(peer.address, base)}  # fmt: skip
    try:
        manager, h = local_worker()
        for transport, client in clients.items():  # connected, and the region made, while the holder runs
            client.metadata()
            assert client.pull_into(KVTensor(LAYOUT, LOCAL_BLOCKS), [0, 1, 2], lease_id=lease_id).transport == transport
        os.kill(peer.proc.pid, signal.SIGSTOP)
        assert wait_until(lambda: _state(peer.proc.pid) == "T")  # every thread of it stopped
        for transport, client in clients.items():
            t0 = time.monotonic()
            with pytest.raises(TransferTimeoutError):
                pull(h, decode_request(peer, "lease-0"), client, 10, lease_id=lease_id)
            assert time.monotonic() - t0 < 30, f"{transport}: the pull waited for its deadline, not the silence"
            assert _state(peer.proc.pid) == "T", f"{transport}: the holder was let run meanwhile"
            assert_no_leak(manager)
    finally:
        for client in clients.values():
            client.close()
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.kill()


def _state(pid: int) -> str:
    """A process's state letter (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def test_layout_mismatch_refused(peers: dict[str, Peer]) -> None:
    peer = peers["other"]
    kv = local_worker()[1].kv_tensor
    with KVTransferClient(peer.address, CFG) as client:
        with pytest.raises(LayoutMismatchError) as err:
            client.check_compatible(LAYOUT, FP)
        assert set(err.value.fields) == {"head_dim", "block_nbytes"}
        assert err.value.fields["head_dim"] == (8, 16) and "head_dim" in str(err.value)
        with pytest.raises(LayoutMismatchError) as err:
            client.check_compatible(KVLayout(2, 2, 16, 4, torch.float32), "another-model")
        assert set(err.value.fields) == {"model_fingerprint"}
        # An MLA cache of the same bytes per block is another layout: refused on its kind.
        with pytest.raises(LayoutMismatchError) as err:
            client.check_compatible(KVLayout(2, 1, 64, 4, torch.float32, kind="mla", rope_dim=8), FP)
        assert err.value.fields["kind"] == ("mla", "mha") and "block_nbytes" not in err.value.fields
        # The holder refuses a pull into a differently shaped cache on its own, too.
        with pytest.raises(LayoutMismatchError, match="head_dim"):
            client.pull_into(kv, [0, 1, 2], lease_id=peer.request("lease-0")["lease_id"])


def test_unreachable_peer() -> None:
    with KVTransferClient("127.0.0.1:1", CFG) as client:
        with pytest.raises(PeerUnavailableError):
            client.metadata(timeout_s=5)


# -- in-process holder: the tests look at its pool ----------------------------------------
class GatedServicer(KVTransferServicer):
    """Holds every stream after its first chunk until ``gate`` is set."""

    def __init__(self, source: BlockSource) -> None:
        super().__init__(source)
        self.first_sent = threading.Event()
        self.gate = threading.Event()

    def Pull(self, request, context):  # type: ignore[override]
        for msg in super().Pull(request, context):
            yield msg
            self.first_sent.set()
            self.gate.wait(10)


class Holder:
    """An in-process holder: a pool behind the KV-handover API, served over gRPC."""

    def __init__(self, ttl_s: float = 30.0, gated: bool = False) -> None:
        self.config = TransferConfig(chunk_bytes=CHUNK, lease_ttl_s=ttl_s, reap_interval_s=0.05)
        self.manager, self.handover = local_worker()
        self.source = BlockSource(self.handover, model_fingerprint=FP, worker_id="inproc", config=self.config)
        self.servicer = GatedServicer(self.source) if gated else None
        self.server = start_transfer_server(self.source, self.config, servicer=self.servicer)

    def prefill(self, request_id: str, num_tokens: int) -> Request:
        req = Request(request_id, list(range(num_tokens)), SamplingParams(), LAYOUT.block_size)
        assert self.manager.allocate_slots(req, num_tokens) is not None
        req.num_computed_tokens = num_tokens
        for j, block_id in enumerate(self.manager.get_block_ids(request_id)):
            self.handover.kv_tensor.block(block_id).copy_(expected(request_id, j))
        return req

    def lease(self, request_id: str, num_tokens: int) -> str:
        return self.source.lease(self.handover.hold(self.prefill(request_id, num_tokens), num_tokens))

    def free_blocks(self) -> int:
        return self.manager.num_free_blocks()


def test_lease_expiry_returns_blocks() -> None:
    holder = Holder(ttl_s=0.3)
    try:
        lease_id = holder.lease("r", 10)
        assert holder.free_blocks() == LOCAL_BLOCKS - 3
        assert wait_until(lambda: holder.free_blocks() == LOCAL_BLOCKS)
        holder.handover.check_invariants()
        kv = local_worker()[1].kv_tensor
        with KVTransferClient(holder.server.address, CFG) as client, pytest.raises(BlockNotFoundError):
            client.pull_into(kv, [0, 1, 2], lease_id=lease_id)
    finally:
        holder.server.stop()


def test_lease_not_freed_while_pull_streams() -> None:
    holder = Holder(ttl_s=0.2, gated=True)
    gated = holder.servicer
    assert gated is not None
    try:
        lease_id = holder.lease("r", 10)
        kv = local_worker()[1].kv_tensor
        result: list[object] = []
        with KVTransferClient(holder.server.address, CFG) as client:
            t = threading.Thread(target=lambda: result.append(client.pull_into(kv, [3, 4, 5], lease_id=lease_id)))
            t.start()
            assert gated.first_sent.wait(10)
            assert wait_until(lambda: lease_id not in holder.source.leases)  # past the TTL: the reaper expired it
            assert client.release(lease_id) is False  # already expired ...
            assert holder.free_blocks() == LOCAL_BLOCKS - 3  # ... but still held
            # Ending the request's KV by id (the router's orphan release) leaves it to the pull too.
            assert holder.source.release_request("r") is True
            assert holder.free_blocks() == LOCAL_BLOCKS - 3
            gated.gate.set()
            t.join(10)
        assert result and result[0].num_blocks == 3  # type: ignore[union-attr]
        for j in range(3):
            assert torch.equal(kv.block(3 + j), expected("r", j))
        assert wait_until(lambda: holder.free_blocks() == LOCAL_BLOCKS)
        holder.handover.check_invariants()
    finally:
        holder.server.stop()


def test_a_release_during_a_step_does_not_wait_for_it() -> None:
    """The engine's lock is held (a step runs): releasing a lease returns at once, and its blocks
    are freed once the step ends."""
    holder = Holder()
    try:
        lease_id = holder.lease("r", 10)
        stepping, step_done = threading.Event(), threading.Event()

        def step() -> None:
            with holder.handover.lock:
                stepping.set()
                step_done.wait(30)

        stepper = threading.Thread(target=step)
        stepper.start()
        assert stepping.wait(10)
        releaser = threading.Thread(target=lambda: holder.source.release(lease_id))
        releaser.start()
        releaser.join(10)
        done_during_step = not releaser.is_alive()
        held_during_step = holder.free_blocks() == LOCAL_BLOCKS - 3
        step_done.set()
        stepper.join(10)
        assert done_during_step and held_during_step
        assert wait_until(lambda: holder.free_blocks() == LOCAL_BLOCKS)
        holder.handover.check_invariants()
    finally:
        step_done.set()
        holder.server.stop()


def test_pull_by_hash_pins_blocks_while_streaming_and_unpins_on_cancel() -> None:
    holder = Holder(gated=True)
    gated = holder.servicer
    assert gated is not None
    try:
        req = holder.prefill("r", 12)
        holder.manager.free(req)  # cached, free, evictable
        ids = [holder.manager.pool.get_cached_block(h).block_id for h in req.block_hashes]
        kv = local_worker()[1].kv_tensor
        errors: list[BaseException] = []
        client = KVTransferClient(holder.server.address, TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=1.5))

        def pull() -> None:
            try:
                client.pull_into(kv, [0, 1, 2], block_hashes=req.block_hashes)
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                errors.append(exc)

        with client:
            t = threading.Thread(target=pull)
            t.start()
            assert gated.first_sent.wait(10)
            # Mid-stream: the three blocks are pinned (out of the free queue, one ref each).
            assert holder.free_blocks() == LOCAL_BLOCKS - 3
            holder.manager.check_invariants(extra_pins={i: 1 for i in ids})
            holder.handover.check_invariants()  # the handover accounts for its pins
            t.join(10)
        assert len(errors) == 1 and isinstance(errors[0], TransferTimeoutError)
        # The deadline cancelled the RPC: the pins are dropped although the stream's
        # generator is still parked at the gate.
        assert wait_until(lambda: holder.free_blocks() == LOCAL_BLOCKS)
        holder.handover.check_invariants()
        assert all(holder.manager.pool.get_cached_block(h) for h in req.block_hashes)  # still cached
        gated.gate.set()
    finally:
        holder.server.stop()


# -- pure parts ---------------------------------------------------------------------------
@pytest.mark.parametrize("n,nbytes,chunk,maxp", [(3, 1024, 1536, 8), (5, 100, 1000, 2), (2, 4096, 1000, 100), (1, 7, 7, 1)])
def test_plan_chunks_covers_every_block_once(n: int, nbytes: int, chunk: int, maxp: int) -> None:
    covered = [0] * n
    for specs in plan_chunks(n, nbytes, chunk, maxp):
        assert 0 < sum(s.length for s in specs) <= chunk and 0 < len(specs) <= maxp
        for s in specs:
            assert s.offset == covered[s.position]
            covered[s.position] += s.length
    assert covered == [nbytes] * n


def test_lease_table_defers_expiry_and_releases_once() -> None:
    now = [0.0]
    released: list[str] = []
    table = LeaseTable(lambda lease: released.append(lease.request_id), default_ttl_s=1.0, clock=lambda: now[0])
    held = HeldKV("a", (5, 9), (b"h" * 16,), 7, 4)
    lid = table.create(held)
    with pytest.raises(ValueError, match="already has lease"):
        table.create(held)
    with pytest.raises(ValueError, match="ttl_s"):
        table.create(HeldKV("b", (1,), (), 3, 4), ttl_s=0)
    lease = table.acquire(lid)
    assert (lease.held.num_tokens_of(1), lease.held.hash_of(1), lease.held.hash_of(0)) == (3, b"", b"h" * 16)
    now[0] = 2.0
    assert table.reap() == 0 and released == [] and table.num_holding() == 1
    with pytest.raises(LeaseNotFoundError):
        table.acquire(lid)
    table.end_pull(lid)
    assert released == ["a"] and table.num_holding() == 0
    assert table.release(lid) is False and released == ["a"]
    # The counters: created, and released before any pull (by id or by request; not an expiry).
    table.release(table.create(HeldKV("c", (1,), (), 3, 4)))
    table.release_request("d") or table.create(HeldKV("d", (2,), (), 3, 4))
    assert table.release_request("d") and not table.release_request("d")
    table.create(HeldKV("e", (3,), (), 3, 4))
    now[0] = 10.0
    assert table.reap() == 1
    assert (table.created, table.released_unpulled) == (4, 2)


def test_config_validation() -> None:
    assert TransferConfig().max_message_bytes > TransferConfig().chunk_bytes
    for bad in ({"chunk_bytes": 0}, {"lease_ttl_s": 0}, {"pull_timeout_s": float("inf")}, {"server_threads": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TransferConfig(**bad)  # type: ignore[arg-type]


def test_pull_arguments_validated() -> None:
    kv = local_worker()[1].kv_tensor
    with KVTransferClient("127.0.0.1:1", CFG) as client:
        with pytest.raises(InvalidPullError):
            client.pull_into(kv, [0], lease_id="x", block_hashes=[b"h"])
        with pytest.raises(InvalidPullError):
            client.pull_into(kv, [0, 0], lease_id="x")
        with pytest.raises(InvalidPullError):
            client.pull_into(kv, [LOCAL_BLOCKS], lease_id="x")


def test_hand_encoder_matches_protobuf() -> None:
    """The holder's PullChunk encoder writes exactly what SerializeToString would."""
    gen = torch.Generator().manual_seed(0)

    def pick(*options):  # noqa: ANN002, ANN202
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for _ in range(200):
        pieces = tuple(
            Piece(
                index=pick(0, 1, 300, 2**32 - 1),
                block_hash=pick(b"", bytes(range(16))),
                num_tokens=pick(0, 3, 16),
                offset=pick(0, 127, 1 << 40),
                data=memoryview(bytes(pick(0, 1, 127, 128, 20000))),
                checksum=pick(0, 1, 2**64 - 1),
            )
            for _ in range(pick(0, 1, 3))
        )
        chunk = Chunk(pick(0, 1, 300), pick(0, 7), pick(0, 2**40), pick(0, 1024), pieces)
        encoded = encode_chunk(chunk)
        assert encoded == chunk_to_proto(chunk).SerializeToString()
        decoded = chunk_from_proto(pb.PullChunk.FromString(encoded))
        assert [bytes(p.data) for p in decoded.pieces] == [bytes(p.data) for p in pieces]
        # The puller's zero-copy decoder reads what upb reads, from this encoder and from upb's own.
        for wire in (encoded, pb.PullChunk.FromString(encoded).SerializeToString()):
            fast = decode_chunk(wire)
            assert _plain(fast) == _plain(decoded)


def _plain(chunk: Chunk) -> tuple:
    return (chunk.seq, chunk.total_blocks, chunk.total_tokens, chunk.block_nbytes,
            [(p.index, bytes(p.block_hash), p.num_tokens, p.offset, bytes(p.data), p.checksum)
             for p in chunk.pieces])  # fmt: skip


def test_the_chunk_decoder_skips_unknown_fields_and_refuses_garbage() -> None:
    piece = pb.BlockPiece(index=2, block_hash=b"h" * 16, num_tokens=16, offset=64, data=b"x" * 100, checksum=7)
    msg = pb.PullChunk(seq=3, total_blocks=9, total_tokens=144, block_nbytes=4096, pieces=[piece])
    # A newer holder's extra fields (varint 15, bytes 16, fixed32 17), in any order, are skipped.
    extra = bytes([15 << 3 | 0, 1]) + b"\x82\x01\x02\xab\xcd" + b"\x8d\x01\x01\x02\x03\x04"  # keys 130, 141: 2-byte varints
    got = decode_chunk(extra + msg.SerializeToString())
    assert _plain(got) == _plain(chunk_from_proto(msg))
    assert isinstance(got.pieces[0].data, memoryview)  # a view of the message: not copied
    wire = msg.SerializeToString()
    for bad in (wire[:-3], wire + b"\x80", bytes([5 << 3 | 0, 1]), bytes([1 << 3 | 2, 1, 0]), bytes([1 << 3 | 3])):
        with pytest.raises(WireFormatError):
            decode_chunk(bad)


def test_taken_port_is_an_error_not_shared() -> None:
    """gRPC binds with SO_REUSEPORT by default; a transfer server must not share a taken port."""
    holder = Holder()
    try:
        with pytest.raises(OSError, match=f"cannot bind the KV transfer server to 127.0.0.1:{holder.server.port}"):
            start_transfer_server(holder.source, holder.config, port=holder.server.port)
    finally:
        holder.server.stop()
