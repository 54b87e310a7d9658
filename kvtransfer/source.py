"""BlockSource: a worker's KV blocks as the KV wire serves them (plain Python, no gRPC).

The servicer (``kvtransfer.server``) is a thin proto shell around this class. It reaches the
engine only through the KV-handover API (``KVHandover``): leases hold handed-off requests'
KV (``HeldKV``) and free it with ``release``; pulls by hash ``pin_cached`` full blocks for the
duration of the stream. Block bytes are read without the engine's lock: a held or pinned block
is referenced, so the engine will neither reuse nor rewrite it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdserve.engine.kv_handover import BlocksNotCachedError, HeldKV, KVHandover, PinnedKV
from pdserve.kvtransfer.config import MAX_HASH_BYTES, TransferConfig
from pdserve.kvtransfer.errors import BlockNotFoundError, InvalidPullError, LayoutMismatchError
from pdserve.kvtransfer.leases import Lease, LeaseTable
from pdserve.kvtransfer.wire import Chunk, LayoutSpec, Piece, TransferMetadata, checksum, describe_mismatch, plan_chunks


@dataclass
class PinnedBlocks:
    """Blocks held for one pull. ``close()`` unpins them; idempotent and thread-safe,
    because both the stream's ``finally`` and gRPC's termination callback call it."""

    block_ids: list[int]
    indices: list[int]  # index of each block in the request (lease) or hash list
    hashes: list[bytes]
    num_tokens: list[int]
    unpin: Callable[[], None]
    _closed: bool = field(default=False, repr=False)
    _close_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.unpin()

    def __enter__(self) -> PinnedBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockSource:
    def __init__(
        self,
        handover: KVHandover,
        *,
        model_fingerprint: str,
        worker_id: str,
        config: TransferConfig | None = None,
    ) -> None:
        self.handover = handover
        self.config = config or TransferConfig()
        self.layout = LayoutSpec.from_layout(handover.layout)
        self.model_fingerprint = model_fingerprint
        self.worker_id = worker_id
        self.leases = LeaseTable(self._free_lease, self.config.lease_ttl_s)
        self._flat = handover.kv_tensor.host_bytes()  # a CPU cache: pieces are slices of it
        self._unpinner = ThreadPoolExecutor(1, thread_name_prefix="kv-unpin")

    def metadata(self) -> TransferMetadata:
        return TransferMetadata(self.model_fingerprint, self.layout, self.worker_id, self.config.chunk_bytes)

    # -- leases ---------------------------------------------------------------------------
    def lease(self, held: HeldKV, ttl_s: float | None = None) -> str:
        """Put a handed-off request's KV under a lease; return its id.

        From now on the lease owns it: it is released (``KVHandover.release``) when the lease
        is released, expires or the source closes, and not before a pull of it ends.
        """
        return self.leases.create(held, ttl_s)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def release_request(self, request_id: str) -> bool:
        """End whatever this holder keeps for ``request_id``: its lease, or its held KV."""
        return self.leases.release_request(request_id) or self.handover.release(request_id)

    def _free_lease(self, lease: Lease) -> None:
        """Free a lease's blocks without waiting for a step: the pull whose end frees them (on
        gRPC's own thread) or a Release call never waits for one."""
        rid = lease.request_id
        self._off_step(lambda: self.handover.try_release(rid), lambda: self.handover.release(rid))

    def _off_step(self, now: Callable[[], bool], waiting: Callable[[], object]) -> None:
        """``now()`` (False when a step holds the engine's lock, and nothing was done), else
        ``waiting()`` on the unpinning thread once the step ends; here when the source is closing."""
        if now():
            return
        try:
            self._unpinner.submit(waiting)
        except RuntimeError:  # the source is closing: here, waiting for the lock
            waiting()

    def close(self) -> None:
        """End every lease (blocks being pulled are freed when those pulls end) and wait for the
        unpins handed to the unpinning thread."""
        self.leases.close()
        self._unpinner.shutdown(wait=True)

    # -- pulls ----------------------------------------------------------------------------
    def check_layout(self, expected: LayoutSpec) -> None:
        """Raise ``LayoutMismatchError`` naming the fields where ``expected`` (the puller's) differs."""
        fields = expected.diff(self.layout)
        if fields:
            raise LayoutMismatchError(f"KV layout mismatch: {describe_mismatch(fields)}", fields=fields)

    def open_lease(self, lease_id: str, first_block: int = 0) -> PinnedBlocks:
        """Pin a lease for one pull, from block ``first_block`` on; raises ``LeaseNotFoundError``."""
        held = self.leases.acquire(lease_id).held
        n = len(held.block_ids)
        if not 0 <= first_block < n:
            self.leases.end_pull(lease_id)
            raise InvalidPullError(f"first_block {first_block} out of range: lease {lease_id!r} has {n} blocks")
        idx = list(range(first_block, n))
        return PinnedBlocks(
            block_ids=[held.block_ids[i] for i in idx],
            indices=idx,
            hashes=[held.hash_of(i) for i in idx],
            num_tokens=[held.num_tokens_of(i) for i in idx],
            unpin=lambda: self.leases.end_pull(lease_id),
        )

    def open_hashes(self, block_hashes: Sequence[bytes], prefix_wait_s: float = 0.0) -> PinnedBlocks:
        """Pin the cached blocks with these hashes for one pull.

        Raises ``BlockNotFoundError`` listing every hash not in the prefix cache; nothing
        is pinned then. With ``prefix_wait_s`` > 0: the longest cached prefix of them, waiting that
        long for the first (``KVHandover.pin_cached_prefix``).
        """
        if not block_hashes:
            raise InvalidPullError("a pull by hash needs at least one hash")
        for h in block_hashes:
            if not 0 < len(h) <= MAX_HASH_BYTES:
                raise InvalidPullError(f"block hash of {len(h)} bytes (expected 1..{MAX_HASH_BYTES})")
        try:
            if prefix_wait_s > 0:
                pinned = self.handover.pin_cached_prefix(block_hashes, prefix_wait_s)
            else:
                pinned = self.handover.pin_cached(block_hashes)
        except BlocksNotCachedError as exc:
            raise BlockNotFoundError(f"{exc} (worker {self.worker_id!r})", missing_hashes=exc.missing) from None
        return PinnedBlocks(
            block_ids=list(pinned.block_ids),
            indices=list(range(len(pinned.block_ids))),
            hashes=list(pinned.block_hashes),
            num_tokens=[self.handover.block_size] * len(pinned.block_ids),
            unpin=lambda: self._unpin(pinned),
        )

    def _unpin(self, pinned: PinnedKV) -> None:
        """Unpin without waiting for a step: a pull's end (the stream's status, a region or NIXL
        answer) never waits for one."""
        self._off_step(lambda: self.handover.unpin(pinned, wait=False), lambda: self.handover.unpin(pinned))

    def chunks(self, pinned: PinnedBlocks, chunk_bytes: int, max_pieces: int) -> Iterator[Chunk]:
        """The pinned blocks as stream chunks, lazily: a chunk references only its own pieces' bytes."""
        nbytes = self.layout.block_nbytes
        total_tokens = pinned.total_tokens
        total = len(pinned.block_ids)
        for seq, specs in enumerate(plan_chunks(total, nbytes, chunk_bytes, max_pieces)):
            pieces = []
            for s in specs:
                data = self.read(pinned.block_ids[s.position], s.offset, s.length)
                pos = s.position
                pieces.append(
                    Piece(pinned.indices[pos], pinned.hashes[pos], pinned.num_tokens[pos], s.offset, data, checksum(data))
                )
            yield Chunk(seq, total, total_tokens, nbytes, tuple(pieces))

    def read(self, block_id: int, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset+length)`` of one block, as a view of the KV tensor (CPU: no
        copy; the encoder copies it once into the message) or of a host copy (GPU)."""
        if self._flat is not None:
            start = block_id * self.layout.block_nbytes + offset
            return self._flat[start : start + length]
        return memoryview(self.handover.kv_tensor.block_bytes(block_id)[offset : offset + length].cpu().numpy())
