"""The KV wire end to end: real gRPC over loopback, holders in separate processes
(tests/transfer_peer.py) except where a test must look inside the holder's pool."""

from __future__ import annotations

import importlib.util
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.kv_cache import KVCacheTensor, KVLayout
from engine.kvcache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from kvtransfer.client import KVTransferClient
from kvtransfer.config import TransferConfig
from kvtransfer.errors import (
    BlockNotFoundError,
    ChecksumError,
    InvalidPullError,
    LayoutMismatchError,
    PeerUnavailableError,
    TransferError,
    TransferTimeoutError,
)
from kvtransfer.leases import LeaseNotFoundError, LeaseTable
from kvtransfer.pull import pull_request_kv
from kvtransfer.server import KVTransferServicer, start_transfer_server
from kvtransfer.source import BlockSource
from kvtransfer.protoconv import chunk_from_proto, chunk_to_proto, encode_chunk
from kvtransfer.wire import Chunk, Piece, plan_chunks
from pdserve.v1 import kvtransfer_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPT = ROOT / "tests" / "transfer_peer.py"
_spec = importlib.util.spec_from_file_location("transfer_peer", PEER_SCRIPT)
assert _spec and _spec.loader
peer_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_mod)

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
            [sys.executable, str(PEER_SCRIPT), *PEER_ARGS, *extra],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
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


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    # Started together so their (torch-import) startup overlaps.
    started = {
        "main": Peer(),
        "corrupt": Peer("--corrupt-chunk", "1"),
        "stall": Peer("--stall-after-chunk", "0", "--stall-s", "30"),
        "doomed": Peer("--stall-after-chunk", "0", "--stall-s", "30"),
        "other": Peer("--head-dim", "16"),
    }
    try:
        for p in started.values():
            assert p.info["port"] > 0
        yield started
    finally:
        for p in started.values():
            p.kill()


def local_worker() -> tuple[KVCacheManager, KVCacheTensor]:
    return KVCacheManager(LOCAL_BLOCKS, LAYOUT.block_size), KVCacheTensor(LAYOUT, LOCAL_BLOCKS)


def decode_request(peer: Peer, request_id: str, extra_tokens: int = 1) -> Request:
    """The decode side's copy of a peer's request: same prompt plus the sampled first token(s)."""
    tokens = peer.request(request_id)["token_ids"] + [7] * extra_tokens
    return Request(request_id, tokens, SamplingParams(), LAYOUT.block_size)


def expected(request_id: str, index: int, seed: int = 0) -> torch.Tensor:
    return peer_mod.block_data(LAYOUT, seed, request_id, index)


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
    _, kv = local_worker()
    dest = [9, 2, 14, 5]  # any order, not contiguous
    with KVTransferClient(peer.address, CFG) as client:
        stats = client.pull_into(kv, dest, block_hashes=hashes)
    assert (stats.num_blocks, stats.num_bytes, stats.num_tokens, stats.num_chunks) == (4, 4096, 16, 3)
    for j, block_id in enumerate(dest):
        assert torch.equal(kv.block(block_id), expected("cached-0", j))
    assert [b.block_hash for b in stats.blocks] == hashes


def test_pull_by_lease_with_partial_block(peers: dict[str, Peer]) -> None:
    peer = peers["main"]
    manager, kv = local_worker()
    req = decode_request(peer, "lease-0")  # 10 tokens: 2 full blocks + 2 tokens
    with KVTransferClient(peer.address, CFG) as client:
        res = pull_request_kv(manager, kv, req, client, 10, lease_id=peer.request("lease-0")["lease_id"])
        assert res is not None
        assert (res.num_local_hit_tokens, res.num_external_tokens, len(res.block_ids)) == (0, 10, 3)
        assert [b.num_tokens for b in res.stats.blocks] == [4, 4, 2]
        assert res.stats.blocks[-1].block_hash == b""
        for j, block_id in enumerate(res.block_ids):
            assert torch.equal(kv.block(block_id), expected("lease-0", j))
        # The full blocks are now in the local prefix cache, the request is ready to decode.
        assert req.num_computed_tokens == 10
        assert all(manager.pool.get_cached_block(h) for h in req.block_hashes[:2])
        manager.check_invariants()
        # pull_request_kv released the lease: a second pull finds nothing.
        with pytest.raises(BlockNotFoundError):
            client.pull_into(kv, [15], lease_id=peer.request("lease-0")["lease_id"], first_block=2)


