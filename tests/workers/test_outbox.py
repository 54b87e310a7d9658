"""Outboxes: a step's events of many streams leave in one batch, each stream's in order, and a
request's events are closed on every path."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.decode_worker.outbox import Batch, Outboxes
from pdserve.worker.messages import ChannelClosedError, DecodeEvent


def _event(rid: str, token: int, finished: bool = False) -> DecodeEvent:
    return DecodeEvent(rid, (token,), finished, "length" if finished else None)


class Stepper:
    """Stands in for the engine loop: each ``step`` wakes every stream's task in one turn of the
    event loop, as the engine's outputs of one step reach their streams."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[DecodeEvent]] = {}

    def stream(self, rid: str) -> AsyncIterator[DecodeEvent]:
        queue = self.queues[rid] = asyncio.Queue()

        async def events() -> AsyncIterator[DecodeEvent]:
            while True:
                event = await queue.get()
                yield event
                if event.finished:
                    return

        return events()

    def step(self, n: int, last: bool = False) -> None:
        loop = asyncio.get_running_loop()
        for rid, queue in self.queues.items():
            loop.call_soon(queue.put_nowait, _event(rid, n, last))


async def _collect(boxes: Outboxes, channel: str, batches: list[Batch], opened: asyncio.Event) -> None:
    async for batch in boxes.serve(channel, 60.0):
        if not batch:
            opened.set()
        else:
            batches.append(batch)


def test_a_steps_events_of_every_stream_leave_in_one_batch_in_order() -> None:
    async def main() -> tuple[list[Batch], list[int]]:
        boxes, stepper, batches, opened = Outboxes(), Stepper(), [], asyncio.Event()
        reader = asyncio.ensure_future(_collect(boxes, "c", batches, opened))
        await opened.wait()
        sends = [asyncio.ensure_future(boxes.send("c", rid, stepper.stream(rid))) for rid in ("a", "b", "c")]
        await asyncio.sleep(0)  # the sends start reading their streams
        for n in range(1, 4):
            stepper.step(n, last=n == 3)
            while sum(len(b) for b in batches) < 3 * n:
                await asyncio.sleep(0)
        sent = await asyncio.gather(*sends)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        assert len(boxes) == 0  # the reader left: the channel is closed
        return batches, sent

    batches, sent = asyncio.run(main())
    assert sent == [3, 3, 3]
    assert len(batches) == 3  # one message per step, not one per stream and step
    for n, batch in enumerate(batches, 1):
        assert sorted(rid for rid, _ in batch) == ["a", "b", "c"]
        assert all(ev.token_ids == (n,) and ev.finished == (n == 3) for _, ev in batch)


def test_a_request_for_a_closed_channel_is_refused_and_its_stream_closed() -> None:
    async def events() -> AsyncIterator[DecodeEvent]:
        yield _event("r", 1)

    async def main() -> None:
        gen = events()
        with pytest.raises(ChannelClosedError, match="not open"):
            await Outboxes().send("gone", "r", gen)
        with pytest.raises(StopAsyncIteration):  # closed before it began: the request never runs
            await gen.__anext__()

    asyncio.run(main())


def test_a_cancelled_send_closes_its_stream() -> None:
    """Cancelling a request's ``run`` call cancels its send: the stream's own exit (which ends the
    request in the decode worker) runs at once."""
    async def main() -> list[str]:
        boxes, batches, opened, log = Outboxes(), [], asyncio.Event(), []
        reader = asyncio.ensure_future(_collect(boxes, "c", batches, opened))
        await opened.wait()
        first = asyncio.Event()

        async def events() -> AsyncIterator[DecodeEvent]:
            try:
                yield _event("r", 1)
                first.set()
                await asyncio.sleep(3600)
                yield _event("r", 2)
            finally:
                log.append("closed")

        send = asyncio.ensure_future(boxes.send("c", "r", events()))
        await first.wait()
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        reader.cancel()
        return log

    assert asyncio.run(main()) == ["closed"]


def test_a_reopened_channel_replaces_the_old_one() -> None:
    async def main() -> None:
        boxes = Outboxes()
        old_batches, new_batches, old_open, new_open = [], [], asyncio.Event(), asyncio.Event()
        old = asyncio.ensure_future(_collect(boxes, "c", old_batches, old_open))
        await old_open.wait()
        new = asyncio.ensure_future(_collect(boxes, "c", new_batches, new_open))
        await new_open.wait()
        old.cancel()
        await asyncio.gather(old, return_exceptions=True)
        assert len(boxes) == 1  # the old reader's exit left the new channel open

        async def one() -> AsyncIterator[DecodeEvent]:
            yield _event("r", 1, finished=True)

        assert await boxes.send("c", "r", one()) == 1
        while not new_batches:
            await asyncio.sleep(0)
        assert new_batches == [[("r", _event("r", 1, finished=True))]] and old_batches == []
        new.cancel()
        await asyncio.gather(new, return_exceptions=True)
        assert len(boxes) == 0

    asyncio.run(main())


def test_a_channel_whose_reader_left_cancels_the_requests_sending_on_it() -> None:
    """The router stopped reading (it died, or cancelled the stream): the requests it ran on the
    channel end at once, their streams closed, instead of decoding to max_tokens for nobody."""

    async def main() -> list[str]:
        boxes, batches, opened, log = Outboxes(), [], asyncio.Event(), []
        reader = asyncio.ensure_future(_collect(boxes, "c", batches, opened))
        await opened.wait()

        async def endless(rid: str) -> AsyncIterator[DecodeEvent]:
            try:
                for n in range(10**9):
                    yield _event(rid, n)
                    await asyncio.sleep(0.001)
            finally:
                log.append(rid)

        sends = [asyncio.ensure_future(boxes.send("c", rid, endless(rid))) for rid in ("a", "b")]
        while len(batches) < 3:
            await asyncio.sleep(0.001)
        reader.cancel()
        results = await asyncio.gather(*sends, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        return sorted(log)

    assert asyncio.run(main()) == ["a", "b"]
