"""Prometheus metrics: what every process shares (buckets, merging, exposition).

Each process keeps its metrics in a ``CollectorRegistry`` of its own (no global registry): the
router its request metrics (``pdserve.router.metrics``), each worker its engine and transfer
metrics (``pdserve.worker.metrics``). At scrape time the router asks every worker for its
families over Ray and ``merge_families`` joins them with its own, so one scrape of the router's
``/metrics`` shows the whole cluster, on one node or many. Worker series carry a ``worker``
label, so families from different processes never repeat a series.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric

__all__ = [
    "CONTENT_TYPE_LATEST",
    "E2E_BUCKETS",
    "ITL_BUCKETS",
    "TOKEN_BUCKETS",
    "TRANSFER_BUCKETS",
    "TTFT_BUCKETS",
    "Families",
    "merge_families",
    "redis_outages",
    "render",
]

# vLLM's buckets for the same quantities, so dashboards built for one read the other alike.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip
TRANSFER_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
TOKEN_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Families:
    """Metric families as a collector: ``generate_latest`` renders anything with ``collect()``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


def merge_families(groups: Iterable[Sequence[Metric]]) -> list[Metric]:
    """Join the families of several processes: same-named families become one, with the samples
    of all (the first group's help text and type win). ValueError when two processes give one
    name different types: that is a bug, and an exposition with it would be refused by Prometheus.
    """
    merged: dict[str, Metric] = {}
    for group in groups:
        for fam in group:
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            elif into.type != fam.type:
                raise ValueError(f"metric {fam.name} is a {into.type} in one process and a {fam.type} in another")
            into.samples.extend(fam.samples)
    return list(merged.values())


def render(families: Iterable[Metric]) -> bytes:
    """The Prometheus text exposition of ``families``."""
    return generate_latest(Families(families))  # type: ignore[arg-type]


def redis_outages(process: str, clients: Iterable[tuple[str, int]]) -> Metric:
    """``pdserve_redis_outages_total``: for each Redis client of ``process`` (name, lifetime
    outages), how many times it lost Redis. Built at scrape time from the clients' own counts."""
    fam = CounterMetricFamily("pdserve_redis_outages", "Times a Redis client of a process lost Redis "
                              "(serving went on without the index).", labels=["process", "client"])  # fmt: skip
    for client, n in clients:
        fam.add_metric([process, client], n)
    return fam
