"""The decode worker as a Ray actor: a thin shell over WorkerRuntime + DecodeService."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from prometheus_client.metrics_core import Metric

from pdserve.decode_worker.outbox import Batch, Outboxes
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
        self.outboxes = Outboxes()

    async def ready(self) -> dict[str, object]:
        """Its registry info; in a thread, as ``metrics`` (the pool's numbers wait for a step)."""
        return await asyncio.to_thread(self.rt.info)

    async def generate(self, spec: RequestSpec, prefill: PrefillResult | None = None) -> AsyncIterator[DecodeEvent]:
        """One request's own stream of events (call with ``.options(num_returns="streaming")``);
        a router uses ``events`` and ``run`` instead, which send a step's events in one message."""
        async for event in self.service.generate(spec, prefill):
            yield event

    async def events(self, channel: str, ttl_s: float) -> AsyncIterator[Batch]:
        """Streaming: event channel ``channel``'s batches of (request id, event), an empty one first
        once it is open, until the caller cancels the stream or stops renewing it for ``ttl_s``
        (``decode_worker/outbox.py``)."""
        async for batch in self.outboxes.serve(channel, ttl_s):
            yield batch

    async def renew(self, channel: str) -> bool:
        """Keep event channel ``channel`` open another ttl; False when it is not open."""
        return self.outboxes.renew(channel)

    async def run(self, spec: RequestSpec, prefill: PrefillResult | None, channel: str) -> int:
        """Run one request, its events sent on the open channel ``channel``; returns how many it
        sent once it ends (the last is the finished one unless the request was dropped). Cancelling
        the call ends the request, as closing its stream does for ``generate``. ChannelClosedError
        when the channel is not open."""
        return await self.outboxes.send(channel, spec.request_id, self.service.generate(spec, prefill))

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
