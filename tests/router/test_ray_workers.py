"""RayWorkers over real Ray actors: a prefill or decode stream the router gives up on is cancelled
and also dropped by its request id (``worker/drops.py``), which ends it where Ray lost the cancel."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from pdserve import SamplingParams
from pdserve.decode_worker.outbox import Outboxes
from pdserve.router.admission import Overloaded
from pdserve.router.core import WorkerUnavailableError
from pdserve.router.decode_channel import MAX_UNREAD_EVENTS
from pdserve.router.ray_workers import RayWorkers, WorkerFailedError
from pdserve.worker.messages import ChannelClosedError, DecodeEvent, PrefillResult, RequestSpec
from tests.support.polling import wait_until, wait_until_async
from tests.support.service import shared_ray


async def _decode(workers: RayWorkers, rid: str, n: int) -> list[DecodeEvent]:
    """Every event of a request for ``n`` tokens on ``decode-0``."""
    spec = RequestSpec(rid, (1,), SamplingParams(max_tokens=n))
    return [ev async for ev in workers.decode("decode-0", spec, None)]


class ChannelWorker:
    """A decode actor's event channel, as ``DecodeWorker`` serves it (``decode_worker/outbox.py``)."""

    outboxes: Outboxes

    async def events(self, channel: str, ttl_s: float):  # noqa: ANN201 - a Ray stream
        async for batch in self.outboxes.serve(channel, ttl_s):
            yield batch

    async def renew(self, channel: str) -> bool:
        return self.outboxes.renew(channel)


@ray.remote
class CountingDecode(ChannelWorker):
    """A decode actor whose streams run to ``max_tokens`` unless cancelled; it records the drops and
    prefetches it gets."""

    def __init__(self) -> None:
        self.dropped: list[str] = []
        self.prefetched: list[str] = []
        self.outboxes = Outboxes()

    async def prefetch(self, spec: RequestSpec, address: str) -> bool:
        self.prefetched.append(spec.request_id)
        return True

    async def prefetches(self) -> list[str]:
        return list(self.prefetched)

    async def run(self, spec: RequestSpec, prefill: object, channel: str) -> int:
        async def generate():  # noqa: ANN202
            for n in range(1, spec.params.max_tokens + 1):
                await asyncio.sleep(0.001)
                yield DecodeEvent(spec.request_id, (n,), n == spec.params.max_tokens, "length")

        return await self.outboxes.send(channel, spec.request_id, generate())

    async def drop(self, request_id: str) -> bool:
        self.dropped.append(request_id)
        return False

    async def drops(self) -> list[str]:
        return list(self.dropped)

    async def forget_channels(self) -> None:
        """Have no channel open, as after a restart, while the streams already served go on."""
        self.outboxes = Outboxes()

    async def refuse_every_channel(self) -> None:
        self.outboxes = Outboxes()
        self.outboxes.serve = _serve_nothing  # type: ignore[method-assign] - a channel never opens here


async def _serve_nothing(channel: str, ttl_s: float):  # noqa: ANN202
    """An event channel confirmed open (its first, empty batch) that the worker never registers:
    its ``run`` calls are refused."""
    yield []
    await asyncio.Event().wait()


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


def test_a_run_refused_for_a_channel_the_worker_does_not_have_open_is_sent_again_on_a_new_one() -> None:
    """The worker lost its channels (a restart, an expiry) before the router's reader learned it:
    the refused request ran nothing, so it is sent once more on a new channel and decodes whole.
    A worker that refuses the new channel too fails the request, after that one more try."""
    shared_ray()
    actor = CountingDecode.remote()
    try:
        workers = RayWorkers({}, {"decode-0": actor})

        async def main() -> None:  # one loop: its channel to the worker is kept between requests
            assert (await _decode(workers, "first", 2))[-1].finished
            await actor.forget_channels.remote()
            again, more = await _decode(workers, "again", 3), await _decode(workers, "more", 2)
            assert [ev.token_ids for ev in again] == [(1,), (2,), (3,)] and again[-1].finished
            assert [ev.token_ids for ev in more] == [(1,), (2,)] and more[-1].finished
            await actor.refuse_every_channel.remote()
            with pytest.raises(WorkerFailedError, match=r"decode worker decode-0 failed \(ChannelClosedError\)"):
                await _decode(workers, "refused", 2)

        asyncio.run(main())
    finally:
        ray.kill(actor)


