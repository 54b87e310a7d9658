"""RayWorkers over real Ray actors: a decode stream the router leaves unfinished is cancelled and
also dropped by its request id (``DecodeWorker.drop``), which ends it where Ray lost the cancel."""

from __future__ import annotations

import asyncio

import ray

from pdserve import SamplingParams
from pdserve.router.ray_workers import RayWorkers
from pdserve.worker.messages import DecodeEvent, RequestSpec
from tests.support.polling import wait_until
from tests.support.service import shared_ray


@ray.remote
class CountingDecode:
    """A decode actor whose streams run to ``max_tokens`` unless cancelled; it records the drops it gets."""

    def __init__(self) -> None:
        self.dropped: list[str] = []

    async def generate(self, spec: RequestSpec, prefill: object = None):  # noqa: ANN201 - a Ray stream
        for n in range(1, spec.params.max_tokens + 1):
            await asyncio.sleep(0.001)
            yield DecodeEvent(spec.request_id, (n,), n == spec.params.max_tokens, "length")

    async def drop(self, request_id: str) -> bool:
        self.dropped.append(request_id)
        return False

    async def drops(self) -> list[str]:
        return list(self.dropped)


def _read(workers: RayWorkers, spec: RequestSpec, n: int) -> list[DecodeEvent]:
    async def run() -> list[DecodeEvent]:
        events = []
        stream = workers.decode("decode-0", spec, None)
        async for ev in stream:
            events.append(ev)
            if len(events) == n:
                break
        await stream.aclose()  # the client left: the router closes its stream
        return events

    return asyncio.run(run())


def test_an_unfinished_decode_stream_is_dropped_by_id_beside_its_cancel() -> None:
    """A stream read to its end is not dropped; one the client left after two events is."""
    shared_ray()
    actor = CountingDecode.remote()
    try:
        workers = RayWorkers({}, {"decode-0": actor})
        whole = _read(workers, RequestSpec("whole", (1, 2), SamplingParams(max_tokens=3)), 3)
        assert whole[-1].finished
        left = _read(workers, RequestSpec("left", (1, 2), SamplingParams(max_tokens=10**6)), 2)
        assert [ev.token_ids for ev in left] == [(1,), (2,)]
        assert wait_until(lambda: ray.get(actor.drops.remote(), timeout=30) == ["left"], timeout=30)
    finally:
        ray.kill(actor)
