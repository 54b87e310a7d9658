"""A hand-over's KV pulled before its request registers: ``pull_staged`` and ``StagedKV``.

A handed-over request registers with the engine under the engine's lock, which a step holds for
as long as it runs; its pull into the reserved blocks then ends with ``finish_load``, which waits
for the next step to end, and the request joins the step after that. Pulled first into a buffer
of its own (no lock: the pull runs beside the engine's step), the KV is copied into the reserved
blocks in the same hold of the lock that registers the request (``StagedKV.fill``), and the
request joins the very next step: one step sooner.

Which blocks to stage is a guess made without the lock: the lease's blocks past the prefix this
worker's cache holds now (``LLMEngine.cached_prefix_hint``). When the cache holds less by the time
the request registers (evicted meanwhile), the buffer cannot fill the load and the request pulls
as before; when it holds more, the buffer fills the smaller load. Nothing in the engine changes
until ``fill``; a buffer that is not used is only memory, freed with the call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_handover import KVLoad
from pdserve.engine.kv_tensor import KVTensor
from pdserve.engine.request import Request
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.errors import TransferError
from pdserve.kvtransfer.wire import PullStats

logger = logging.getLogger(__name__)

# A hand-over's KV up to this size is staged; a larger one is pulled into the pool after the
# request registers (the buffer would double its memory for the length of the pull).
STAGE_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StagedKV:
    """Block ``i`` of ``kv`` holds the lease's block ``first_block + i``, whose hash is
    ``hashes[i]`` (``b""`` for a partial last block)."""

    first_block: int
    kv: KVTensor
    hashes: tuple[bytes, ...]
    stats: PullStats
    client: KVTransferClient

    def fill(self, kv_tensor: KVTensor, load: KVLoad) -> bool:
        """Write ``load``'s blocks from this buffer; False (nothing written) when the buffer does
        not hold all of them. Called under the engine's lock with the load claimed."""
        offset = load.first_block - self.first_block
        if offset < 0 or offset + len(load.block_ids) > len(self.hashes):
            return False
        if any(want and self.hashes[offset + i] != want for i, want in enumerate(load.block_hashes)):
            return False
        for i, block_id in enumerate(load.block_ids):
            kv_tensor.block_bytes(block_id).copy_(self.kv.block_bytes(offset + i))
        return True


def pull_staged(engine: LLMEngine, client: KVTransferClient, request: Request, num_tokens: int,
                lease_id: str) -> StagedKV | None:  # fmt: skip
    """Pull the blocks of ``lease_id`` (``request``'s first ``num_tokens`` tokens) past the prefix
    this worker's cache holds now into a buffer; None when there is nothing to stage, it would
    exceed ``STAGE_MAX_BYTES``, or the pull failed (the lease is untouched: the request pulls
    after registering). Takes no engine lock."""
    kv_tensor = engine.handover.kv_tensor
    bs = kv_tensor.layout.block_size
    full = num_tokens // bs
    first = engine.cached_prefix_hint(request.block_hashes[:full])
    count = -(-num_tokens // bs) - first
    if count <= 0 or count * kv_tensor.layout.block_nbytes > STAGE_MAX_BYTES:
        return None
    kv = KVTensor(kv_tensor.layout, count, device=kv_tensor.device)
    try:
        stats = client.pull_into(kv, list(range(count)), lease_id=lease_id, first_block=first)
    except TransferError as exc:
        logger.debug("staged pull of %s failed (%s); pulling after registration", request.request_id, exc)
        return None
    hashes = tuple(request.block_hashes[first + i] if first + i < full else b"" for i in range(count))
    wrong = stats.num_tokens != num_tokens - first * bs or any(
        hashes[b.block_id] and b.block_hash != hashes[b.block_id] for b in stats.blocks
    )
    if wrong:
        logger.warning("staged pull of %s: the holder sent KV of another sequence; pulling after registration",
                       request.request_id)  # fmt: skip
        return None
    return StagedKV(first, kv, hashes, stats, client)
