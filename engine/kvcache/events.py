"""KV-cache events emitted by the BlockPool, shaped like vLLM's KV events.

The pool does no I/O: it hands these to a sink its owner registers (the Redis
publisher in a worker, a list in tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockStored:
    """Full blocks newly cached; ``block_hashes`` form one chain under ``parent_block_hash``."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str = "GPU"


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks evicted from the pool (their hashes are no longer served)."""

    block_hashes: list[bytes]
    medium: str = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""

    medium: str = field(default="GPU")


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[KVCacheEvent], None]
