"""BlockReceiver: checks each arriving chunk and writes its pieces into the local KV tensor.

Plain Python (the client feeds it chunks converted from protobuf). Every piece is
copied once, straight into ``kv_tensor.block_bytes(dest_id)[offset:...]`` (with streaming stores,
``engine/kernels/stream_copy``; via a small pinned staging buffer when the tensor lives on a GPU);
no pull is ever assembled in memory.
A piece is written only after its checksum matched. On any error the destination
blocks hold partial data: the caller must free them (never cache them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from pdserve.engine.kernels.stream_copy import stream_copy
from pdserve.engine.kv_tensor import KVTensor
from pdserve.kvtransfer.errors import ChecksumError, InvalidPullError
from pdserve.kvtransfer.wire import Chunk, PulledBlock, PullStats, checksum


class BlockReceiver:
    """Receives one pull into ``dest_block_ids`` (block ``first_index + i`` of the pull goes to ``dest_block_ids[i]``).

    ``expected_hashes`` (pulls by hash) are checked against each piece's hash. ``prefix``: the
    holder may send only the first blocks (a prefix pull); the pull then covers what it announced.
    """

    def __init__(
        self,
        kv_tensor: KVTensor,
        dest_block_ids: Sequence[int],
        first_index: int = 0,
        expected_hashes: Sequence[bytes] | None = None,
        prefix: bool = False,
    ) -> None:
        ids = list(dest_block_ids)
        if not ids:
            raise InvalidPullError("no destination blocks")
        if len(set(ids)) != len(ids):
            raise InvalidPullError(f"duplicate destination block ids: {ids}")
        bad = [i for i in ids if not 0 <= i < kv_tensor.num_blocks]
        if bad:
            raise InvalidPullError(f"destination block ids {bad} out of range [0, {kv_tensor.num_blocks})")
        if expected_hashes is not None and len(expected_hashes) != len(ids):
            raise InvalidPullError(f"{len(expected_hashes)} hashes for {len(ids)} destination blocks")
        self.kv_tensor = kv_tensor
        self.dest = ids
        self.first_index = first_index
        self.expected_hashes = list(expected_hashes) if expected_hashes is not None else None
        self.prefix = prefix
        self.block_nbytes = kv_tensor.layout.block_nbytes
        self.block_size = kv_tensor.layout.block_size
        self.received = [0] * len(ids)
        self.stats = PullStats()
        self._totals: tuple[int, int] | None = None
        self._t0 = time.perf_counter()
        self._staging: torch.Tensor | None = None  # host bounce buffer for a GPU tensor
        self._flat = kv_tensor.host_bytes()  # a CPU cache: each piece is one slice assignment (a memcpy)

    def accept(self, chunk: Chunk) -> None:
        """Validate ``chunk`` and write its pieces. Raises ``ChecksumError`` or ``InvalidPullError``."""
        if chunk.seq != self.stats.num_chunks:
            raise InvalidPullError(f"chunk {chunk.seq} arrived, expected chunk {self.stats.num_chunks}")
        if chunk.block_nbytes != self.block_nbytes:
            raise InvalidPullError(f"holder's blocks are {chunk.block_nbytes} bytes, local ones {self.block_nbytes}")
        totals = (chunk.total_blocks, chunk.total_tokens)
        if self._totals is None:
            if self.prefix and 1 <= chunk.total_blocks < len(self.dest):  # the holder had the first ones only
                n = chunk.total_blocks
                self.dest, self.received = self.dest[:n], self.received[:n]
                if self.expected_hashes is not None:
                    self.expected_hashes = self.expected_hashes[:n]
            if chunk.total_blocks != len(self.dest):
                raise InvalidPullError(
                    f"holder sends {chunk.total_blocks} blocks, {len(self.dest)} destination blocks were given"
                )
            self._totals = totals
        elif totals != self._totals:
            raise InvalidPullError(f"pull totals changed mid-stream: {self._totals} -> {totals}")
        if not chunk.pieces:
            raise InvalidPullError(f"chunk {chunk.seq} carries no pieces")
        for piece in chunk.pieces:
            pos = piece.index - self.first_index
            if not 0 <= pos < len(self.dest):
                raise InvalidPullError(f"piece of block index {piece.index} outside the pull")
            n = len(piece.data)
            if piece.offset != self.received[pos] or n == 0 or piece.offset + n > self.block_nbytes:
                raise InvalidPullError(
                    f"block {piece.index}: piece [{piece.offset}, {piece.offset + n}) out of order "
                    f"({self.received[pos]} of {self.block_nbytes} bytes received)"
                )
            if not 1 <= piece.num_tokens <= self.block_size:
                raise InvalidPullError(f"block {piece.index}: num_tokens {piece.num_tokens} not in [1, {self.block_size}]")
            if self.expected_hashes is not None and piece.block_hash != self.expected_hashes[pos]:
                raise InvalidPullError(f"block {piece.index}: holder sent hash {piece.block_hash.hex()}")
            if checksum(piece.data) != piece.checksum:
                raise ChecksumError(
                    f"checksum mismatch in block {piece.index} bytes [{piece.offset}, {piece.offset + n}) of chunk {chunk.seq}"
                )
            self._write(self.dest[pos], piece.offset, piece.data)
            self.received[pos] += n
            if self.received[pos] == self.block_nbytes:
                self.stats.blocks.append(
                    PulledBlock(piece.index, self.dest[pos], piece.block_hash, piece.num_tokens, self.block_nbytes)
                )
                self.stats.num_tokens += piece.num_tokens
        self.stats.num_chunks += 1
        self.stats.num_bytes += sum(len(p.data) for p in chunk.pieces)

    def finish(self) -> PullStats:
        """The stream ended: check every block arrived whole; return the stats."""
        missing = [self.first_index + i for i, r in enumerate(self.received) if r != self.block_nbytes]
        if missing:
            raise InvalidPullError(f"stream ended with blocks {missing[:8]}{'...' if len(missing) > 8 else ''} incomplete")
        if self._totals is not None and self.stats.num_tokens != self._totals[1]:
            raise InvalidPullError(f"blocks carry {self.stats.num_tokens} tokens, holder announced {self._totals[1]}")
        self.stats.num_blocks = len(self.stats.blocks)
        self.stats.seconds = time.perf_counter() - self._t0
        return self.stats

    def _write(self, block_id: int, offset: int, data: bytes | memoryview) -> None:
        if self._flat is not None:
            start = block_id * self.block_nbytes + offset
            stream_copy(self._flat[start : start + len(data)], data)  # the one copy, streamed past the cache
            return
        src = np.frombuffer(data, dtype=np.uint8)
        dest = self.kv_tensor.block_bytes(block_id)[offset : offset + len(data)]
        if self._staging is None or self._staging.numel() < len(data):
            self._staging = torch.empty(max(len(data), 1 << 20), dtype=torch.uint8, pin_memory=True)
        stage = self._staging[: len(data)]
        stage.numpy()[:] = src
        dest.copy_(stage)  # synchronous: the staging buffer is reused for the next piece
