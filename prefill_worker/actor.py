"""The prefill worker as a Ray actor: a thin shell over WorkerRuntime + PrefillService."""

from __future__ import annotations

import asyncio

from prometheus_client.metrics_core import Metric

from pdserve.logs import configure_text_logging
from pdserve.prefill_worker.service import PrefillService
from pdserve.worker.config import WorkerConfig
from pdserve.worker.messages import PrefillResult, RequestSpec
from pdserve.worker.runtime import WorkerRuntime


class PrefillWorker:
    def __init__(self, config: WorkerConfig, log_level: str | None = None) -> None:
        """``log_level``: this process logs compact TEXT lines at that level (pdserve/logs.py);
        None leaves its logging as it is."""
        if log_level is not None:
            configure_text_logging(log_level)
        self.rt = WorkerRuntime(config)
        self.service = PrefillService(self.rt)

    async def ready(self) -> dict[str, object]:
        """Its registry info; in a thread, as ``metrics`` (the pool's numbers wait for a step)."""
        return await asyncio.to_thread(self.rt.info)

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        return await self.service.prefill(spec)

    async def drop(self, request_id: str) -> bool:
        """End ``request_id``'s prefill, running or not yet begun (``PrefillService.drop``)."""
        return self.service.drop(request_id)

    async def release(self, lease_id: str) -> bool:
        # Freeing takes the engine lock: not on the event loop that serves the prefills.
        return await asyncio.to_thread(self.rt.source.release, lease_id)

    async def release_request(self, request_id: str) -> bool:
        """The router gave up on ``request_id``: free what this worker holds for it."""
        return await asyncio.to_thread(self.rt.source.release_request, request_id)

    async def metrics(self) -> list[Metric]:
        """This worker's Prometheus metric families (the router merges every worker's). Read in a
        thread: the engine's numbers wait for its lock, which a step holds, and the event loop
        serving this worker's streams must not."""
        return await asyncio.to_thread(self.rt.metrics.families)

    async def pool_state(self) -> dict[str, int]:
        return await asyncio.to_thread(self.rt.pool_state)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.service.close)
        self.rt.close()