def test_lease_pull_skips_locally_cached_prefix(peers: dict[str, Peer]) -> None:
    peer = peers["main"]
    manager, kv = local_worker()
    # The decode worker already has block 0 of lease-2's prompt in its own prefix cache.
    prior = decode_request(peer, "lease-2", extra_tokens=0)
    manager.allocate_slots(prior, 4)
    kv.block(manager.get_block_ids("lease-2")[0]).copy_(expected("lease-2", 0))
    manager.free(prior)
    req = decode_request(peer, "lease-2")
    with KVTransferClient(peer.address, CFG) as client:
        res = pull_request_kv(manager, kv, req, client, 9, lease_id=peer.request("lease-2")["lease_id"])
    assert res is not None and (res.num_local_hit_tokens, res.num_external_tokens) == (4, 5)
    assert [b.index for b in res.stats.blocks] == [1, 2]
    for j, block_id in enumerate(res.block_ids):
        assert torch.equal(kv.block(block_id), expected("lease-2", j))
    manager.free(req)
    assert_no_leak(manager)


def test_release_then_pull_is_not_found(peers: dict[str, Peer]) -> None:
    peer = peers["main"]
    lease_id = peer.request("lease-1")["lease_id"]
    _, kv = local_worker()
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
    manager, kv = local_worker()
    with KVTransferClient(peer.address, CFG) as client:
        with pytest.raises(BlockNotFoundError) as err:
            client.pull_into(kv, [0, 1, 2], block_hashes=[known[0], unknown, known[1]])
        assert err.value.missing_hashes == [unknown] and unknown.hex() in str(err.value)
        # Through the decode helper: a prompt the holder never saw.
        req = Request("fresh", list(range(100, 117)), SamplingParams(), LAYOUT.block_size)
        with pytest.raises(BlockNotFoundError):
            pull_request_kv(manager, kv, req, client, 16)
    assert_no_leak(manager)


def test_checksum_mismatch_detected_and_nothing_leaks(peers: dict[str, Peer]) -> None:
    peer = peers["corrupt"]
    manager, kv = local_worker()
    with KVTransferClient(peer.address, CFG) as client:
        req = decode_request(peer, "lease-0")
        with pytest.raises(ChecksumError):
            pull_request_kv(manager, kv, req, client, 10, lease_id=peer.request("lease-0")["lease_id"])
        assert_no_leak(manager)
        req = decode_request(peer, "cached-0")
        with pytest.raises(ChecksumError):
            pull_request_kv(manager, kv, req, client, 16)
    assert_no_leak(manager)
    assert not manager.pool.cached  # nothing half-written was cached


def test_peer_killed_mid_stream(peers: dict[str, Peer]) -> None:
    peer = peers["doomed"]
    manager, kv = local_worker()
    req = decode_request(peer, "lease-0")
    outcome: list[BaseException | object] = []

    def pull() -> None:
        with KVTransferClient(peer.address, CFG) as client:
            try:
                outcome.append(pull_request_kv(manager, kv, req, client, 10, lease_id=peer.request("lease-0")["lease_id"]))
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                outcome.append(exc)

    t = threading.Thread(target=pull)
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
    manager, kv = local_worker()
    req = decode_request(peer, "lease-0")
    client = KVTransferClient(peer.address, TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=1.0))
    t0 = time.monotonic()
    with client, pytest.raises(TransferTimeoutError):
        pull_request_kv(manager, kv, req, client, 10, lease_id=peer.request("lease-0")["lease_id"])
    assert time.monotonic() - t0 < 10
    assert_no_leak(manager)


def test_layout_mismatch_refused(peers: dict[str, Peer]) -> None:
    peer = peers["other"]
    _, kv = local_worker()
    with KVTransferClient(peer.address, CFG) as client:
        with pytest.raises(LayoutMismatchError) as err:
            client.check_compatible(LAYOUT, FP)
        assert set(err.value.fields) == {"head_dim", "block_nbytes"}
        assert err.value.fields["head_dim"] == (8, 16) and "head_dim" in str(err.value)
        with pytest.raises(LayoutMismatchError) as err:
            client.check_compatible(KVLayout(2, 2, 16, 4, torch.float32), "another-model")
        assert set(err.value.fields) == {"model_fingerprint"}
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


def holder(ttl_s: float = 30.0, gated: bool = False):
    cfg = TransferConfig(chunk_bytes=CHUNK, lease_ttl_s=ttl_s, reap_interval_s=0.05)
    manager, kv = local_worker()
    source = BlockSource(kv, manager, threading.RLock(), model_fingerprint=FP, worker_id="inproc", config=cfg)
    servicer = GatedServicer(source) if gated else None
    server = start_transfer_server(source, cfg, servicer=servicer)
    return source, server, servicer


def prefill(source: BlockSource, request_id: str, num_tokens: int) -> Request:
    req = Request(request_id, list(range(num_tokens)), SamplingParams(), LAYOUT.block_size)
    assert source.manager.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens = num_tokens
    for j, block_id in enumerate(source.manager.get_block_ids(request_id)):
        source.kv.block(block_id).copy_(expected(request_id, j))
    return req


