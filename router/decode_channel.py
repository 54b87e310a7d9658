"""DecodeChannel: one decode worker's token events for this router, on one Ray stream.

The router reads every request it runs on a decode worker through one stream of that worker's
``events`` (``decode_worker/outbox.py``): a message per step carries the events of all the step's
streams, where a stream per request sent a message per stream. A reader task demultiplexes the
batches into one queue per request id. A request registers its queue before its ``run`` call
starts, so none of its events can come before it is there; events of a request no longer
registered (it ended here first) are dropped.

Lifetime: the channel belongs to the event loop that opened it (Ray's streams deliver to one loop).
While it is open, a task renews it on the worker every quarter of ``ttl_s``: a worker closes a
channel nobody renewed for ``ttl_s`` and ends its requests, so the requests of a router that died
do not decode on for nobody (Ray does not end them when their caller dies).
When its stream ends or fails (the worker died or restarted, or the stream was cancelled), or
:meth:`close` is called (a request learnt first that the worker died), every registered request
gets :class:`ChannelBroken` and the channel stays broken; the caller opens a new one.

The worker decodes at its own pace, whoever reads: a request whose reader leaves
``MAX_UNREAD_EVENTS`` of its events waiting (a client that takes its stream slower than it comes)
gets :data:`UNREAD` instead of the next and no more events, so that its output cannot pile up in the
router's memory, and its run on the worker is dropped at once (the caller ends the request when it
reads that far).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import ray

from pdserve.worker.messages import DecodeEvent

MAX_UNREAD_EVENTS = 1024  # a request's events waiting for its reader, at most


class Unread:
    """Queued, in place of an event, to a request that left ``MAX_UNREAD_EVENTS`` events unread."""


UNREAD = Unread()


class ChannelBroken:
    """Queued to every request of a channel whose stream ended or failed (``error``, or None)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class DecodeChannel:
    """An open event channel to one decode worker (``handle``); make it with :meth:`open`."""

    def __init__(self, handle: ray.actor.ActorHandle, name: str, ttl_s: float) -> None:
        self.handle = handle
        self.id = f"{name}-{uuid.uuid4().hex}"
        self.ttl_s = ttl_s
        self.loop = asyncio.get_running_loop()
        self.broken: ChannelBroken | None = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._stream: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def open(cls, handle: ray.actor.ActorHandle, name: str, ttl_s: float) -> DecodeChannel:
        """A channel whose worker has confirmed it open (its first, empty batch came back). Raises
        what Ray raised when the worker cannot answer, and TimeoutError when it did not confirm within
        ``ttl_s`` (a worker whose loop is stuck: the channel would expire before it served anything)."""
        self = cls(handle, name, ttl_s)
        self._stream = handle.events.options(num_returns="streaming").remote(self.id, ttl_s)

        async def confirmed() -> None:
            await (await self._stream.__anext__())

        try:
            await asyncio.wait_for(confirmed(), ttl_s)
        except BaseException:
            ray.cancel(self._stream)
            raise
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._renew())]
        return self

    def usable(self, handle: ray.actor.ActorHandle) -> bool:
        """True when this channel can take a new request for ``handle`` from the running loop."""
        return self.broken is None and self.handle is handle and self.loop is asyncio.get_running_loop()

    def register(self, request_id: str) -> asyncio.Queue[Any]:
        """The queue that gets ``request_id``'s events (then :class:`ChannelBroken` if the channel
        breaks). ValueError when the id is registered already."""
        if request_id in self._queues:
            raise ValueError(f"request {request_id} is already being decoded")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        if self.broken is not None:
            queue.put_nowait(self.broken)
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            async for ref in self._stream:
                batch: list[tuple[str, DecodeEvent]] = await ref
                for request_id, event in batch:
                    queue = self._queues.get(request_id)
                    if queue is None:
                        continue
                    if queue.qsize() < MAX_UNREAD_EVENTS:
                        queue.put_nowait(event)
                    else:  # its reader fell too far behind: no more events for it, and its run ends now
                        del self._queues[request_id]
                        queue.put_nowait(UNREAD)
                        self.handle.drop.remote(request_id)  # not awaited: idempotent
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - the worker died or the stream failed: its requests learn it
            error = exc
        self._break(error)

    async def _renew(self) -> None:
        """Renew the channel on the worker until it breaks; a worker that says it is not open any
        more (it expired while this loop stalled) breaks it here too."""
        while self.broken is None:
            await asyncio.sleep(self.ttl_s / 4)
            try:
                still_open = await asyncio.wait_for(self.handle.renew.remote(self.id), self.ttl_s / 2)
            except Exception:  # noqa: BLE001 - dead or slow: the stream's end tells the requests
                continue
            if not still_open:
                self.close()

    def _break(self, error: BaseException | None) -> None:
        if self.broken is None:
            self.broken = ChannelBroken(error)
            for queue in self._queues.values():
                queue.put_nowait(self.broken)

    def close(self) -> None:
        """Break the channel now (registered requests get ChannelBroken, none can register), then
        cancel the stream and the reader. Idempotent."""
        self._break(None)
        if self._stream is not None:
            ray.cancel(self._stream)
        if not self.loop.is_closed():
            for task in self._tasks:
                task.cancel()
