"""WorkerRuntime: what a prefill or decode worker is made of, wired together.

An engine whose BlockPool publishes to the Redis index, a thread stepping it, a KV-transfer
server over its KV-handover API (leases and pull-by-hash), the worker registry heartbeat, and
stats counters. Both Ray actors are thin shells over this class and a service, which are plain
Python and testable without Ray.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from pdserve.engine.cpu_threads import on_passing_thread, set_torch_threads, torch_threads
from pdserve.engine.engine import LLMEngine
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.kernels import stream_copy
from pdserve.kvindex.config import REDIS_ERRORS, IndexConfig
from pdserve.kvindex.publisher import KVEventPublisher, remove_worker_blocks
from pdserve.kvindex.registry import WorkerRegistry
from pdserve.kvindex.stats import StatsRecorder
from pdserve.kvtransfer.allocator import HeapTrimmer, tune_malloc
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.server import TransferServer, start_transfer_server
from pdserve.kvtransfer.source import BlockSource
from pdserve.worker.config import WorkerConfig
from pdserve.worker.core_share import CoreShare, start_core_share
from pdserve.worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - fall back to the OS
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _forget_blocks(index: IndexConfig, worker_id: str) -> None:
    """Drop every block-holder field naming ``worker_id``: at start (a previous incarnation's
    pool is gone) and at a clean stop (this one's is about to be)."""
    try:
        removed = remove_worker_blocks(index.client(), index, worker_id)
    except REDIS_ERRORS as exc:  # Redis is an index: start anyway, the publisher resyncs later
        logger.warning("could not clear the block holders of %s: %s", worker_id, exc)
        return
    if removed:
        logger.info("cleared %d block holder fields of %s", removed, worker_id)


def _bind_transfer_server(source: BlockSource, config: WorkerConfig) -> TransferServer:
    """The transfer server on the first free port of ``transfer.port_range`` (any port without one)."""
    ports = config.transfer.ports()
    for port in ports:
        try:
            return start_transfer_server(source, config.transfer, host=config.bind_host, port=port)
        except OSError:
            if port == ports[-1]:
                raise OSError(f"no free KV-transfer port in {config.transfer.port_range} on {config.bind_host} "
                              "(one per worker on this node)") from None  # fmt: skip
    raise AssertionError("unreachable")


def _end_process(why: str) -> None:
    """A tensor-parallel rank of this worker is gone: the worker cannot step again. End the whole
    process (its other ranks follow: their input closes), so that Ray restarts the worker and the
    router, meanwhile, sends nothing to it."""
    logger.critical("%s: ending this worker so that it restarts whole", why)
    logging.shutdown()
    os._exit(70)


class WorkerRuntime:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        tune_malloc()  # chunk buffers of the KV wire stay resident (kvtransfer/allocator.py)
        stream_copy.available()  # built (once per machine) before the first pull needs it
        _forget_blocks(config.index, config.worker_id)
        self.publisher = KVEventPublisher(config.index, config.worker_id)
        self.stats = StatsRecorder(config.index, config.worker_id)
        # Built on a passing thread: the engine loop's is then the process's one torch thread team.
        self.engine = on_passing_thread(
            lambda: LLMEngine(config.engine, event_sink=self.publisher, on_rank_lost=_end_process), "engine-build")
        self._clients: dict[str, KVTransferClient] = {}
        self._clients_lock = threading.Lock()  # pulls run in several threads
        self.trimmer = HeapTrimmer()
        self.cores = self._core_share()
        self.loop = EngineLoop(self.engine, on_idle=self.trimmer.maybe_trim, cpu_share=self.cores)
        self.metrics = WorkerMetrics(config.worker_id, config.role, self.engine.stats, self._redis_outages)
        self.source = BlockSource(
            self.engine.handover,
            model_fingerprint=self.engine.model_config.fingerprint,
            worker_id=config.worker_id,
            config=config.transfer,
        )
        try:
            self.server = _bind_transfer_server(self.source, config)
        except BaseException:
            self.loop.stop()
            self._close_core_share()
            self.publisher.close()
            self.stats.close()
            raise
        host = config.advertise_host or ("127.0.0.1" if config.bind_host in ("127.0.0.1", "localhost") else _node_ip())
        self.address = f"{host}:{self.server.port}"
        self._trim_stop = threading.Event()
        threading.Thread(target=self._trim_loop, name="region-trim", daemon=True).start()
        self.registry = WorkerRegistry(config.index)
        self.registry.start_heartbeat(config.worker_id, self.info, config.heartbeat_s)
        shm = self.server.shm  # same-host pulls: a Unix socket in a private directory, removed at close
        logger.info("%s worker %s ready, KV transfer at %s%s, torch on %d CPU thread(s)%s", config.role,
                    config.worker_id, self.address, f" (same host: {shm.socket_path})" if shm is not None else "",
                    torch_threads(), "" if self.cores is None else
                    f", and on the idle ones of this host's other workers (up to {self.cores.max_cpus})")  # fmt: skip

    def _core_share(self) -> CoreShare | None:
        """This worker's place among the host's CPU workers, when it lends and borrows idle CPUs."""
        c = self.config
        if not c.share_idle_cpus or self.engine.device.type != "cpu" or c.engine.parallel.tensor_parallel_size > 1:
            return None
        return start_core_share(torch_threads(), set_torch_threads, reclaim_wait_s=c.core_reclaim_wait_s)

    def _close_core_share(self) -> None:
        if self.cores is not None:
            self.cores.close()

    def _redis_outages(self) -> list[tuple[str, int]]:
        clients = [("events", self.publisher), ("stats", self.stats), ("registry", getattr(self, "registry", None))]
        return [(name, c.outages) for name, c in clients if c is not None]

    def info(self) -> dict[str, object]:
        usage = self.engine.kv_usage()
        return {
            "role": self.config.role,
            "grpc_address": self.address,
            "model_fingerprint": self.engine.model_config.fingerprint,
            "block_size": self.engine.layout.block_size,
            "num_blocks": usage.num_blocks,
            "free_blocks": usage.free_blocks,
        }

    def pool_state(self) -> dict[str, int]:
        """Free blocks, leases, requests holding blocks and requests registered with the engine
        loop (idle: free == total, 0, 0, 0); and, since the worker started, how many leases it
        created and how many of them were released before any pull of them began (requests given
        up on, or recomputed)."""
        usage = self.engine.kv_usage()
        return {
            "free_blocks": usage.free_blocks,
            "num_blocks": usage.num_blocks,
            "leases": len(self.source.leases),
            "leases_created": self.source.leases.created,
            "leases_released_unpulled": self.source.leases.released_unpulled,
            "requests": usage.requests,
            "registered": self.loop.num_registered,
        }

    def trim_regions(self) -> int:
        """End every peer client's staging regions unused for ``transfer.shm_region_idle_s``; how
        many. The ``region-trim`` thread calls it every half of that time (at most 10 s apart)."""
        with self._clients_lock:
            clients = list(self._clients.values())
        return sum(c.shm.trim() + c.nixl.trim() for c in clients)

    def _trim_loop(self) -> None:
        interval = min(self.config.transfer.shm_region_idle_s / 2, 10.0)
        while not self._trim_stop.wait(interval):
            try:
                self.trim_regions()
            except Exception:  # noqa: BLE001 - the next round tries again; a trim never ends the worker
                logger.exception("ending idle staging regions failed")

    def client(self, address: str) -> KVTransferClient:
        """A cached transfer client for a peer, checked once for a compatible KV layout.

        The check is a network call, made outside the lock so one slow peer does not hold up
        pulls from the others.
        """
        with self._clients_lock:
            c = self._clients.get(address)
        if c is not None:
            return c
        c = KVTransferClient(address, self.config.transfer, caller=self.config.worker_id)
        try:
            c.check_compatible(self.engine.layout, self.engine.model_config.fingerprint)
        except BaseException:
            c.close()
            raise
        with self._clients_lock:
            kept = self._clients.setdefault(address, c)
        if kept is not c:
            c.close()  # another thread connected first; this client has no users
        return kept

    def drop_client(self, address: str, client: KVTransferClient | None = None) -> None:
        """Forget a peer's client (it looked gone). Only the client that failed is forgotten, and
        it is not closed: other pulls may still stream on its channel (closing it would cancel
        them); the channel closes when the last user lets go of it."""
        with self._clients_lock:
            if client is None or self._clients.get(address) is client:
                self._clients.pop(address, None)

    def release_lease(self, address: str, lease_id: str) -> bool:
        """End a lease on a peer without a layout check (it may be the reason no pull happens)."""
        with self._clients_lock:
            c = self._clients.get(address)
        if c is not None:
            return c.release(lease_id)
        with KVTransferClient(address, self.config.transfer, caller=self.config.worker_id) as tmp:
            return tmp.release(lease_id)

    def close(self) -> None:
        """Stop serving and leave nothing of this worker in Redis (registry entry, holder fields)."""
        self.registry.unregister(self.config.worker_id)
        self.registry.close()
        self._trim_stop.set()
        self.loop.stop()
        self._close_core_share()  # after the loop's last step
        self.server.stop()
        self.engine.close()
        with self._clients_lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        self.publisher.close()  # flushes queued writes first, so no holder field lands after the purge
        self.stats.close()
        _forget_blocks(self.config.index, self.config.worker_id)
