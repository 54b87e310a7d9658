"""pull_request_kv: give a decode worker's request the KV a peer holds for it.

Steps (pool operations under the owner's ``lock``; the network transfer outside it):

1. Reuse the local prefix cache: ``manager.get_computed_blocks(request)``, capped to the
   full blocks of the first ``num_tokens`` tokens.
2. Allocate the blocks of the remaining ``N`` tokens as external tokens:
   ``manager.allocate_slots(request, 0, hit_tokens, hit_blocks, num_external_computed_tokens=N)``.
   They are not cached yet, so no other request can hit on them while they fill.
3. Pull them (by lease from the block after the local hit, or by the request's own block
   hashes) straight into the local KV tensor.
4. On success: ``request.num_computed_tokens = num_tokens`` and
   ``manager.mark_external_complete(request, num_tokens)``, which caches the now valid
   full blocks. On any failure: ``manager.free(request)`` (local hits included, so the
   pool is exactly as before) and the ``TransferError`` propagates; the caller recomputes.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from engine.kv_cache import KVCacheTensor
from engine.kvcache.manager import KVCacheManager, KVRequest
from kvtransfer.client import KVTransferClient
from kvtransfer.errors import InvalidPullError, TransferError
from kvtransfer.wire import PullStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVPullResult:
    """Where the request's first ``num_local_hit_tokens + num_external_tokens`` tokens of KV came from."""

    num_local_hit_tokens: int
    num_external_tokens: int
    block_ids: list[int]  # all the request's blocks after the pull, in order
    stats: PullStats


def pull_request_kv(
    manager: KVCacheManager,
    kv: KVCacheTensor,
    request: KVRequest,
    client: KVTransferClient,
    num_tokens: int,
    *,
    lease_id: str | None = None,
    lock: AbstractContextManager | None = None,
    use_local_prefix: bool = True,
    release_lease: bool = True,
    timeout_s: float | None = None,
) -> KVPullResult | None:
    """Make the KV of ``request``'s first ``num_tokens`` tokens present locally (module docstring).

    With ``lease_id`` the blocks come from that lease (which must cover exactly
    ``num_tokens`` tokens of this request; its partial last block included) and the lease
    is released after a successful pull when ``release_lease``. Without it they are pulled
    by the request's block hashes from the holder's prefix cache, so ``num_tokens`` must be
    a whole number of blocks. The request must hold no blocks and have no computed tokens.

    Returns ``None`` (nothing changed) when the local pool has too few free blocks.
    Raises ``TransferError`` after freeing everything it allocated.
    """
    bs = manager.block_size
    lock = lock if lock is not None else nullcontext()
    if request.num_computed_tokens != 0:
        raise ValueError(f"request {request.request_id!r} already has {request.num_computed_tokens} computed tokens")
    if not 1 <= num_tokens <= request.num_tokens:
        raise ValueError(f"num_tokens {num_tokens} not in [1, {request.num_tokens}]")
    if lease_id is None and (num_tokens % bs or num_tokens // bs > len(request.block_hashes)):
        raise ValueError(f"a pull by hash needs whole hashed blocks; {num_tokens} tokens, block size {bs}")

    with lock:
        if manager.get_blocks(request.request_id):
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        hit = []
        if use_local_prefix:
            hit, _ = manager.get_computed_blocks(request)
            hit = hit[: num_tokens // bs]
        num_hit = len(hit) * bs
        num_external = num_tokens - num_hit
        new_blocks = manager.allocate_slots(request, 0, num_hit, hit, num_external_computed_tokens=num_external)
        if new_blocks is None:
            return None
        block_ids = manager.get_block_ids(request.request_id)

    try:
        stats = PullStats()
        if num_external:
            dest = [b.block_id for b in new_blocks]
            if lease_id is not None:
                stats = client.pull_into(kv, dest, lease_id=lease_id, first_block=len(hit), timeout_s=timeout_s)
            else:
                hashes = list(request.block_hashes[len(hit) : num_tokens // bs])
                stats = client.pull_into(kv, dest, block_hashes=hashes, timeout_s=timeout_s)
            _check_pulled(request, stats, num_external)
        with lock:
            request.num_computed_tokens = num_tokens
            manager.mark_external_complete(request, num_tokens)
    except BaseException:
        with lock:
            request.num_computed_tokens = 0
            manager.free(request)
        raise

    if lease_id is not None and release_lease:
        try:
            client.release(lease_id)
        except TransferError as exc:  # the lease expires on its own; the KV is already here
            logger.warning("releasing lease %s on %s failed: %s", lease_id, client.address, exc)
    return KVPullResult(num_hit, num_external, block_ids, stats)


def _check_pulled(request: KVRequest, stats: PullStats, num_external: int) -> None:
    """The blocks are this request's: same token count, and every hash the holder sent matches ours."""
    if stats.num_tokens != num_external:
        raise InvalidPullError(f"holder sent {stats.num_tokens} tokens of KV, {num_external} were expected")
    hashes = request.block_hashes
    for block in stats.blocks:
        if block.block_hash and (block.index >= len(hashes) or hashes[block.index] != block.block_hash):
            raise InvalidPullError(f"block {block.index} from the holder belongs to another sequence (hash mismatch)")
