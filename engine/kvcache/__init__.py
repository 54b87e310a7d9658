"""Paged KV-cache bookkeeping: block hashes, the BlockPool and the KVCacheManager (pure Python)."""

from engine.kvcache.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine.kvcache.block_pool import BlockPool, BlockPoolError
from engine.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.kvcache.hashing import BlockHasher, block_hashes, hash_block_tokens, none_hash, xxhash_cbor
from engine.kvcache.manager import KVCacheManager, PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockPool",
    "BlockPoolError",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "PrefixCacheStats",
    "block_hashes",
    "hash_block_tokens",
    "none_hash",
    "xxhash_cbor",
]
