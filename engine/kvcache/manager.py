"""KVCacheManager: maps requests to blocks of the BlockPool and runs the prefix cache.

The scheduler sees only what this class returns (lists of blocks or ``None``), never
the pool's internals. With a sliding window (Mistral), blocks that slid out of every
window go back to the pool as the request advances; the null block takes their place
in the request's block list (``get_block_ids`` shows it as ``NULL_BLOCK_ID``, -1), so
block indices never shift. A request handed to it must expose:

- ``request_id: str``
- ``all_token_ids: Sequence[int]`` (prompt + output so far) and ``num_tokens``
- ``num_computed_tokens: int`` (tokens whose KV is already in the request's blocks)
- ``block_hashes: Sequence[bytes]`` (hashes of its full blocks, grown incrementally)
- ``lora_name: str | None``
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.kvcache.block import KVCacheBlock
from pdserve.engine.kvcache.block_pool import BlockPool, BlockPoolError
from pdserve.engine.kvcache.events import EventSink


class BlocksNotCachedError(LookupError):
    """Some of the asked-for block hashes are not in the prefix cache (``missing``, in order)."""

    def __init__(self, missing: list[bytes], asked: int) -> None:
        shown = ", ".join(h.hex() for h in missing[:4]) + (", ..." if len(missing) > 4 else "")
        super().__init__(f"{len(missing)} of {asked} block hashes not in the prefix cache: {shown}")
        self.missing = missing


class KVRequest(Protocol):
    request_id: str
    num_computed_tokens: int
    lora_name: str | None

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups counted in tokens; the hit rate is a ratio of sums."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_for_request(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    block_size: int,
    sliding_window: int | None = None,
    max_chunk_tokens: int | None = None,
) -> int:
    """KV blocks a request holds at most: prompt + max_tokens, capped at max_model_len.

    With a sliding window it holds less once blocks slide out: at most the window's span past one
    step's chunk (vLLM's bound; a chunk is at most ``max_chunk_tokens``, and a preempted request
    recomputes prompt and output in chunks too), or its whole prompt plus one block (a prompt whose
    KV is handed over is held whole), whichever is larger.
    """
    longest = min(num_prompt_tokens + max_tokens, max_model_len)
    full = cdiv(longest, block_size)
    if sliding_window is None:
        return full
    chunk = min(longest, max_chunk_tokens or longest)
    windowed = max(cdiv(chunk + sliding_window - 1, block_size), cdiv(num_prompt_tokens, block_size)) + 1
    return min(full, windowed)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        medium: str = "GPU",
        event_sink: EventSink | None = None,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, medium, event_sink)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of a request's leading blocks already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Requests whose external (transferred) KV is not yet complete: not cached past this token count.
        self._external_until: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # -- queries ------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    # -- prefix cache ---------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_blocks: int) -> list[KVCacheBlock]:
        hit: list[KVCacheBlock] = []
        if not self.enable_caching:
            return hit
        for h in block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest chain of cached full blocks for the request's prefix, and its token count.

        The hit is capped so that at least one token is left to compute (its logits are
        needed to sample). Nothing is referenced yet: pass the blocks to ``allocate_slots``.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit = self.find_longest_cache_hit(request.block_hashes, max_blocks)
        return hit, len(hit) * self.block_size

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
        num_external_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        trim_window: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of KV (plus prefix hits and external KV).

        Returns the newly allocated blocks, or ``None`` when the pool cannot serve the
        request; nothing changes then, except that blocks which slid out of the window are
        back in the pool. ``new_computed_blocks`` (from ``get_computed_blocks``) are referenced
        and appended first. External tokens are KV another worker will send: their blocks
        are allocated now and cached only after ``mark_external_complete``. Full blocks of
        locally computed tokens are registered in the prefix cache now. With a sliding window
        and ``trim_window``, blocks no query of this step can see are freed first (a request
        whose whole KV will be handed over passes ``trim_window=False``).
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_external_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        new_computed_blocks = list(new_computed_blocks or [])
        if num_new_computed_tokens != len(new_computed_blocks) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_new_computed_tokens} does not match "
                f"{len(new_computed_blocks)} computed blocks of {self.block_size} tokens"
            )
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        if self.sliding_window is not None and trim_window:
            skipped = self._num_skipped_blocks(num_computed)
            self._remove_skipped_blocks(req_blocks, skipped)
            # Hit blocks already outside every window are not taken: the null block stands in.
            base = len(req_blocks)
            null = self.pool.null_block
            new_computed_blocks = [null if base + i < skipped else b for i, b in enumerate(new_computed_blocks)]
        num_total = num_computed + num_new_tokens + num_lookahead_tokens
        num_required = cdiv(num_total, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        hits = [b for b in new_computed_blocks if not b.is_null]
        # Touching a free cached block takes it out of the free queue, so it counts too.
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.get_num_free_blocks():
            return None

        self.pool.touch(hits)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        if rid not in self.req_to_blocks:
            self.req_to_blocks[rid] = req_blocks
            self.num_cached_blocks[rid] = 0
            # Counted at its first admission only: a retry after a failed allocation, or a request
            # admitted again after a preemption or a failed load, is not a new query.
            if not request.counted_in_prefix_stats:
                request.counted_in_prefix_stats = True
                self.stats.requests += 1
                self.stats.queries += request.num_tokens
                self.stats.hits += num_new_computed_tokens
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        if num_external_computed_tokens:
            self._external_until[rid] = request.num_computed_tokens + num_new_computed_tokens
        num_to_cache = min(num_computed + num_new_tokens, request.num_tokens)
        if rid in self._external_until:
            num_to_cache = min(num_to_cache, self._external_until[rid])
        self.cache_blocks(request, num_to_cache)
        return new_blocks

    def _num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at or after ``num_computed_tokens`` can see through the window."""
        assert self.sliding_window is not None
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _remove_skipped_blocks(self, blocks: list[KVCacheBlock], num_skipped: int) -> None:
        """Free ``blocks[:num_skipped]`` (newest first, so older ones stay cached longest) and
        put the null block in their place; earlier calls already nulled a prefix of them."""
        removed: list[KVCacheBlock] = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = self.pool.null_block
        self.pool.free_blocks(removed)

    def mark_external_complete(self, request: KVRequest, num_tokens: int | None = None) -> None:
        """The external KV of ``request`` has landed: cache its full blocks now."""
        self._external_until.pop(request.request_id, None)
        if request.request_id in self.req_to_blocks:
            self.cache_blocks(request, request.num_computed_tokens if num_tokens is None else num_tokens)

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Register the request's full blocks covering its first ``num_tokens`` tokens."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            raise BlockPoolError(f"request {rid!r} holds no blocks")
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        done = self.num_cached_blocks.get(rid, 0)
        if num_full <= done:
            return
        self.pool.cache_full_blocks(
            blocks, request.block_hashes, done, num_full, self.block_size, request.all_token_ids, request.lora_name
        )
        self.num_cached_blocks[rid] = num_full

    def uncache_blocks(self, request: KVRequest, from_token: int) -> int:
        """Unregister the request's cached blocks from the one holding ``from_token`` on.

        For a step whose forward pass failed: blocks registered when it was scheduled never
        received their KV, so no later request may hit them. Returns how many were uncached.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, [])
        first = from_token // self.block_size
        n = self.pool.uncache_blocks(blocks[first:])
        if rid in self.num_cached_blocks:
            self.num_cached_blocks[rid] = min(self.num_cached_blocks[rid], first)
        return n

    def free(self, request: KVRequest | str) -> None:
        """Return every block the request holds; the tail of its chain becomes the first to evict.

        Raises ``BlockPoolError`` if the request holds no blocks (freed twice or never allocated).
        """
        rid = request if isinstance(request, str) else request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks is None:
            raise BlockPoolError(f"free of request {rid!r} that holds no blocks (double free?)")
        self.num_cached_blocks.pop(rid, None)
        self._external_until.pop(rid, None)
        self.pool.free_blocks(reversed(blocks))

    def pin_cached(self, block_hashes: Sequence[bytes]) -> list[KVCacheBlock]:
        """Take a reference on the cached block of each hash (a reader outside any request, e.g.
        a pull by hash); pair with ``unpin``. Raises ``BlocksNotCachedError`` listing every hash
        not cached; nothing is pinned then."""
        found = [self.pool.get_cached_block(h) for h in block_hashes]
        missing = [h for h, b in zip(block_hashes, found) if b is None]
        if missing:
            raise BlocksNotCachedError(missing, len(block_hashes))
        blocks: list[KVCacheBlock] = found  # type: ignore[assignment]
        self.pool.touch(blocks)
        return blocks

    def num_cached_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes``, from the first on, are cached (stopping at the first that is not).
        Also safe without the caller's lock, as a hint: each lookup is a single read."""
        n = 0
        for h in block_hashes:
            if not self.pool.has_cached(h):
                break
            n += 1
        return n

    def unpin(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop the references ``pin_cached`` took (chain tail first: evicted before its parents)."""
        self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_invariants(self, extra_pins: dict[int, int] | None = None) -> None:
        """Pool invariants plus: each block's ref_cnt equals the live requests holding it
        (plus ``extra_pins[block_id]`` references taken outside requests, e.g. by a transfer)."""
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                if not b.is_null:
                    holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            pinned = holders.get(b.block_id, 0) + (extra_pins or {}).get(b.block_id, 0)
            assert b.ref_cnt == pinned, f"block {b.block_id} ref_cnt {b.ref_cnt} != holders {pinned}"