def test_a_reader_that_falls_too_far_behind_has_its_request_ended() -> None:
    """A request's reader that leaves MAX_UNREAD_EVENTS of its events unread: the run is dropped on the
    worker while the reader still waits, and the reader gets what was queued, then Overloaded."""
    shared_ray()
    decode = CountingDecode.remote()
    try:
        workers = RayWorkers({}, {"decode-0": decode})
        total = 3 * MAX_UNREAD_EVENTS

        async def main() -> int:
            spec = RequestSpec("slow", (1,), SamplingParams(max_tokens=total))
            events = workers.decode("decode-0", spec, None)
            assert not (await anext(events)).finished
            # Not read meanwhile: the worker goes on, and is told to stop once the queue is full.
            assert await wait_until_async(lambda: "slow" in ray.get(decode.drops.remote(), timeout=30), timeout=60)
            read = 1
            with pytest.raises(Overloaded, match=f"left {MAX_UNREAD_EVENTS} events of its output unread"):
                async for _ in events:
                    read += 1
            return read

        read = asyncio.run(main())
        assert read <= MAX_UNREAD_EVENTS + 1 < total
    finally:
        ray.kill(decode)


def _decode_unavailable(actor_class: Any, match: str, requests: int = 1, channel_ttl_s: float = 30.0) -> None:
    """Each of ``requests`` requests to a decode actor of ``actor_class`` fails as WorkerUnavailableError
    matching ``match`` (within a minute)."""
    shared_ray()
    actor = actor_class.remote()
    try:
        workers = RayWorkers({}, {"decode-0": actor}, channel_ttl_s=channel_ttl_s)
        for _ in range(requests):
            with pytest.raises(WorkerUnavailableError, match=match):
                asyncio.run(asyncio.wait_for(_decode(workers, "r", 3), timeout=60))
    finally:
        ray.kill(actor)


@ray.remote
class SelfCancellingDecode(ChannelWorker):
    """A decode actor whose run is cancelled on the worker after one event (as a channel that closes
    there cancels the runs still sending on it)."""

    def __init__(self) -> None:
        self.outboxes = Outboxes()

    async def run(self, spec: RequestSpec, prefill: object, channel: str) -> int:
        async def generate():  # noqa: ANN202
            yield DecodeEvent(spec.request_id, (1,), False, None)
            await asyncio.Event().wait()

        sending = asyncio.ensure_future(self.outboxes.send(channel, spec.request_id, generate()))
        await asyncio.sleep(0.05)
        sending.cancel()
        raise asyncio.CancelledError

    async def drop(self, request_id: str) -> bool:
        return False


def test_a_run_cancelled_on_the_worker_is_unavailable_not_a_failure() -> None:
    """A decode run that the worker cancelled itself reaches the router as the worker being unavailable
    (UNAVAILABLE, 503: retry), not as an internal failure."""
    _decode_unavailable(SelfCancellingDecode, "decode worker decode-0 ended the call")


@ray.remote
class StuckDecode(ChannelWorker):
    """A decode actor that never confirms an event channel (its loop as good as stuck)."""

    async def events(self, channel: str, ttl_s: float):  # noqa: ANN201 - a Ray stream
        await asyncio.Event().wait()
        yield []

    async def drop(self, request_id: str) -> bool:
        return False


def test_a_worker_that_never_opens_its_channel_is_unavailable_within_the_ttl() -> None:
    """Opening a channel waits at most the channel's TTL: the request then fails as on a dead worker
    (the router takes the worker for down and sends the request elsewhere), and the next request
    tries to open a channel anew."""
    _decode_unavailable(StuckDecode, "did not open an event channel within 1 s", requests=2, channel_ttl_s=1.0)


@ray.remote
class ExpiringDecode(ChannelWorker):
    """A decode actor whose first channel ends, as an expiry ends one, when the first request comes
    for it, and which refuses that request (the channel is not open any more); later channels serve."""

    def __init__(self) -> None:
        self.outboxes = Outboxes()
        self.opened = 0
        self.end_first = asyncio.Event()  # set: the first channel's stream ends
        self.first_ended = asyncio.Event()

    async def events(self, channel: str, ttl_s: float):  # noqa: ANN201 - a Ray stream
        self.opened += 1
        if self.opened > 1:
            async for batch in self.outboxes.serve(channel, ttl_s):
                yield batch
            return
        try:
            yield []
            await self.end_first.wait()
        finally:
            self.first_ended.set()

    async def run(self, spec: RequestSpec, prefill: object, channel: str) -> int:
        if self.opened == 1:
            self.end_first.set()  # the channel's stream ends now, before this refusal is answered
            await self.first_ended.wait()
            raise ChannelClosedError(f"decode event channel {channel!r} is not open")

        async def generate():  # noqa: ANN202
            for n in range(1, spec.params.max_tokens + 1):
                yield DecodeEvent(spec.request_id, (n,), n == spec.params.max_tokens, "length")

        return await self.outboxes.send(channel, spec.request_id, generate())

    async def drop(self, request_id: str) -> bool:
        return False

    async def channels_opened(self) -> int:
        return self.opened


