"""The decode worker as a Ray actor: a thin shell over WorkerRuntime + DecodeService."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from prometheus_client.metrics_core import Metric

from pdserve.decode_worker.service import DecodeService
from pdserve.logs import configure_text_logging
from pdserve.worker.config import WorkerConfig
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from pdserve.worker.runtime import WorkerRuntime


class DecodeWorker:
    def __init__(self, config: WorkerConfig, log_level: str | None = None) -> None:
        """``log_level``: this process logs compact TEXT lines at that level (pdserve/logs.py);
        None leaves its logging as it is."""
        if log_level is not None:
            configure_text_logging(log_level)
        self.rt = WorkerRuntime(config)
        self.service = DecodeService(self.rt)

    async def ready(self) -> dict[str, object]:
        """Its registry info; in a thread, as ``metrics`` (the pool's numbers wait for a step)."""
        return await asyncio.to_thread(self.rt.info)

    async def generate(self, spec: RequestSpec, prefill: PrefillResult | None = None) -> AsyncIterator[DecodeEvent]:
        """Streaming (call with ``.options(num_returns="streaming")``)."""
        async for event in self.service.generate(spec, prefill):
            yield event

    async def drop(self, request_id: str) -> bool:
        """End ``request_id``'s stream, running or not yet begun (``DecodeService.drop``)."""
        return self.service.drop(request_id)

    async def prefetch(self, spec: RequestSpec, address: str) -> bool:
        """Pull ``spec``'s prompt blocks from the prefill worker at ``address`` while it prefills them."""
        return self.service.prefetch(spec, address)

    async def metrics(self) -> list[Metric]:
        """This worker's Prometheus metric families (the router merges every worker's). Read in a
        thread: the engine's numbers wait for its lock, which a step holds, and the event loop
        serving this worker's streams must not."""
        return await asyncio.to_thread(self.rt.metrics.families)

    async def pool_state(self) -> dict[str, int]:
        return await asyncio.to_thread(self.rt.pool_state)

    async def shutdown(self) -> None:
        self.service.close()
        self.rt.close()
