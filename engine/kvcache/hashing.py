"""Chained, deterministic block hashes (the wire contract of docs/block-hashes.md).

``xxhash_cbor(x) = xxh3_128(cbor2.dumps(x, canonical=True))``. The chain root is
``xxhash_cbor(seed)`` for the cluster's ``hash_seed`` string, and block ``i`` of a
sequence hashes ``(parent, tuple(tokens of block i), extra_keys)``. Nothing here
depends on ``PYTHONHASHSEED`` or Python's ``hash()``, so every process of a
cluster derives the same hashes for the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import cbor2
import xxhash

BlockHash = bytes


def xxhash_cbor(obj: object) -> BlockHash:
    """16-byte xxh3_128 digest of the canonical CBOR encoding of ``obj``."""
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


@lru_cache(maxsize=64)
def none_hash(seed: str = "0") -> BlockHash:
    """Root of every hash chain for a cluster whose ``hash_seed`` is ``seed``."""
    if not isinstance(seed, str):
        raise TypeError(f"hash seed must be a str, got {type(seed).__name__}")
    return xxhash_cbor(seed)


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
    seed: str = "0",
) -> BlockHash:
    """Hash of one full block given its parent's hash (``None`` for block 0)."""
    if parent is None:
        parent = none_hash(seed)
    return xxhash_cbor((parent, tuple(token_ids), extra_keys))


def block_extra_keys(block_index: int, cache_salt: str | None, lora_name: str | None) -> tuple | None:
    """``extra_keys`` of block ``block_index``: LoRA name, then the salt on block 0 only.

    An empty salt is no salt (as in vLLM, which tests the salt's truthiness).
    """
    keys: list[str] = []
    if lora_name is not None:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    seed: str = "0",
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``; a trailing partial block is not hashed."""
    hasher = BlockHasher(block_size, seed=seed, cache_salt=cache_salt, lora_name=lora_name)
    hasher.extend(token_ids)
    return hasher.hashes


class BlockHasher:
    """Incremental hasher for a growing sequence.

    ``extend`` hashes only the blocks that became full since the last call, so a
    decode step that appends one token never rehashes earlier blocks.
    ``hashes[i]`` is the hash of block ``i``; the list only grows.
    """

    __slots__ = ("block_size", "seed", "cache_salt", "lora_name", "hashes", "_pending", "hash_calls")

    def __init__(
        self,
        block_size: int,
        seed: str = "0",
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.seed = seed
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.hashes: list[BlockHash] = []
        self._pending: list[int] = []
        self.hash_calls = 0  # number of block hashes computed (for tests and stats)

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Feed new tokens; return the hashes of blocks completed by them."""
        pending = self._pending
        pending.extend(token_ids)
        bs = self.block_size
        num_full = len(pending) // bs
        new: list[BlockHash] = []
        parent = self.hashes[-1] if self.hashes else None
        for b in range(num_full):
            idx = len(self.hashes)
            block = pending[b * bs : (b + 1) * bs]
            parent = hash_block_tokens(parent, block, block_extra_keys(idx, self.cache_salt, self.lora_name), self.seed)
            self.hashes.append(parent)
            new.append(parent)
        self.hash_calls += num_full
        if num_full:
            del pending[: num_full * bs]
        return new
