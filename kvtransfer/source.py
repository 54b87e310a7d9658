"""BlockSource: a worker's KV blocks as the KV wire serves them (plain Python, no gRPC).

The servicer (``kvtransfer.server``) is a thin proto shell around this class.

Threading: the worker's engine mutates the BlockPool in another thread, so every pool
operation here (pinning, unpinning, freeing a lease) runs under the ``lock`` the owner
passes in. Block *bytes* are read without the lock: a block that is pinned (by a pull
by hash) or leased is referenced, so the engine will neither reuse nor rewrite it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheTensor
from engine.kvcache.block import KVCacheBlock
from engine.kvcache.manager import KVCacheManager, KVRequest, cdiv
from kvtransfer.config import MAX_HASH_BYTES, TransferConfig
from kvtransfer.errors import BlockNotFoundError, InvalidPullError, LayoutMismatchError
from kvtransfer.leases import Lease, LeaseTable
from kvtransfer.wire import Chunk, LayoutSpec, Piece, TransferMetadata, checksum, describe_mismatch, plan_chunks

Lock = AbstractContextManager  # threading.Lock / RLock (anything usable in ``with``)


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
        kv: KVCacheTensor,
        manager: KVCacheManager,
        lock: Lock,
        *,
        model_fingerprint: str,
        worker_id: str,
        config: TransferConfig | None = None,
    ) -> None:
        if kv.layout.block_size != manager.block_size:
            raise ValueError(f"KV tensor block_size {kv.layout.block_size} != manager block_size {manager.block_size}")
        if kv.num_blocks != manager.num_blocks:
            raise ValueError(f"KV tensor has {kv.num_blocks} blocks, manager {manager.num_blocks}")
        self.kv = kv
        self.manager = manager
        self.lock = lock
        self.config = config or TransferConfig()
        self.layout = LayoutSpec.from_layout(kv.layout)
        self.model_fingerprint = model_fingerprint
        self.worker_id = worker_id
        self.leases = LeaseTable(self._free_lease, manager.block_size, self.config.lease_ttl_s)
        # Called (outside the lock) after a lease returns its blocks, e.g. to wake the engine.
        self.on_blocks_freed: Callable[[], None] | None = None

    def metadata(self) -> TransferMetadata:
        return TransferMetadata(self.model_fingerprint, self.layout, self.worker_id, self.config.chunk_bytes)

    # -- leases ---------------------------------------------------------------------------
    def lease_request(self, request: KVRequest, num_tokens: int | None = None, ttl_s: float | None = None) -> str:
        """Hand a finished prefill's blocks to a lease; return its id.

        Covers the request's first ``num_tokens`` tokens (default: its computed tokens).
        From now on the lease owns the request's allocation: the caller must not free the
        request itself; the lease does (``manager.free``) when released or expired.
        """
        n_tok = request.num_computed_tokens if num_tokens is None else num_tokens
        bs = self.manager.block_size
        with self.lock:
            blocks = list(self.manager.get_blocks(request.request_id))
        if n_tok < 1 or cdiv(n_tok, bs) > len(blocks):
            raise ValueError(f"request {request.request_id!r} holds {len(blocks)} blocks, cannot lease {n_tok} tokens")
        hashes = list(request.block_hashes[: n_tok // bs])
        return self.leases.create(request.request_id, blocks[: cdiv(n_tok, bs)], n_tok, ttl_s, hashes)

    def release(self, lease_id: str) -> bool:
        return self.leases.release(lease_id)

    def _free_lease(self, lease: Lease) -> None:
        with self.lock:
            self.manager.free(lease.request_id)
        if self.on_blocks_freed is not None:
            self.on_blocks_freed()

    def close(self) -> None:
        """End every lease (blocks being pulled are freed when those pulls end)."""
        self.leases.close()

    # -- pulls ----------------------------------------------------------------------------
    def check_layout(self, expected: LayoutSpec) -> None:
        """Raise ``LayoutMismatchError`` naming the fields where ``expected`` (the puller's) differs."""
        fields = expected.diff(self.layout)
        if fields:
            raise LayoutMismatchError(f"KV layout mismatch: {describe_mismatch(fields)}", fields=fields)

    def open_lease(self, lease_id: str, first_block: int = 0) -> PinnedBlocks:
        """Pin a lease for one pull, from block ``first_block`` on; raises ``LeaseNotFoundError``."""
        lease = self.leases.acquire(lease_id)
        n = len(lease.blocks)
        if not 0 <= first_block < n:
            self.leases.end_pull(lease_id)
            raise InvalidPullError(f"first_block {first_block} out of range: lease {lease_id!r} has {n} blocks")
        idx = list(range(first_block, n))
        return PinnedBlocks(
            block_ids=[lease.blocks[i].block_id for i in idx],
            indices=idx,
            hashes=[lease.hash_of(i) for i in idx],
            num_tokens=[lease.num_tokens_of(i) for i in idx],
            unpin=lambda: self.leases.end_pull(lease_id),
        )

    def open_hashes(self, block_hashes: Sequence[bytes]) -> PinnedBlocks:
        """Pin the cached blocks with these hashes (``BlockPool.touch``) for one pull.

        Raises ``BlockNotFoundError`` listing every hash not in the prefix cache; nothing
        is pinned then.
        """
        if not block_hashes:
            raise InvalidPullError("a pull by hash needs at least one hash")
        for h in block_hashes:
            if not 0 < len(h) <= MAX_HASH_BYTES:
                raise InvalidPullError(f"block hash of {len(h)} bytes (expected 1..{MAX_HASH_BYTES})")
        pool = self.manager.pool
        with self.lock:
            found = [pool.get_cached_block(h) for h in block_hashes]
            missing = [h for h, b in zip(block_hashes, found) if b is None]
            if missing:
                shown = ", ".join(h.hex() for h in missing[:4]) + (", ..." if len(missing) > 4 else "")
                raise BlockNotFoundError(
                    f"{len(missing)} of {len(block_hashes)} block hashes not in the prefix cache of "
                    f"worker {self.worker_id!r}: {shown}",
                    missing_hashes=missing,
                )
            blocks: list[KVCacheBlock] = found  # type: ignore[assignment]
            pool.touch(blocks)

        def unpin() -> None:
            with self.lock:
                pool.free_blocks(reversed(blocks))  # chain tail first: evicted before its parents

        bs = self.manager.block_size
        return PinnedBlocks(
            block_ids=[b.block_id for b in blocks],
            indices=list(range(len(blocks))),
            hashes=list(block_hashes),
            num_tokens=[bs] * len(blocks),
            unpin=unpin,
        )

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
        view = self.kv.block_bytes(block_id)[offset : offset + length]
        if view.device.type != "cpu":
            view = view.cpu()
        return memoryview(view.numpy())
