"""pull_kv: fill a ``KVLoad`` (blocks an engine reserved for KV computed elsewhere) from a holder.

The engine side stays with the caller: it got the ``KVLoad`` from ``LLMEngine.add_remote``
(or ``KVHandover.reserve``) and ends it with ``finish_load`` (or ``KVHandover.complete``),
``ok`` when this returned. Here only bytes move: by lease (the holder's handed-off blocks
from ``load.first_block`` on) or by block hash (full blocks of its prefix cache), straight
into the reserved blocks of the local KV tensor, each checked against its checksum, and the
blocks that arrive are checked to be this request's (token count and block hashes).
"""

from __future__ import annotations

import logging

from pdserve.engine.kv_handover import KVLoad
from pdserve.engine.kv_tensor import KVTensor
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.errors import InvalidPullError, TransferError
from pdserve.kvtransfer.wire import PullStats

logger = logging.getLogger(__name__)


def pull_kv(
    client: KVTransferClient,
    kv_tensor: KVTensor,
    load: KVLoad,
    *,
    lease_id: str | None = None,
    timeout_s: float | None = None,
) -> PullStats:
    """Write the external blocks of ``load`` into ``kv_tensor`` from ``client``'s holder.

    With ``lease_id`` the lease must cover exactly ``load.num_tokens`` tokens of the same
    request (its partial last block included). Without it every block is pulled by the
    hash ``load.block_hashes`` expects, so all must be full. Returns the stats (empty when the
    load needs no block); raises a ``TransferError`` on any failure, the blocks then partly
    written (the caller's ``finish_load(ok=False)`` frees them).
    """
    if not load.block_ids:
        return PullStats()
    if lease_id is not None:
        stats = client.pull_into(kv_tensor, load.block_ids, lease_id=lease_id, first_block=load.first_block,
                                 timeout_s=timeout_s)  # fmt: skip
    else:
        if not all(load.block_hashes):
            raise InvalidPullError("a pull by hash needs whole hashed blocks; this load ends in a partial one")
        stats = client.pull_into(kv_tensor, load.block_ids, block_hashes=load.block_hashes, timeout_s=timeout_s)
    _check_pulled(load, stats)
    return stats


def release_quietly(client: KVTransferClient, lease_id: str) -> None:
    """Release a lease whose KV is here now; a failure only means it expires on its own."""
    try:
        client.release(lease_id)
    except (TransferError, ValueError) as exc:  # ValueError: the channel was closed meanwhile
        logger.warning("releasing lease %s on %s failed: %s", lease_id, client.address, exc)


def _check_pulled(load: KVLoad, stats: PullStats) -> None:
    """The blocks are this request's: same token count, and every hash is the one expected."""
    if stats.num_tokens != load.num_external_tokens:
        raise InvalidPullError(f"holder sent {stats.num_tokens} tokens of KV, {load.num_external_tokens} were expected")
    expected = dict(zip(load.block_ids, load.block_hashes))
    for block in stats.blocks:
        want = expected[block.block_id]
        if want and block.block_hash != want:
            raise InvalidPullError(f"block {block.index} from the holder belongs to another sequence (hash mismatch)")