def wait_until(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_lease_expiry_returns_blocks() -> None:
    source, server, _ = holder(ttl_s=0.3)
    try:
        lease_id = source.lease_request(prefill(source, "r", 10))
        assert source.manager.num_free_blocks() == LOCAL_BLOCKS - 3
        assert wait_until(lambda: source.manager.num_free_blocks() == LOCAL_BLOCKS)
        source.manager.check_invariants()
        _, kv = local_worker()
        with KVTransferClient(server.address, CFG) as client, pytest.raises(BlockNotFoundError):
            client.pull_into(kv, [0, 1, 2], lease_id=lease_id)
    finally:
        server.stop()


def test_lease_not_freed_while_pull_streams() -> None:
    source, server, gated = holder(ttl_s=0.2, gated=True)
    try:
        lease_id = source.lease_request(prefill(source, "r", 10))
        _, kv = local_worker()
        result: list[object] = []
        with KVTransferClient(server.address, CFG) as client:
            t = threading.Thread(target=lambda: result.append(client.pull_into(kv, [3, 4, 5], lease_id=lease_id)))
            t.start()
            assert gated.first_sent.wait(10)
            time.sleep(0.4)  # past the TTL: the reaper has run several times
            assert client.release(lease_id) is False  # already expired ...
            assert source.manager.num_free_blocks() == LOCAL_BLOCKS - 3  # ... but still held
            gated.gate.set()
            t.join(10)
        assert result and result[0].num_blocks == 3  # type: ignore[union-attr]
        for j in range(3):
            assert torch.equal(kv.block(3 + j), expected("r", j))
        assert wait_until(lambda: source.manager.num_free_blocks() == LOCAL_BLOCKS)
        source.manager.check_invariants()
    finally:
        server.stop()


def test_pull_by_hash_pins_blocks_while_streaming_and_unpins_on_cancel() -> None:
    source, server, gated = holder(gated=True)
    try:
        req = prefill(source, "r", 12)
        source.manager.free(req)  # cached, free, evictable
        ids = [source.manager.pool.get_cached_block(h).block_id for h in req.block_hashes]
        _, kv = local_worker()
        errors: list[BaseException] = []
        client = KVTransferClient(server.address, TransferConfig(chunk_bytes=CHUNK, pull_timeout_s=1.5))

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
            assert source.manager.num_free_blocks() == LOCAL_BLOCKS - 3
            source.manager.check_invariants(extra_pins={i: 1 for i in ids})
            t.join(10)
        assert len(errors) == 1 and isinstance(errors[0], TransferTimeoutError)
        # The deadline cancelled the RPC: the pins are dropped although the stream's
        # generator is still parked at the gate.
        assert wait_until(lambda: source.manager.num_free_blocks() == LOCAL_BLOCKS)
        source.manager.check_invariants()
        assert all(source.manager.pool.get_cached_block(h) for h in req.block_hashes)  # still cached
        gated.gate.set()
    finally:
        server.stop()


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
    table = LeaseTable(lambda lease: released.append(lease.request_id), block_size=4, default_ttl_s=1.0, clock=lambda: now[0])
    lid = table.create("a", [object(), object()], 7)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        table.create("a", [object(), object()], 7)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        table.create("b", [object()], 5)  # type: ignore[list-item]
    lease = table.acquire(lid)
    assert (lease.num_tokens_of(1), lease.hash_of(1)) == (3, b"")
    now[0] = 2.0
    assert table.reap() == 0 and released == [] and table.num_holding() == 1
    with pytest.raises(LeaseNotFoundError):
        table.acquire(lid)
    table.end_pull(lid)
    assert released == ["a"] and table.num_holding() == 0
    assert table.release(lid) is False and released == ["a"]


def test_config_validation() -> None:
    assert TransferConfig().max_message_bytes > TransferConfig().chunk_bytes
    for bad in ({"chunk_bytes": 0}, {"lease_ttl_s": 0}, {"pull_timeout_s": float("inf")}, {"server_threads": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TransferConfig(**bad)  # type: ignore[arg-type]


def test_pull_arguments_validated() -> None:
    _, kv = local_worker()
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


def test_taken_port_is_an_error_not_shared() -> None:
    """gRPC binds with SO_REUSEPORT by default; a transfer server must not share a taken port."""
    source, server, _ = holder()
    try:
        with pytest.raises(OSError, match=f"cannot bind the KV transfer server to 127.0.0.1:{server.port}"):
            start_transfer_server(source, source.config, port=server.port)
    finally:
        server.stop()
