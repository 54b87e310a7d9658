"""Plain-Python shapes of what the KV wire carries, and how a pull is cut into chunks.

No gRPC here: the servicer and the client convert these to and from protobuf at the edge
(``kvtransfer.protoconv``), so everything below is testable on its own.

Chunking contract: a pull of ``n`` blocks of ``block_nbytes`` bytes each is a sequence of
chunks; a chunk carries at most ``chunk_bytes`` payload bytes in at most
``max_pieces`` pieces. Chunks are filled greedily in block order, so a block that does
not fit in the room left is split: its pieces come in order, at increasing offsets, and
cover the block exactly once. A partial (last) block is sent whole: the bytes past its
``num_tokens`` are the holder's stale slots, which the puller overwrites as it decodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import xxhash

from pdserve.engine.kv_tensor import KVLayout

# Trailing-metadata key of a NOT_FOUND pull: the missing block hashes, hex, comma-separated.
MISSING_HASHES_KEY = "pdserve-missing-hashes"


def checksum(data: bytes | memoryview) -> int:
    """xxh3_64 of ``data``: the checksum of every piece on the wire."""
    return xxhash.xxh3_64_intdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype: ``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LayoutSpec:
    """What two peers must agree on to exchange blocks byte for byte."""

    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_nbytes: int
    kv_scales: tuple[float, ...] = ()  # an FP8 cache's scales: the bytes mean nothing without them
    kind: str = "mha"  # "mha" (K and V per head) or "mla" (one latent row per token)
    rope_dim: int = 0  # "mla": the rotary values at the end of a row

    @classmethod
    def from_layout(cls, layout: KVLayout) -> LayoutSpec:
        return cls(
            dtype=dtype_name(layout.dtype),
            block_size=layout.block_size,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_nbytes=layout.block_nbytes,
            kv_scales=tuple(layout.kv_scales),
            kind=layout.kind,
            rope_dim=layout.rope_dim,
        )

    def diff(self, remote: LayoutSpec) -> dict[str, tuple[object, object]]:
        """Fields that differ, as ``name -> (self's value, remote's value)``; empty if equal."""
        names = ("kind", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "rope_dim", "block_nbytes",
                 "kv_scales")  # fmt: skip
        return {n: (getattr(self, n), getattr(remote, n)) for n in names if getattr(self, n) != getattr(remote, n)}


@dataclass(frozen=True)
class TransferMetadata:
    """A holder's identity and KV layout (the GetMetadata answer)."""

    model_fingerprint: str
    layout: LayoutSpec
    worker_id: str
    max_chunk_bytes: int
    host_id: str = ""  # "<boot id>/<uid>"; empty: no same-host transport offered
    shm_socket: str = ""  # the holder's Unix socket for PullShm tickets
    nixl: bool = False  # the holder serves PullNixl

    def mismatches(self, local_layout: KVLayout, local_fingerprint: str) -> dict[str, tuple[object, object]]:
        """Fields in which this (remote) holder differs from the local worker: ``name -> (local, remote)``."""
        diff = LayoutSpec.from_layout(local_layout).diff(self.layout)
        if local_fingerprint != self.model_fingerprint:
            diff = {"model_fingerprint": (local_fingerprint, self.model_fingerprint), **diff}
        return diff


def describe_mismatch(fields: dict[str, tuple[object, object]]) -> str:
    """``"head_dim: local 8 != remote 16, ..."`` for error messages."""
    return ", ".join(f"{name}: local {a!r} != remote {b!r}" for name, (a, b) in fields.items())


@dataclass(frozen=True)
class Piece:
    """A contiguous piece of one block: ``data`` is ``block[offset:offset+len(data)]``.

    On the holder ``data`` is a view of the (pinned) block, valid while the pull streams.
    """

    index: int
    block_hash: bytes
    num_tokens: int
    offset: int
    data: bytes | memoryview
    checksum: int


@dataclass(frozen=True)
class Chunk:
    """One stream message: the pull's totals and up to ``max_pieces`` pieces."""

    seq: int
    total_blocks: int
    total_tokens: int
    block_nbytes: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class PieceSpec:
    """Where a piece comes from: block ``position`` (0-based within the pull), byte range."""

    position: int
    offset: int
    length: int


def plan_chunks(num_blocks: int, block_nbytes: int, chunk_bytes: int, max_pieces: int) -> Iterator[list[PieceSpec]]:
    """Cut ``num_blocks`` blocks into chunks per the module's chunking contract.

    Lazy: nothing is materialised beyond the chunk being yielded.
    """
    if num_blocks < 0 or block_nbytes < 1 or chunk_bytes < 1 or max_pieces < 1:
        raise ValueError(f"bad chunk plan: {num_blocks=} {block_nbytes=} {chunk_bytes=} {max_pieces=}")
    chunk: list[PieceSpec] = []
    room = chunk_bytes
    for position in range(num_blocks):
        offset = 0
        while offset < block_nbytes:
            length = min(block_nbytes - offset, room)
            chunk.append(PieceSpec(position, offset, length))
            offset += length
            room -= length
            if room == 0 or len(chunk) == max_pieces:
                yield chunk
                chunk, room = [], chunk_bytes
    if chunk:
        yield chunk


@dataclass(frozen=True)
class PulledBlock:
    """One block that landed in the puller's KV tensor."""

    index: int
    block_id: int
    block_hash: bytes
    num_tokens: int
    nbytes: int


@dataclass
class PullStats:
    """What a pull moved; ``blocks`` is in pull order. ``transport``: what carried the bytes,
    ``"grpc"`` (the PullChunk stream), ``"shm"`` (a staging region shared with a holder on the same
host) or ``"nixl"`` (NIXL writes into a registered staging region)."""

    num_blocks: int = 0
    num_bytes: int = 0
    num_tokens: int = 0
    num_chunks: int = 0
    seconds: float = 0.0
    blocks: list[PulledBlock] = field(default_factory=list)
    transport: str = "grpc"

    @property
    def gbps(self) -> float:
        """Payload throughput in GB/s (10**9 bytes per second)."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
