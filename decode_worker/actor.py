"""The decode worker as a Ray actor: a thin shell over WorkerRuntime + DecodeService."""

from __future__ import annotations

from collections.abc import AsyncIterator

from decode_worker.service import DecodeService
from kvtransfer.handoff import DecodeEvent, PrefillResult, RequestSpec
from kvtransfer.worker_runtime import WorkerConfig, WorkerRuntime


class DecodeWorker:
    def __init__(self, config: WorkerConfig) -> None:
        self.rt = WorkerRuntime(config)
        self.service = DecodeService(self.rt)

    async def ready(self) -> dict[str, object]:
        return self.rt.info()

    async def generate(self, spec: RequestSpec, prefill: PrefillResult | None = None) -> AsyncIterator[DecodeEvent]:
        """Streaming (call with ``.options(num_returns="streaming")``)."""
        async for event in self.service.generate(spec, prefill):
            yield event

    async def pool_state(self) -> dict[str, int]:
        return self.rt.pool_state()

    async def shutdown(self) -> None:
        self.rt.close()