def test_a_channel_that_ends_as_its_request_is_refused_sends_the_request_again() -> None:
    """The channel's end reaches the router before (or after) the refusal of the request sent for
    it: either way the refusal is what the router acts on, and the request decodes on a new channel
    of the same worker, which is not taken for dead."""
    shared_ray()
    actor = ExpiringDecode.remote()
    try:
        workers = RayWorkers({}, {"decode-0": actor})

        async def main() -> list[DecodeEvent]:
            return [ev async for ev in workers.decode("decode-0", RequestSpec("r", (1,), SamplingParams(max_tokens=3)),
                                                      None)]  # fmt: skip

        events = asyncio.run(main())
        assert [ev.token_ids for ev in events] == [(1,), (2,), (3,)] and events[-1].finished
        assert ray.get(actor.channels_opened.remote(), timeout=30) == 2
    finally:
        ray.kill(actor)


@ray.remote
class SlowPrefill:
    """A prefill actor whose prefills take an hour, but for one of one token, and that refuses a request
    named "refused"; it records the calls it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        self.calls.append(("prefill", spec.request_id))
        if spec.request_id == "refused":
            raise ValueError("max_tokens: the request needs 40 KV blocks, the pool has 8")
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


def test_a_prefill_that_ends_or_fails_its_request_drops_its_prefetch() -> None:
    """A prefill whose first token finishes the request, or that the worker refuses, leaves no decode
    call to end the decode worker's prefetch of the prompt: it is dropped there and then."""
    shared_ray()
    prefill, decode = SlowPrefill.remote(), CountingDecode.remote()
    try:
        workers = RayWorkers({"prefill-0": prefill}, {"decode-0": decode})

        async def main() -> None:
            await workers.prefill("prefill-0", RequestSpec("warm", (1,), SamplingParams(max_tokens=1)))
            one = RequestSpec("one", (1, 2), SamplingParams(max_tokens=1))
            workers.prefetch("decode-0", one, "prefill-0")
            assert (await workers.prefill("prefill-0", one)).finished
            refused = RequestSpec("refused", (1, 2), SamplingParams(max_tokens=3))
            workers.prefetch("decode-0", refused, "prefill-0")
            with pytest.raises(ValueError, match="the pool has 8"):
                await workers.prefill("prefill-0", refused)

        asyncio.run(main())
        # An async actor's calls may run out of their order of submission: polled.
        assert wait_until(lambda: sorted(ray.get(decode.prefetches.remote(), timeout=30)) == ["one", "refused"])
        assert wait_until(lambda: sorted(ray.get(decode.drops.remote(), timeout=30)) == ["one", "refused"], timeout=30)
    finally:
        ray.kill(prefill)
        ray.kill(decode)


@ray.remote
class FailingWorker(ChannelWorker):
    """A prefill that refuses its request, and a decode stream that fails after one event."""

    def __init__(self) -> None:
        self.outboxes = Outboxes()

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        raise ValueError("max_tokens: the request needs 40 KV blocks, the pool has 8")

    async def run(self, spec: RequestSpec, prefill: object, channel: str) -> int:
        async def generate():  # noqa: ANN202
            yield DecodeEvent(spec.request_id, (1,), False, None)
            raise RuntimeError(f"step failed in {__file__}")

        return await self.outboxes.send(channel, spec.request_id, generate())

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


@ray.remote(max_restarts=1)
class SteppingDecode(ChannelWorker):
    """A decode actor whose streams all advance together, one token per tick (as an engine's steps
    advance every running request); it counts the messages and events it sent on its channels.
    The request "dropped" is dropped after two tokens (``run`` returns, unfinished)."""

    def __init__(self) -> None:
        self.outboxes = Outboxes()
        self.tick = asyncio.Event()
        self.messages = self.events_sent = self.running = 0
        self.ticker: asyncio.Task[None] | None = None

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(0.002)
            self.tick.set()
            self.tick = asyncio.Event()

    async def events(self, channel: str, ttl_s: float):  # noqa: ANN201 - a Ray stream
        if self.ticker is None:
            self.ticker = asyncio.ensure_future(self._ticks())
        async for batch in self.outboxes.serve(channel, ttl_s):
            self.messages += bool(batch)
            self.events_sent += len(batch)
            yield batch

    async def run(self, spec: RequestSpec, prefill: object, channel: str) -> int:
        n = spec.params.max_tokens

        async def generate():  # noqa: ANN202
            self.running += 1
            try:
                for k in range(1, (2 if spec.request_id == "dropped" else n) + 1):
                    await self.tick.wait()
                    yield DecodeEvent(spec.request_id, (k,), k == n, "length")
            finally:
                self.running -= 1

        return await self.outboxes.send(channel, spec.request_id, generate())

    async def drop(self, request_id: str) -> bool:
        return False

    async def counts(self) -> tuple[int, int, int]:
        return self.messages, self.events_sent, len(self.outboxes)

    async def requests_running(self) -> int:
        return self.running


