"""PrefixLookup: the router's question to the index, "who holds how long a prefix of this chain?"."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

from pdserve.kvindex.config import REDIS_ERRORS, IndexConfig
from pdserve.kvindex.outage import OutageTracker


class PrefixLookup:
    """Router side: which workers hold how long a prefix of a block-hash chain."""

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        # A short timeout and no retry: a hung Redis must cost a request little, not 2 x 1 s.
        self._client = config.client(retries=0, timeout_s=config.lookup_timeout_s)
        self._outage = OutageTracker("prefix-lookup")
        self._retry_at = 0.0
        self._delay = config.retry_initial_s
        self._probe = threading.Lock()  # during an outage one lookup probes, the others skip Redis

    @property
    def outages(self) -> int:
        return self._outage.outages

    def longest_prefix(self, block_hashes: Sequence[bytes], worker_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Worker id -> number of leading blocks of ``block_hashes`` it holds, in one round trip.

        Without ``worker_ids`` only workers holding at least block 0 appear; with them, exactly those
        workers appear (0 when they hold nothing). Returns ``{}`` when Redis is unreachable (logged
        once per outage; during backoff Redis is not even tried, and while one lookup probes whether
        it is back the others do not wait for it), so the caller routes by load. A lookup costs at
        most ``lookup_timeout_s`` of waiting on Redis.
        """
        wanted = set(worker_ids) if worker_ids is not None else None
        result = dict.fromkeys(wanted, 0) if wanted is not None else {}
        if not block_hashes:
            return result
        probing = False
        if self._outage.down:
            if time.monotonic() < self._retry_at or not self._probe.acquire(blocking=False):
                return {}
            probing = True
        try:
            pipe = self._client.pipeline(transaction=False)
            for h in block_hashes:
                pipe.hkeys(self.config.block_key(h))
            rows = pipe.execute()
        except REDIS_ERRORS as exc:
            self._outage.failed(exc)
            self._retry_at = time.monotonic() + self._delay
            self._delay = min(self._delay * 2, self.config.retry_max_s)
            return {}
        finally:
            if probing:
                self._probe.release()
        self._outage.ok()
        self._delay = self.config.retry_initial_s
        alive = set(rows[0]) if wanted is None else set(rows[0]) & wanted
        for depth, row in enumerate(rows, 1):
            if depth > 1:
                alive &= set(row)
            if not alive:
                break
            for w in alive:
                result[w] = depth
        return result

    def close(self) -> None:
        self._client.close()
