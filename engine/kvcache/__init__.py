"""Paged KV-cache bookkeeping: block hashes, the BlockPool and the KVCacheManager (pure Python)."""

from pdserve.engine.kvcache.block import NULL_BLOCK_ID, FreeKVCacheBlockQueue, KVCacheBlock
from pdserve.engine.kvcache.block_pool import BlockPool, BlockPoolError
from pdserve.engine.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pdserve.engine.kvcache.hashing import BlockHasher, block_hashes, hash_block_tokens, none_hash, xxhash_cbor
from pdserve.engine.kvcache.manager import BlocksNotCachedError, KVCacheManager, PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockPool",
    "BlockPoolError",
    "BlockRemoved",
    "BlockStored",
    "BlocksNotCachedError",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheEvent",
    "KVCacheManager",
    "NULL_BLOCK_ID",
    "PrefixCacheStats",
    "block_hashes",
    "hash_block_tokens",
    "none_hash",
    "xxhash_cbor",
]
