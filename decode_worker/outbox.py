"""Outboxes: the events of many streams of one decode worker, one message per step to each reader.

A router reads a decode worker's tokens through one event channel (``DecodeWorker.events``)
instead of one Ray stream per request: each message is a Ray object, which costs both processes a
few hundred microseconds of CPU (``pdserve bench streams``), so a step that advanced 16 streams sent
16 of them; through a channel it sends one. The requests themselves are still one call each
(``DecodeWorker.run``), which owns the request and ends it when cancelled; only the events share
the channel.

An :class:`Outbox` is one channel's queue. ``put`` appends (any number of streams, in any order;
each stream's events stay in their order); :meth:`Outbox.batches` yields everything put since the
last batch, once at least one event is there and every task made ready by the same turn of the
event loop (the other streams of the step) has run. All of it runs on the actor's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

from pdserve.worker.messages import ChannelClosedError, DecodeEvent

Batch = list[tuple[str, DecodeEvent]]  # (request id, event), in the order they were put


class Outbox:
    """One reader's queue of (request id, event), open while its reader renews it within ``ttl_s``."""

    def __init__(self, ttl_s: float) -> None:
        self._items: Batch = []
        self._ready = asyncio.Event()
        self.senders: set[asyncio.Task[object]] = set()  # the requests sending here (Outboxes.send)
        self._loop = asyncio.get_running_loop()
        self.ttl_s = ttl_s
        self.renew()

    def renew(self) -> None:
        self._expires = self._loop.time() + self.ttl_s

    def put(self, request_id: str, event: DecodeEvent) -> None:
        self._items.append((request_id, event))
        self._ready.set()

    async def batches(self) -> AsyncIterator[Batch]:
        """The next non-empty batch, each as it comes, until the outbox expires (not renewed for
        ``ttl_s``). A step's outputs reach their streams as callbacks queued together, and each
        stream's task puts its event when it runs: one more turn of the loop after the first put
        lets the others put theirs into the same batch."""
        while True:
            left = self._expires - self._loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._ready.wait(), left)
            except asyncio.TimeoutError:  # not TimeoutError before Python 3.11
                continue
            await asyncio.sleep(0)
            items, self._items = self._items, []
            self._ready.clear()
            if items:
                yield items


class Outboxes:
    """The open channels of one decode worker, by channel id (one per reader)."""

    def __init__(self) -> None:
        self._open: dict[str, Outbox] = {}

    async def serve(self, channel: str, ttl_s: float) -> AsyncIterator[Batch]:
        """Open ``channel`` and yield its batches until the reader stops reading (the stream is
        cancelled or closed) or stops renewing it (:meth:`renew`) for ``ttl_s``, then close it. The
        first batch is empty: it tells the reader the channel is open, so that its requests'
        events have somewhere to go. A channel opened again by the same id replaces the old one.

        Once the channel closes, the requests still sending on it are cancelled: nobody would read
        their events, and cancelling ends them and frees what they hold. The renewals are what
        tells a dead reader: Ray does not end an actor's task when its caller dies, and a router
        that died mid-stream would otherwise leave every request it ran decoding to max_tokens."""
        if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
            raise ValueError(f"a channel's ttl_s must be a finite number > 0, got {ttl_s!r}")
        outbox = self._open[channel] = Outbox(float(ttl_s))
        try:
            yield []
            async for batch in outbox.batches():
                yield batch
        finally:
            if self._open.get(channel) is outbox:
                del self._open[channel]
            for task in outbox.senders:
                task.cancel()

    def renew(self, channel: str) -> bool:
        """Keep ``channel`` open for another ``ttl_s``; False when it is not open."""
        outbox = self._open.get(channel)
        if outbox is not None:
            outbox.renew()
        return outbox is not None

    async def send(self, channel: str, request_id: str, events: AsyncIterator[DecodeEvent]) -> int:
        """Put each of ``events`` (one request's stream) in ``channel``'s outbox as it comes; return
        how many once the stream ends. ``events`` is closed on every path, a cancellation included
        (that is what ends the request); a channel that closes meanwhile cancels it. ChannelClosedError
        when the channel is not open (its reader is gone), before anything of the request ran."""
        async with contextlib.aclosing(events):
            outbox = self._open.get(channel)
            if outbox is None:
                raise ChannelClosedError(f"decode event channel {channel!r} is not open")
            task = asyncio.current_task()
            assert task is not None
            outbox.senders.add(task)
            try:
                sent = 0
                async for event in events:
                    outbox.put(request_id, event)
                    sent += 1
                return sent
            finally:
                outbox.senders.discard(task)

    def __len__(self) -> int:
        return len(self._open)
