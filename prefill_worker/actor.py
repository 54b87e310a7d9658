"""The prefill worker as a Ray actor: a thin shell over WorkerRuntime + PrefillService."""

from __future__ import annotations

from kvtransfer.handoff import PrefillResult, RequestSpec
from kvtransfer.worker_runtime import WorkerConfig, WorkerRuntime
from prefill_worker.service import PrefillService


class PrefillWorker:
    def __init__(self, config: WorkerConfig) -> None:
        self.rt = WorkerRuntime(config)
        self.service = PrefillService(self.rt)

    async def ready(self) -> dict[str, object]:
        return self.rt.info()

    async def load(self) -> dict[str, int]:
        return self.rt.load()

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        return await self.service.prefill(spec)

    async def pool_state(self) -> dict[str, int]:
        """Free blocks, leases and live requests (tests assert the pool returns to idle)."""
        with self.rt.engine.lock:
            return {
                "free_blocks": self.rt.engine.kv.num_free_blocks(),
                "num_blocks": self.rt.engine.kv.num_blocks,
                "leases": len(self.rt.source.leases),
                "requests": len(self.rt.engine.kv.req_to_blocks),
            }

    async def shutdown(self) -> None:
        self.rt.close()
