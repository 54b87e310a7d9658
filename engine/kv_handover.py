"""The engine's KV-handover API: everything prefill/decode disaggregation needs from an engine.

Modelled on vLLM's KV-connector split (docs/kv-handover.md), in two halves. The KV wire
(``pdserve.kvtransfer``) and the workers use only this module and the ``LLMEngine`` methods it
names; they never touch the cache manager, the sampler or a request's fields.

Producer (the engine that prefills; vLLM: ``request_finished`` with delayed free, then
``finished_sending``):

* A request made with ``handoff=True`` ends after its prefill and first sampled token (unless
  that token ends it anyway) with finish reason ``"handoff"``; its output carries a ``HeldKV``
  and its blocks stay held until ``KVHandover.release(request_id)``.
* ``pin_cached(hashes)`` / ``unpin``: full blocks of the prefix cache, referenced for a reader
  outside any request (a pull by hash); blocks only the offload tier holds are restored first.
  ``pin_cached_prefix`` pins the longest cached prefix, waiting for its first block: a prompt's
  blocks are cached chunk by chunk as its prefill runs (the engine calls ``blocks_cached`` after
  every step), so a reader can take them while later chunks compute.

Consumer (the engine that continues; vLLM: ``get_num_new_matched_tokens`` +
``update_state_after_alloc``, then ``finished_recving``):

* ``LLMEngine.add_remote(request, RemotePrefill)`` reuses the engine's own cached prefix and
  reserves blocks for the rest of the KV computed elsewhere: a ``KVLoad`` says where to write.
* ``LLMEngine.finish_load(request_id, ok)``: the bytes landed (the request continues from them,
  after the tokens sampled elsewhere, its seeded sampler advanced past those draws) or they did
  not (it recomputes its prompt here).
* ``begin_prefetch(hashes)`` / ``end_prefetch``: blocks for cached KV that arrives ahead of its
  request (pulled by hash while the prompt is still being prefilled elsewhere); what landed is
  cached, so the request's ``add_remote`` finds it as its own prefix.

Bytes: ``KVHandover.kv_tensor.block_bytes(block_id)`` of held, pinned or loading blocks;
``KVHandover.layout`` says what a block holds. A new source of external blocks (an offload
tier) or a new block layout (FP8 with scales, MLA latents) goes through the same calls.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.kv_offload import OffloadTier, TierCorruptionError
from pdserve.engine.kv_tensor import KVLayout, KVTensor
from pdserve.engine.kvcache.manager import BlocksNotCachedError, KVCacheManager, KVRequest, cdiv

__all__ = ["BlocksNotCachedError", "HeldKV", "KVHandover", "KVLoad", "PinnedKV", "Prefetch", "RemotePrefill"]


@dataclass(frozen=True)
class HeldKV:
    """A handed-off request's KV: the blocks of its first ``num_tokens`` tokens, in order.

    ``block_hashes`` are the hashes of the full ones among them (the last block may be partial).
    """

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    block_size: int

    def num_tokens_of(self, index: int) -> int:
        """Valid tokens in block ``index`` (only the last block may be partial)."""
        return min(self.block_size, self.num_tokens - index * self.block_size)

    def hash_of(self, index: int) -> bytes:
        """Hash of block ``index``; empty for a partial block."""
        return self.block_hashes[index] if index < len(self.block_hashes) else b""


@dataclass(frozen=True)
class PinnedKV:
    """Cached full blocks referenced for one reader; give them back with ``KVHandover.unpin``."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class Prefetch:
    """Blocks taken for cached KV arriving ahead of its request: ``block_ids[i]`` is to hold the
    KV of ``block_hashes[i]``. Give them back with ``KVHandover.end_prefetch``."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class RemotePrefill:
    """What another engine did for a request: the KV of its first ``num_tokens`` prompt tokens,
    and the tokens it sampled after them (with the request's own sampling parameters)."""

    num_tokens: int
    output_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if not self.output_token_ids:
            raise ValueError("a remote prefill hands over at least the token it sampled")


@dataclass(frozen=True)
class KVLoad:
    """Blocks reserved for KV that arrives from outside.

    The request's first ``num_local_hit_tokens`` tokens were found in this engine's prefix cache;
    the next ``num_external_tokens`` must be written into ``block_ids`` (the request's blocks
    ``first_block``, ``first_block + 1``, ...). ``block_hashes[i]`` is what block ``block_ids[i]``
    is expected to hold (``b""`` for a partial last block), for a transfer to check.
    """

    request_id: str
    num_local_hit_tokens: int
    num_external_tokens: int
    first_block: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]

    @property
    def num_tokens(self) -> int:
        return self.num_local_hit_tokens + self.num_external_tokens


