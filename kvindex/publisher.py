"""KVEventPublisher: a worker's BlockPool events into the Redis block index.

What it writes (docs/redis.md; ``{ns}`` is ``IndexConfig.namespace``):

- ``{ns}:block:<32 hex>`` hash: worker id -> unix ms when that worker stored the block (in its
  pool or its offload tier: the field goes when the last of them evicts it).
- ``{ns}:events`` stream, capped with ``MAXLEN ~ events_maxlen`` (approximate: Redis trims whole
  stream nodes, so the length may exceed the cap by up to one node, 100 entries by default).
  Every entry has ``type`` (``BlockStored``/``BlockRemoved``/``AllBlocksCleared``), ``worker``,
  ``medium`` (``GPU``/``CPU``: the pool; ``CPU_TIER``/``DISK_TIER``: the offload tiers) and ``ts_ms``. BlockStored adds ``block_hashes`` (JSON list of 32-hex strings),
  ``parent_block_hash`` (32 hex, ``""`` for a chain root), ``block_size``, ``lora_name`` (``""``
  if none) and, only with ``IndexConfig.events_include_token_ids``, ``token_ids`` (JSON list:
  they are the tenants' prompts); BlockRemoved adds ``block_hashes``.
- ``blocks_stored`` / ``blocks_evicted`` on the cluster and worker stats hashes.

Redis is an index, not the source of truth: calling the publisher never blocks or raises (a
background thread writes), an outage is logged once and counted, and everything the worker
holds is republished when Redis returns.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Mapping

import redis

from pdserve.engine.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pdserve.kvindex.config import IndexConfig, now_ms
from pdserve.kvindex.writer import BackgroundWriter

log = logging.getLogger(__name__)


class KVEventPublisher(BackgroundWriter):
    """Event sink of one worker's BlockPool: ``pool.add_event_sink(publisher)``.

    Calling it never blocks on I/O and never raises. It tracks the hashes the worker holds (as the
    events say) so that after an outage it can rebuild its holder fields: HSET every held hash,
    HDEL every hash whose removal was lost. Also bumps ``blocks_stored``/``blocks_evicted`` on the
    cluster and worker stats. Attach it before the pool emits its first event.
    """

    def __init__(self, config: IndexConfig, worker_id: str) -> None:
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        self.worker_id = worker_id
        self._held: dict[bytes, int] = {}  # hash -> unix ms stored
        # hash -> the media holding a copy (the pool's, an offload tier's): the holder field goes
        # when the last one lets go.
        self._media: dict[bytes, set[str]] = {}
        self._lost_removals: set[bytes] = set()
        self._lost_counters: Counter[str] = Counter()
        super().__init__(config, f"kv-publisher[{worker_id}]")

    @property
    def held_hashes(self) -> set[bytes]:
        with self._cv:
            return set(self._held)

    def __call__(self, event: KVCacheEvent) -> None:
        try:
            ms = now_ms()
            with self._cv:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        self._held[h] = ms
                        self._media.setdefault(h, set()).add(event.medium)
                    self._enqueue((event, ms, ()))
                elif isinstance(event, BlockRemoved):
                    # HDEL only the hashes whose last copy went (decided now: the writer thread
                    # cannot know later).
                    gone = tuple(h for h in event.block_hashes if self._let_go(h, event.medium))
                    self._enqueue((event, ms, gone))
                elif isinstance(event, AllBlocksCleared):
                    cleared = tuple(h for h in list(self._media) if self._let_go(h, event.medium))
                    self._enqueue((event, ms, cleared))
        except Exception:  # noqa: BLE001 - a sink must never break the pool
            log.exception("%s: event dropped", self.name)

    def _let_go(self, block_hash: bytes, medium: str) -> bool:
        """``medium`` dropped its copy; True when that was the worker's last one. Caller holds ``_cv``."""
        media = self._media.get(block_hash)
        if media is None:
            return False
        media.discard(medium)
        if media:
            return False
        del self._media[block_hash]
        self._held.pop(block_hash, None)
        return True

    def _write(self, pipe: redis.client.Pipeline, batch: list) -> None:
        cfg, wid = self.config, self.worker_id
        stored = evicted = 0
        for event, ms, cleared in batch:
            fields: dict[str, str | int] = {"type": type(event).__name__, "worker": wid, "medium": event.medium,
                                            "ts_ms": ms}  # fmt: skip
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    pipe.hset(cfg.block_key(h), wid, ms)
                stored += len(event.block_hashes)
                parent = event.parent_block_hash
                fields.update(
                    block_hashes=json.dumps([h.hex() for h in event.block_hashes]),
                    parent_block_hash=parent.hex() if parent is not None else "",
                    block_size=event.block_size,
                    lora_name=event.lora_name or "",
                )
                if cfg.events_include_token_ids:  # the tenants' prompts: only when the operator opts in
                    fields["token_ids"] = json.dumps(list(event.token_ids))
            elif isinstance(event, BlockRemoved):
                for h in cleared:  # the hashes that lost their last copy
                    pipe.hdel(cfg.block_key(h), wid)
                evicted += len(event.block_hashes)
                fields["block_hashes"] = json.dumps([h.hex() for h in event.block_hashes])
            else:
                for h in cleared:
                    pipe.hdel(cfg.block_key(h), wid)
            pipe.xadd(cfg.events_key, fields, maxlen=cfg.events_maxlen, approximate=True)
        self._incr_counters(pipe, {"blocks_stored": stored, "blocks_evicted": evicted})

    def _incr_counters(self, pipe: redis.client.Pipeline, counters: Mapping[str, int]) -> None:
        for key in (self.config.stats_key, self.config.worker_stats_key(self.worker_id)):
            for name, n in counters.items():
                if n:
                    pipe.hincrby(key, name, n)

    def _dropped(self, batch: list) -> None:
        for event, _ms, cleared in batch:
            if isinstance(event, BlockStored):
                self._lost_counters["blocks_stored"] += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._lost_removals.update(cleared)
                self._lost_counters["blocks_evicted"] += len(event.block_hashes)
            else:
                self._lost_removals.update(cleared)

    def _resync(self, client: redis.Redis) -> None:
        with self._cv:
            held = dict(self._held)
            removals = self._lost_removals - held.keys()
            counters = dict(self._lost_counters)
            self._lost_removals = set()
            self._lost_counters = Counter()
        try:
            pipe = client.pipeline(transaction=False)
            for h in removals:
                pipe.hdel(self.config.block_key(h), self.worker_id)
            for h, ms in held.items():
                pipe.hset(self.config.block_key(h), self.worker_id, ms)
            self._incr_counters(pipe, counters)
            pipe.execute()
        except BaseException:
            with self._cv:  # not written: keep it for the next attempt
                self._lost_removals |= removals
                self._lost_counters.update(counters)
            raise
        log.info("%s: republished %d held blocks (%d lost removals)", self.name, len(held), len(removals))


def remove_worker_blocks(client: redis.Redis, index: IndexConfig, worker_id: str) -> int:
    """HDEL ``worker_id`` from every block key (a worker restarting or gone); returns fields removed.

    A SCAN over all block keys: for worker start-up or clean-up, not the serving path.
    """
    removed = 0
    pipe = client.pipeline(transaction=False)
    for i, key in enumerate(client.scan_iter(match=index.block_key_pattern, count=1000), 1):
        pipe.hdel(key, worker_id)
        if i % 1000 == 0:
            removed += sum(pipe.execute())
    removed += sum(pipe.execute())
    return removed
