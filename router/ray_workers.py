"""RayWorkers: the router's WorkerClient over Ray actor handles."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import ray
from ray.exceptions import RayActorError

from pdserve.router.core import WorkerUnavailableError
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec


class RayWorkers:
    """Calls prefill/decode actors; a dead actor surfaces as WorkerUnavailableError, and a
    cancelled caller cancels the remote task (the worker then frees the request's blocks)."""

    def __init__(self, prefill: dict[str, ray.actor.ActorHandle], decode: dict[str, ray.actor.ActorHandle]) -> None:
        self.prefill_handles = prefill
        self.decode_handles = decode
        self.prefill_ids = list(prefill)
        self.decode_ids = list(decode)

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult:
        ref = self.prefill_handles[worker_id].prefill.remote(spec)
        try:
            return await ref
        except RayActorError as exc:
            raise WorkerUnavailableError(f"prefill worker {worker_id} is unavailable: {exc}") from exc
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise

    def release(self, worker_id: str, lease_id: str) -> None:
        handle = self.prefill_handles.get(worker_id)
        if handle is not None:
            handle.release.remote(lease_id)  # not awaited: the lease also expires on its own

    async def decode(
        self, worker_id: str, spec: RequestSpec, prefill: PrefillResult | None
    ) -> AsyncIterator[DecodeEvent]:
        gen = self.decode_handles[worker_id].generate.options(num_returns="streaming").remote(spec, prefill)
        finished = False
        try:
            async for ref in gen:
                event: DecodeEvent = await ref
                finished = event.finished
                yield event
        except RayActorError as exc:
            raise WorkerUnavailableError(f"decode worker {worker_id} is unavailable: {exc}") from exc
        finally:
            if not finished:
                ray.cancel(gen)
