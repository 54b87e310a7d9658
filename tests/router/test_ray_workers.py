"""RayWorkers over real Ray actors: a prefill or decode stream the router gives up on is cancelled
and also dropped by its request id (``worker/drops.py``), which ends it where Ray lost the cancel."""

from __future__ import annotations

import asyncio

import pytest
import ray

from pdserve import SamplingParams
from pdserve.router.ray_workers import RayWorkers, WorkerFailedError
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from tests.support.polling import wait_until, wait_until_async
from tests.support.service import shared_ray


@ray.remote
class CountingDecode:
    """A decode actor whose streams run to ``max_tokens`` unless cancelled; it records the drops and
    prefetches it gets."""

    def __init__(self) -> None:
        self.dropped: list[str] = []
        self.prefetched: list[str] = []

    async def prefetch(self, spec: RequestSpec, address: str) -> bool:
        self.prefetched.append(spec.request_id)
        return True

    async def prefetches(self) -> list[str]:
        return list(self.prefetched)

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


@ray.remote
class SlowPrefill:
    """A prefill actor whose prefills take an hour, but for one of one token; it records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        self.calls.append(("prefill", spec.request_id))
        if spec.params.max_tokens != 1:
            await asyncio.sleep(3600)
        return PrefillResult(spec.request_id, 7, True, "length", None, "127.0.0.1:1", "prefill-0", 2, 0)

    async def drop(self, request_id: str) -> bool:
        self.calls.append(("drop", request_id))
        return False

    async def release_request(self, request_id: str) -> bool:
        self.calls.append(("release_request", request_id))
        return False

    async def recorded(self) -> list[tuple[str, str]]:
        return list(self.calls)


def test_a_cancelled_prefill_is_dropped_by_id_with_its_prefetch_and_released_once_over() -> None:
    """The client leaves while its prefill runs and the decode worker prefetches its prompt: the
    prefill is dropped beside its cancel, the prefetch is dropped, and once the prefill's task is
    over the prefill worker frees whatever the request still holds."""
    shared_ray()
    prefill, decode = SlowPrefill.remote(), CountingDecode.remote()
    try:
        workers = RayWorkers({"prefill-0": prefill}, {"decode-0": decode})
        gone = RequestSpec("gone", (1, 2), SamplingParams())

        async def give_up() -> None:
            # A first prefill tells the prefill worker's address; prefetches need it.
            await workers.prefill("prefill-0", RequestSpec("warm", (1,), SamplingParams(max_tokens=1)))
            workers.prefetch("decode-0", gone, "prefill-0")
            task = asyncio.ensure_future(workers.prefill("prefill-0", gone))
            assert await wait_until_async(lambda: ("prefill", "gone") in ray.get(prefill.recorded.remote(), timeout=30))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # The release comes once the task is over, from this loop: kept running meanwhile.
            assert await wait_until_async(lambda: len(ray.get(prefill.recorded.remote(), timeout=30)) == 4, timeout=30)

        asyncio.run(give_up())
        assert sorted(ray.get(prefill.recorded.remote(), timeout=30)) == [
            ("drop", "gone"), ("prefill", "gone"), ("prefill", "warm"), ("release_request", "gone")]  # fmt: skip
        assert wait_until(lambda: ray.get(decode.drops.remote(), timeout=30) == ["gone"], timeout=30)
        assert ray.get(decode.prefetches.remote(), timeout=30) == ["gone"]
    finally:
        ray.kill(prefill)
        ray.kill(decode)


@ray.remote
class FailingWorker:
    """A prefill that refuses its request, and a decode stream that fails after one event."""

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        raise ValueError("max_tokens: the request needs 40 KV blocks, the pool has 8")

    async def generate(self, spec: RequestSpec, prefill: object = None):  # noqa: ANN201 - a Ray stream
        yield DecodeEvent(spec.request_id, (1,), False, None)
        raise RuntimeError(f"step failed in {__file__}")

    async def drop(self, request_id: str) -> bool:
        return False


def test_a_workers_error_reaches_the_router_without_its_host_or_traceback() -> None:
    """A refusal keeps the worker's message alone (the edges answer it as a bad request); any
    other failure names the worker and the error's type. Ray's error, with the remote traceback,
    process id and address, stays the exception's cause, for the router's log."""
    shared_ray()
    actor = FailingWorker.remote()
    try:
        workers = RayWorkers({"prefill-0": actor}, {"decode-0": actor})
        spec = RequestSpec("r", (1, 2), SamplingParams(max_tokens=3))
        with pytest.raises(ValueError) as refused:
            asyncio.run(workers.prefill("prefill-0", spec))
        assert str(refused.value) == "max_tokens: the request needs 40 KV blocks, the pool has 8"
        assert isinstance(refused.value.__cause__, ray.exceptions.RayTaskError)

        async def read() -> list[DecodeEvent]:
            return [ev async for ev in workers.decode("decode-0", spec, None)]

        with pytest.raises(WorkerFailedError) as failed:
            asyncio.run(read())
        assert str(failed.value) == "decode worker decode-0 failed (RuntimeError)"
        cause = failed.value.__cause__
        assert isinstance(cause, ray.exceptions.RayTaskError) and "step failed in" in str(cause)
    finally:
        ray.kill(actor)