def test_concurrent_streams_share_one_message_per_step() -> None:
    """Eight requests decoded together on one worker reach the router whole and in order, in about
    one message per step, not one per request and step; a request the worker dropped ends early."""
    shared_ray()
    actor = SteppingDecode.remote()
    try:
        workers = RayWorkers({}, {"decode-0": actor})

        async def main() -> list[list[DecodeEvent]]:
            streams = await asyncio.gather(*(_decode(workers, f"r{i}", 20) for i in range(8)))
            dropped = await _decode(workers, "dropped", 20)
            workers.close()
            return [*streams, dropped]

        *streams, dropped = asyncio.run(main())
        for events in streams:
            assert [ev.token_ids for ev in events] == [(k,) for k in range(1, 21)] and events[-1].finished
        assert [ev.token_ids for ev in dropped] == [(1,), (2,)] and not dropped[-1].finished
        messages, sent, _ = ray.get(actor.counts.remote(), timeout=30)
        assert sent == 8 * 20 + 2
        assert messages <= sent // 4, (messages, sent)  # ~20 steps of 8 streams; one per event would be 162
        assert wait_until(lambda: ray.get(actor.counts.remote(), timeout=30)[2] == 0, timeout=30)  # channel closed
    finally:
        ray.kill(actor)


def test_a_worker_that_dies_fails_its_streams_and_a_new_channel_serves_after_its_restart() -> None:
    shared_ray()
    actor = SteppingDecode.remote()
    try:
        workers = RayWorkers({}, {"decode-0": actor})

        async def main() -> list[DecodeEvent]:
            spec = [RequestSpec(f"r{i}", (1,), SamplingParams(max_tokens=10**6)) for i in range(3)]
            streams = [workers.decode("decode-0", s, None) for s in spec]
            assert all([(await s.__anext__()).token_ids == (1,) for s in streams])
            ray.kill(actor, no_restart=False)
            for s in streams:
                with pytest.raises(WorkerUnavailableError, match="decode worker decode-0 is unavailable"):
                    async for _ in s:
                        pass
            restarted = False
            for _ in range(600):  # up to 60 s: a loaded machine restarts an actor slowly
                try:
                    await actor.requests_running.remote()
                    restarted = True
                    break
                except ray.exceptions.RayActorError:  # still restarting
                    await asyncio.sleep(0.1)
            assert restarted
            again = RequestSpec("again", (1,), SamplingParams(max_tokens=3))
            return [ev async for ev in workers.decode("decode-0", again, None)]

        events = asyncio.run(main())
        assert [ev.token_ids for ev in events] == [(1,), (2,), (3,)] and events[-1].finished
    finally:
        ray.kill(actor)


@ray.remote
class StreamingRouter:
    """A router's part in a Ray actor of its own: endless streams from a decode worker, read on."""

    def __init__(self, decode: ray.actor.ActorHandle, channel_ttl_s: float) -> None:
        self.workers = RayWorkers({}, {"decode-0": decode}, channel_ttl_s)
        self.seen = 0
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, n: int) -> None:
        self.tasks = [asyncio.ensure_future(self._read(f"r{i}")) for i in range(n)]

    async def _read(self, rid: str) -> None:
        async for _ in self.workers.decode("decode-0", RequestSpec(rid, (1,), SamplingParams(max_tokens=10**6)), None):
            self.seen += 1

    async def events_seen(self) -> int:
        return self.seen


def test_a_router_that_dies_mid_stream_has_its_requests_ended_on_the_decode_worker() -> None:
    """Ray does not end an actor's tasks when their caller dies: a router killed while it streams
    would leave its requests decoding to max_tokens. The decode worker ends them once the router's
    event channel goes unrenewed for its ttl, and closes the channel."""
    shared_ray()
    decode = SteppingDecode.remote()
    router = StreamingRouter.remote(decode, 1.0)
    try:
        ray.get(router.start.remote(3), timeout=60)
        assert wait_until(lambda: ray.get(router.events_seen.remote(), timeout=30) >= 30, timeout=60)
        assert ray.get(decode.requests_running.remote(), timeout=30) == 3
        # Renewed while the router lives: its requests run on past three ttls (1,500 ticks of >= 2 ms).
        seen = ray.get(router.events_seen.remote(), timeout=30)
        assert wait_until(lambda: ray.get(router.events_seen.remote(), timeout=30) > seen + 4500, timeout=60)
        assert ray.get(decode.requests_running.remote(), timeout=30) == 3
        ray.kill(router, no_restart=True)
        assert wait_until(lambda: ray.get(decode.requests_running.remote(), timeout=30) == 0, timeout=30)
        assert ray.get(decode.counts.remote(), timeout=30)[2] == 0  # the channel is closed
    finally:
        ray.kill(router)
        ray.kill(decode)