class KVHandover:
    """Block-level half of the API over one cache manager and KV tensor (no model needed).

    Thread-safe: every call takes ``lock`` (the engine's), so a transfer server's threads and
    the engine's stepping thread may call in concurrently. ``on_blocks_freed`` (set by whoever
    steps the engine) is called, outside the lock, after a release returned blocks to the pool.
    """

    def __init__(self, manager: KVCacheManager, kv_tensor: KVTensor, lock: threading.RLock | None = None) -> None:
        if kv_tensor.layout.block_size != manager.block_size:
            raise ValueError(f"KV tensor block_size {kv_tensor.layout.block_size} != manager's {manager.block_size}")
        if kv_tensor.num_blocks != manager.num_blocks:
            raise ValueError(f"KV tensor has {kv_tensor.num_blocks} blocks, the manager {manager.num_blocks}")
        self._manager = manager
        self.kv_tensor = kv_tensor
        self.lock = lock or threading.RLock()
        self._held: dict[str, HeldKV] = {}
        self._pins: Counter[int] = Counter()  # references outside requests (pins, prefetches), per block id
        self._cached = threading.Condition(self.lock)  # notified after every engine step
        self.on_blocks_freed: Callable[[], None] | None = None
        # The engine's offload tier, if any: pin_cached restores from it what the pool lacks.
        self.tier: OffloadTier | None = None

    @property
    def layout(self) -> KVLayout:
        return self.kv_tensor.layout

    @property
    def block_size(self) -> int:
        return self._manager.block_size

    # -- producer ---------------------------------------------------------------------------
    def hold(self, request: KVRequest, num_tokens: int) -> HeldKV:
        """Keep the blocks of ``request``'s first ``num_tokens`` tokens after it ends here; they
        are freed (with any others it holds) by ``release``. The engine calls this when a
        ``handoff`` request is handed off."""
        bs = self.block_size
        with self.lock:
            rid = request.request_id
            blocks = self._manager.get_blocks(rid)
            if rid in self._held:
                raise ValueError(f"request {rid!r} is already held")
            if num_tokens < 1 or cdiv(num_tokens, bs) > len(blocks):
                raise ValueError(f"request {rid!r} holds {len(blocks)} blocks, cannot hold {num_tokens} tokens")
            kept = blocks[: cdiv(num_tokens, bs)]
            if any(b.is_null for b in kept):
                raise ValueError(f"request {rid!r}: some of its blocks slid out of the window and are gone")
            held = HeldKV(rid, tuple(b.block_id for b in kept), tuple(request.block_hashes[: num_tokens // bs]),
                          num_tokens, bs)  # fmt: skip
            self._held[rid] = held
            return held

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks; False if it is not held (never, or released already)."""
        with self.lock:
            if self._held.pop(request_id, None) is None:
                return False
            self._manager.free(request_id)
        if self.on_blocks_freed is not None:
            self.on_blocks_freed()
        return True

    def try_release(self, request_id: str) -> bool:
        """``release`` only if the lock is free now (a step holds it for as long as it runs): True
        when done (held or not), False when the lock was taken and nothing changed."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self.release(request_id)
        finally:
            self.lock.release()
        return True

    @property
    def num_held(self) -> int:
        with self.lock:
            return len(self._held)

    def pin_cached(self, block_hashes: Sequence[bytes]) -> PinnedKV:
        """Reference the cached full block of each hash until ``unpin``.

        Raises ``BlocksNotCachedError`` (``.missing``: the hashes not cached); nothing is pinned then.
        """
        hashes = tuple(bytes(h) for h in block_hashes)
        with self.lock:
            try:
                blocks = self._manager.pin_cached(hashes)
            except BlocksNotCachedError as exc:
                gone = set(exc.missing)
                if not self.restore_from_tier(exc.missing, keep=[h for h in hashes if h not in gone]):
                    raise
                blocks = self._manager.pin_cached(hashes)
            self._pins.update(b.block_id for b in blocks)
        return PinnedKV(tuple(b.block_id for b in blocks), hashes)

    def pin_cached_prefix(self, block_hashes: Sequence[bytes], wait_s: float) -> PinnedKV:
        """Reference the cached blocks of the longest cached prefix of ``block_hashes``, waiting up to
        ``wait_s`` for its first block to be cached. Raises ``BlocksNotCachedError`` (the first hash)
        when it was not in time; nothing is pinned then."""
        hashes = tuple(bytes(h) for h in block_hashes)
        deadline = time.monotonic() + wait_s
        with self.lock:
            n = self._manager.num_cached_prefix(hashes)
            while n == 0 and (left := deadline - time.monotonic()) > 0:
                self._cached.wait(left)
                n = self._manager.num_cached_prefix(hashes)
            if n == 0:
                raise BlocksNotCachedError(list(hashes[:1]), len(hashes))
            blocks = self._manager.pin_cached(hashes[:n])
            self._pins.update(b.block_id for b in blocks)
        return PinnedKV(tuple(b.block_id for b in blocks), hashes[:n])

    def blocks_cached(self) -> None:
        """Wake ``pin_cached_prefix`` waits: blocks may have been cached (the engine, after a step)."""
        with self.lock:
            self._cached.notify_all()

    def restore_from_tier(self, block_hashes: Sequence[bytes], keep: Sequence[bytes] = ()) -> bool:
        """Bring blocks back from the offload tier into the pool as cached, free blocks (a prefix
        lookup or ``pin_cached`` then finds them); ``keep``: cached hashes the room-making must
        not evict. All or nothing: False (nothing changed in the pool) when the tier lacks one,
        the pool has too few free blocks, or a tier block's bytes changed."""
        tier, pool = self.tier, self._manager.pool
        missing = list(dict.fromkeys(block_hashes))
        with self.lock:
            if tier is None or not missing or tier.match(missing) < len(missing):
                return False
            held = self._manager.pin_cached(list(keep))  # referenced: not evicted while room is made
            try:
                if pool.get_num_free_blocks() < len(missing):
                    return False
                tier.touch(missing)
                # The pool's evictions below are stored into the tier: they must not drop ``missing``.
                with tier.protected(missing):
                    blocks = pool.get_new_blocks(len(missing))
                    try:
                        for block, h in zip(blocks, missing):
                            tier.load(h, self.kv_tensor.block_bytes(block.block_id))
                    except (KeyError, TierCorruptionError):
                        pool.free_blocks(blocks)
                        return False
                    except BaseException:
                        pool.free_blocks(blocks)
                        raise
                pool.cache_restored_blocks(blocks, missing, self.block_size)
                pool.free_blocks(reversed(blocks))  # cached and free, the chain's tail evicted first
                return True
            finally:
                self._manager.unpin(held)

    def unpin(self, pinned: PinnedKV, wait: bool = True) -> bool:
        """Drop ``pin_cached``'s references. ``wait`` False: only if the lock is free now (a step
        holds it for as long as it runs); False when it was not, and nothing changed."""
        if not self.lock.acquire(blocking=wait):
            return False
        try:
            blocks = [self._manager.pool.blocks[i] for i in pinned.block_ids]
            self._pins.subtract(pinned.block_ids)
            self._pins += Counter()  # drop zero counts
            self._manager.unpin(blocks)
        finally:
            self.lock.release()
        if self.on_blocks_freed is not None:
            self.on_blocks_freed()
        return True

    # -- consumer ---------------------------------------------------------------------------
    def reserve(self, request: KVRequest, num_tokens: int) -> KVLoad | None:
        """Reuse this pool's cached prefix of ``request`` (whole blocks within its first
        ``num_tokens`` tokens) and allocate blocks for the rest of those tokens as external KV:
        they are not cached until ``complete`` says they were written. None when the pool has
        too few free blocks (nothing changed). The request must hold no blocks yet."""
        bs = self.block_size
        with self.lock:
            rid = request.request_id
            if request.num_computed_tokens or self._manager.get_blocks(rid):
                raise ValueError(f"request {rid!r} already has KV")
            if not 1 <= num_tokens <= request.num_tokens:
                raise ValueError(f"num_tokens {num_tokens} not in [1, {request.num_tokens}]")
            hit, _ = self._manager.get_computed_blocks(request)
            hit = hit[: num_tokens // bs]
            num_hit = len(hit) * bs
            num_external = num_tokens - num_hit
            new_blocks = self._manager.allocate_slots(
                request, 0, num_hit, hit, num_external_computed_tokens=num_external, trim_window=False
            )
            if new_blocks is None:
                return None
            first = len(hit)
            hashes = request.block_hashes
            expected = tuple(hashes[i] if i < num_tokens // bs else b"" for i in range(first, first + len(new_blocks)))
            return KVLoad(rid, num_hit, num_external, first, tuple(b.block_id for b in new_blocks), expected)

    def complete(self, request: KVRequest, load: KVLoad, ok: bool) -> None:
        """End a load: ``ok`` marks its tokens computed and caches the full blocks now written;
        otherwise every block the request holds (local hits included) goes back to the pool."""
        with self.lock:
            if ok:
                request.num_computed_tokens = load.num_tokens
                self._manager.mark_external_complete(request, load.num_tokens)
            else:
                request.num_computed_tokens = 0
                self._manager.free(request)

    def begin_prefetch(self, block_hashes: Sequence[bytes], max_blocks: int) -> Prefetch | None:
        """Take free blocks for the hashes of ``block_hashes`` from the first one this pool does not
        cache, at most ``max_blocks`` and half the free blocks (a prefetch only saves time: it must not
        crowd out running requests, nor evict much of the prefix cache); None when all are cached or
        too few blocks are free. The blocks are the prefetch's (no request's) until ``end_prefetch``."""
        hashes = tuple(bytes(h) for h in block_hashes)
        with self.lock:
            start = self._manager.num_cached_prefix(hashes)
            held = self._manager.pin_cached(list(hashes[:start]))  # the prefix it extends: not evicted for it
            try:
                n = min(max_blocks, len(hashes) - start, self._manager.pool.get_num_free_blocks() // 2)
                if n <= 0:
                    return None
                blocks = self._manager.pool.get_new_blocks(n)
            finally:
                self._manager.unpin(held)
            self._pins.update(b.block_id for b in blocks)
        return Prefetch(tuple(b.block_id for b in blocks), hashes[start : start + n])

    def end_prefetch(self, prefetch: Prefetch, num_written: int) -> None:
        """The first ``num_written`` blocks of ``prefetch`` hold their hashes' KV: cache them. Every
        block goes back to the pool (the cached ones free but found by the next prefix lookup)."""
        pool = self._manager.pool
        with self.lock:
            blocks = [pool.blocks[i] for i in prefetch.block_ids]
            pool.cache_restored_blocks(blocks[:num_written], prefetch.block_hashes[:num_written], self.block_size)
            self._pins.subtract(prefetch.block_ids)
            self._pins += Counter()  # drop zero counts
            self._manager.unpin(blocks)  # the chain's tail first: evicted before its parents
        if self.on_blocks_freed is not None:
            self.on_blocks_freed()

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The manager's invariants, counting the references pinned reads hold."""
        with self.lock:
            self._manager.check_invariants(dict(self._pins))
