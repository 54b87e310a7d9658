"""Prefetches: a prompt's blocks pulled by hash from its prefill worker while that worker still prefills it.

The router asks for one beside the prefill (``DecodeService.prefetch``) when the prompt is long. A
prefill engine caches a prompt's full blocks chunk by chunk as its steps compute them, so while later
chunks compute, the decode worker can already take the earlier ones: each round pulls the longest prefix
the prefill worker has cached of the prompt's full blocks that this pool lacks (the holder waits up to
``prefix_wait_s`` for the next one), into blocks of its own (``KVHandover.begin_prefetch``), and caches
what landed (``end_prefetch``, which returns every block, on every path). It goes on until every full
block is here, the request itself arrives (``stop``: its own lease pull takes over), the router gives
the request up (``stop`` through ``DecodeService.drop``), nothing new came for ``idle_s``, a pull fails,
or the worker closes. The request's ``add_remote`` then finds those blocks
as its own cached prefix and its lease pull skips them (``first_block``): once the prefill ends, only
the blocks of its last chunk still cross.

The granularity is the engine's step (a chunk of ``max_num_batched_tokens``): blocks are whole, cached
when the step that wrote them ends, and pulled with the checks of any pull by hash. Layer by layer would
start earlier within a step but needs the transfer inside the forward; a step is what this engine
exposes without touching the model.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor

from pdserve.engine.kvcache.hashing import block_hashes
from pdserve.kvtransfer.errors import BlockNotFoundError, TransferError
from pdserve.worker.messages import RequestSpec
from pdserve.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

MAX_BLOCKS_PER_PULL = 256  # one round's pull; later rounds take the rest
PREFIX_WAIT_S = 0.5  # how long a holder waits for the next block of a prompt it is prefilling
IDLE_S = 5.0  # a prefetch that got nothing new this long ends (the prefill failed, or is queued long)


class Prefetches:
    """The prefetches of one decode worker, each on a thread of ``executor``; at most ``max_running``
    at once (beyond, ``start`` declines: a prefetch only saves time, it is never owed). Thread-safe."""

    def __init__(self, rt: WorkerRuntime, executor: Executor, max_running: int) -> None:
        self.rt = rt
        self._executor = executor
        self._lock = threading.Lock()
        self._stops: dict[str, threading.Event] = {}
        self._max_running = max_running
        self._closed = False

    def start(self, spec: RequestSpec, address: str) -> bool:
        """Prefetch ``spec``'s prompt from the prefill worker at ``address``; False when declined (one
        runs for this request already, too many run, the worker is closing)."""
        with self._lock:
            if self._closed or spec.request_id in self._stops or len(self._stops) >= self._max_running:
                return False
            stop = self._stops[spec.request_id] = threading.Event()
        try:
            self._executor.submit(self._run, spec, address, stop)
        except RuntimeError:  # the executor shut down meanwhile
            self._forget(spec.request_id, stop)
            return False
        return True

    def stop(self, request_id: str) -> None:
        """The request arrived (or ended): its prefetch ends after the round in progress, if any."""
        with self._lock:
            stop = self._stops.get(request_id)
        if stop is not None:
            stop.set()

    def running(self) -> int:
        with self._lock:
            return len(self._stops)

    def close(self) -> None:
        """End every prefetch after its round; later ``start`` calls decline."""
        with self._lock:
            self._closed = True
            stops = list(self._stops.values())
        for stop in stops:
            stop.set()

    def _forget(self, request_id: str, stop: threading.Event) -> None:
        with self._lock:
            if self._stops.get(request_id) is stop:
                del self._stops[request_id]

    def _run(self, spec: RequestSpec, address: str, stop: threading.Event) -> None:
        try:
            landed = self._rounds(spec, address, stop)
            if landed:
                logger.debug("prefetched %d blocks of %s from %s", landed, spec.request_id, address)
        except Exception:  # a prefetch only saves time: its failure is not the request's
            logger.exception("prefetch of %s from %s failed", spec.request_id, address)
        finally:
            self._forget(spec.request_id, stop)

    def _rounds(self, spec: RequestSpec, address: str, stop: threading.Event) -> int:
        """Pull rounds until done (module docstring); how many blocks landed."""
        rt = self.rt
        handover = rt.engine.handover
        cache = rt.config.engine.cache
        hashes = block_hashes(spec.prompt_token_ids, handover.block_size, cache.hash_seed, spec.cache_salt)
        client = rt.client(address)
        landed, last_progress = 0, time.monotonic()
        while not stop.is_set() and time.monotonic() - last_progress < IDLE_S:
            prefetch = handover.begin_prefetch(hashes, MAX_BLOCKS_PER_PULL)
            if prefetch is None:
                break  # every full block is here, or the pool has no free block
            written = 0
            try:
                stats = client.pull_into(handover.kv_tensor, prefetch.block_ids, block_hashes=prefetch.block_hashes,
                                         prefix_wait_s=PREFIX_WAIT_S)  # fmt: skip
                written = stats.num_blocks
                rt.metrics.prefetched(stats.num_bytes, stats.num_blocks, stats.transport)
            except BlockNotFoundError:
                pass  # the next block is not computed yet: ask again
            except TransferError as exc:
                logger.debug("prefetch of %s from %s ended: %s", spec.request_id, address, exc)
                break
            finally:
                handover.end_prefetch(prefetch, written)
            if written:
                landed, last_progress = landed + written, time.monotonic()
        return landed
