"""WorkerMetrics: a worker's engine gauges, prefix-cache counters and KV-transfer metrics.

The engine's numbers are read at scrape time (``LLMEngine.stats``), so the serving path does no
metrics work for them; the transfer metrics are recorded by the pulls (bytes, blocks and durations
per ``transport``: ``grpc``, ``shm`` or ``nixl``; blocks prefetched while their prompt was still
being prefilled also count on their own). Every series carries the ``worker`` label. The router
gathers these families from every worker for its ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.engine.engine import EngineStats
from pdserve.metrics import TRANSFER_BUCKETS, redis_outages

TRANSPORTS = ("grpc", "shm", "nixl")  # what can carry a pull's bytes (PullStats.transport)


class _EngineCollector:
    def __init__(self, worker_id: str, role: str, stats: Callable[[], EngineStats]) -> None:
        self.worker_id, self.role, self.stats = worker_id, role, stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        labels, values = ["worker", "role"], [self.worker_id, self.role]

        def gauge(name: str, doc: str, value: float) -> Metric:
            fam = GaugeMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        def counter(name: str, doc: str, value: float) -> Metric:
            fam = CounterMetricFamily(name, doc, labels=labels)
            fam.add_metric(values, value)
            return fam

        yield gauge("pdserve_kv_cache_usage_ratio", "Share of the KV blocks in use (1 = full).", s.kv_usage)
        yield gauge("pdserve_kv_cache_blocks", "KV blocks in the worker's pool.", s.num_blocks)
        yield gauge("pdserve_num_requests_running", "Requests in the worker's running batch.", s.running)
        yield gauge("pdserve_num_requests_waiting", "Requests waiting for the worker's batch.", s.waiting)
        yield counter("pdserve_num_preemptions", "Requests preempted (blocks freed, recomputed later).",
                      s.num_preemptions)  # fmt: skip
        yield counter("pdserve_prefix_cache_queries", "Prompt tokens looked up in the worker's prefix cache.",
                      s.prefix_cache_queries)  # fmt: skip
        yield counter("pdserve_prefix_cache_hits", "Prompt tokens found in the worker's prefix cache.",
                      s.prefix_cache_hits)  # fmt: skip
        if s.offload_blocks:
            yield gauge("pdserve_kv_offload_usage_ratio", "Share of the offload tier's blocks in use.",
                        s.offload_used_blocks / s.offload_blocks)  # fmt: skip
            yield counter("pdserve_kv_offload_hit_tokens", "Prompt tokens restored from the offload tier.",
                          s.offload_hit_tokens)  # fmt: skip
            yield counter("pdserve_kv_offload_stored_blocks", "Blocks the pool evicted into the offload tier.",
                          s.offload_stored_blocks)  # fmt: skip
            yield counter("pdserve_kv_offload_corrupted_blocks", "Offload-tier blocks whose bytes changed "
                          "(dropped, the prompt computed instead).", s.offload_corrupted_blocks)  # fmt: skip
        if s.offload_disk_blocks:
            yield gauge("pdserve_kv_offload_disk_usage_ratio", "Share of the disk tier's blocks in use.",
                        s.offload_disk_used_blocks / s.offload_disk_blocks)  # fmt: skip


class WorkerMetrics:
    """``outages`` gives (client name, lifetime outages) of the worker's Redis clients at scrape time."""

    def __init__(self, worker_id: str, role: str, stats: Callable[[], EngineStats],
                 outages: Callable[[], Iterable[tuple[str, int]]] = lambda: ()) -> None:  # fmt: skip
        self.worker_id = worker_id
        self._outages = outages
        self.registry = r = CollectorRegistry(auto_describe=True)
        r.register(_EngineCollector(worker_id, role, stats))  # type: ignore[arg-type]
        by_transport = ["worker", "transport"]
        bytes_ = Counter("pdserve_kv_transfer_bytes", "KV bytes pulled from other workers.", by_transport, registry=r)
        blocks = Counter("pdserve_kv_transfer_blocks", "KV blocks pulled from other workers.", by_transport, registry=r)
        seconds = Histogram("pdserve_kv_transfer_seconds", "Duration of one request's KV pull.", by_transport,
                            buckets=TRANSFER_BUCKETS, registry=r)  # fmt: skip
        # One series per transport from the start: a rate over a series that appears late misses its first pulls.
        self._transfers = {
            t: tuple(m.labels(worker=worker_id, transport=t) for m in (bytes_, blocks, seconds)) for t in TRANSPORTS
        }
        self._failures = Counter("pdserve_kv_transfer_failures", "KV pulls that failed (the prompt was recomputed).",
                                 ["worker"], registry=r).labels(worker=worker_id)  # fmt: skip
        self._prefetched = Counter("pdserve_kv_prefetch_blocks", "KV blocks pulled while their prompt was still "
                                   "being prefilled (decode_worker/prefetch.py).", ["worker"],
                                   registry=r).labels(worker=worker_id)  # fmt: skip

    def transfer_done(self, num_bytes: int, num_blocks: int, seconds: float, transport: str = "grpc") -> None:
        """One pull that landed; ``transport`` carried its bytes (``PullStats.transport``)."""
        bytes_, blocks, hist = self._transfers[transport]
        bytes_.inc(num_bytes)
        blocks.inc(num_blocks)
        hist.observe(max(seconds, 0.0))

    def prefetched(self, num_bytes: int, num_blocks: int, transport: str) -> None:
        """One prefetch round that landed: counted with the transfers' bytes and blocks, not in the
        per-request pull durations (a round includes the holder's wait for the next block)."""
        bytes_, blocks, _ = self._transfers[transport]
        bytes_.inc(num_bytes)
        blocks.inc(num_blocks)
        self._prefetched.inc(num_blocks)

    def transfer_failed(self) -> None:
        self._failures.inc()

    def families(self) -> list[Metric]:
        return [*self.registry.collect(), redis_outages(self.worker_id, self._outages())]
