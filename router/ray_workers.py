"""RayWorkers: the router's WorkerClient over Ray actor handles."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import ray
from prometheus_client.metrics_core import Metric
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError

from pdserve.router.admission import Overloaded
from pdserve.router.core import WorkerUnavailableError
from pdserve.router.decode_channel import MAX_UNREAD_EVENTS, DecodeChannel, Unread
from pdserve.worker.messages import ChannelClosedError, DecodeEvent, PrefillResult, RequestSpec


class WorkerFailedError(RuntimeError):
    """A worker's call raised something other than a refusal of the request (a bug, a failed
    step); its message names the worker and the exception's type, nothing of the worker's host."""


def _worker_error(role: str, worker_id: str, exc: RayTaskError) -> Exception:
    """What the router raises for a worker call that raised ``exc``: a request the worker refused
    (its ValueError) as a ValueError of the worker's message alone, a call the worker cancelled
    itself (a decode worker ends the runs of an event channel that closed there) as
    WorkerUnavailableError, anything else as a WorkerFailedError. Ray's own error carries the remote
    traceback, process id and host address, which go to the router's log (as ``__cause__``), never to
    a client."""
    cause = exc.cause
    if isinstance(cause, ValueError):
        return ValueError(str(cause))
    if isinstance(cause, (asyncio.CancelledError, TaskCancelledError)):
        return WorkerUnavailableError(f"{role} worker {worker_id} ended the call (cancelled there)")
    return WorkerFailedError(f"{role} worker {worker_id} failed ({type(cause).__name__})")


# How long a request whose channel broke before its first event waits for its run's end (a refusal
# comes at once; a dead worker's run fails as soon as Ray knows).
RUN_END_WAIT_S = 2.0


class _RunEnded:
    """Queued when a request's ``run`` call ended: the events it sent, or its error."""

    def __init__(self, sent: int = 0, error: BaseException | None = None) -> None:
        self.sent, self.error = sent, error


async def _report_end(ref: ray.ObjectRef, queue: asyncio.Queue[object]) -> None:
    try:
        queue.put_nowait(_RunEnded(sent=await ref))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the reader raises it
        queue.put_nowait(_RunEnded(error=exc))


async def _run_end(queue: asyncio.Queue[object], timeout_s: float) -> _RunEnded | None:
    """The run's end from ``queue`` (other items skipped), or None after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (left := deadline - loop.time()) > 0:
        try:
            item = await asyncio.wait_for(queue.get(), left)
        except asyncio.TimeoutError:
            return None
        if isinstance(item, _RunEnded):
            return item
    return None


def _refused(exc: BaseException) -> bool:
    """A ``run`` the worker refused for a channel it does not have open (nothing of it ran)."""
    return isinstance(exc, RayTaskError) and isinstance(exc.cause, ChannelClosedError)


async def _settled(ref: ray.ObjectRef) -> None:
    """Wait until the task behind ``ref`` is over, however it ended."""
    try:
        await ref
    except Exception:  # noqa: BLE001 - cancelled or failed: over all the same
        pass


class RayWorkers:
    """Calls prefill/decode actors; a dead actor surfaces as WorkerUnavailableError, and a
    cancelled caller cancels the remote task (the worker then frees the request's blocks) and
    also drops it by request id (``worker/drops.py``), which ends it where Ray lost the cancel."""

    def __init__(self, prefill: dict[str, ray.actor.ActorHandle], decode: dict[str, ray.actor.ActorHandle],
                 channel_ttl_s: float = 30.0) -> None:  # fmt: skip
        """``channel_ttl_s``: a decode worker ends the requests of an event channel not renewed for
        this long (the router renews each every quarter of it): what a router's death costs."""
        self.channel_ttl_s = channel_ttl_s
        self.prefill_handles = prefill
        self.decode_handles = decode
        self.prefill_ids = list(prefill)
        self.decode_ids = list(decode)
        self._cleanups: set[asyncio.Task[None]] = set()
        self._addresses: dict[str, str] = {}  # prefill worker -> its KV-transfer address, as its last result said
        self._prefetching: dict[str, str] = {}  # request id -> the decode worker prefetching it during its prefill
        self._channels: dict[str, DecodeChannel] = {}  # decode worker -> its event channel (router/decode_channel.py)
        self._opening: dict[tuple[str, asyncio.AbstractEventLoop], asyncio.Lock] = {}

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult:
        ref = self.prefill_handles[worker_id].prefill.remote(spec)
        try:
            result: PrefillResult = await ref
            self._addresses[worker_id] = result.address
            if result.finished:  # the request ends on its first token: no decode call will end the prefetch
                self._end_prefetch(spec.request_id)
            return result
        except RayActorError as exc:
            # The decode worker prefills instead (RouterCore._prefill): its call ends the prefetch.
            raise WorkerUnavailableError(f"prefill worker {worker_id} is unavailable") from exc
        except RayTaskError as exc:
            error = _worker_error("prefill", worker_id, exc)
            if not isinstance(error, WorkerUnavailableError):  # the request fails here (else as above)
                self._end_prefetch(spec.request_id)
            raise error from exc
        except asyncio.CancelledError:
            self._give_up(worker_id, spec.request_id, ref)
            raise
        finally:
            self._prefetching.pop(spec.request_id, None)

    def _end_prefetch(self, request_id: str) -> None:
        """End the decode worker's prefetch of ``request_id``'s prompt, if one runs, where no decode call
        for the request will (the request ended or failed with its prefill): else it would poll for
        blocks until it has them all or idles out, holding a prefetch slot and blocks. Only then: a
        drop also ends a decode call of the request id that has not begun."""
        decode = self.decode_handles.get(self._prefetching.pop(request_id, ""))
        if decode is not None:
            decode.drop.remote(request_id)  # not awaited: idempotent

    def _give_up(self, worker_id: str, request_id: str, ref: ray.ObjectRef) -> None:
        """The request ended while its prefill ran on ``worker_id``. A prefill still running is
        cancelled (the worker frees its blocks), and dropped by id where Ray lost the cancel; one
        that already finished holds its KV under a lease nobody will pull (Ray may drop its result,
        so the lease id may never reach us): once the task is over, it is freed by request id. A
        prefetch of the prompt is dropped too: it would poll for blocks that never come, holding a
        prefetch slot and blocks until it idles out."""
        ray.cancel(ref)
        self.prefill_handles[worker_id].drop.remote(request_id)  # not awaited: idempotent
        self._end_prefetch(request_id)
        task = asyncio.ensure_future(self._release_orphan(worker_id, request_id, ref))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _release_orphan(self, worker_id: str, request_id: str, ref: ray.ObjectRef) -> None:
        await _settled(ref)
        handle = self.prefill_handles.get(worker_id)
        if handle is not None:
            handle.release_request.remote(request_id)  # not awaited; idempotent

    def prefetch(self, decode_id: str, spec: RequestSpec, prefill_id: str) -> None:
        """Fire and forget (the decode worker declines what it cannot take); only once a prefill
        result has told this prefill worker's address (a restarted worker's new one comes with its next)."""
        address = self._addresses.get(prefill_id)
        handle = self.decode_handles.get(decode_id)
        if address is not None and handle is not None:
            handle.prefetch.remote(spec, address)  # not awaited: a prefetch only saves time
            self._prefetching[spec.request_id] = decode_id

    async def ping(self, worker_id: str) -> object:
        """The worker's ``ready`` answer (its registry info); raises while its actor cannot answer."""
        handle = self.prefill_handles.get(worker_id) or self.decode_handles[worker_id]
        return await handle.ready.remote()

    def release(self, worker_id: str, lease_id: str) -> None:
        handle = self.prefill_handles.get(worker_id)
        if handle is not None:
            handle.release.remote(lease_id)  # not awaited: the lease also expires on its own

    async def decode(
        self, worker_id: str, spec: RequestSpec, prefill: PrefillResult | None
    ) -> AsyncIterator[DecodeEvent]:
        """The request's events, read from the worker's event channel while its ``run`` call owns it
        there (``router/decode_channel.py``). The stream ends after the finished event, or early
        when the worker dropped the request (``run`` returned, every event it sent was read).

        A ``run`` refused because the worker does not have the channel open (it restarted, or the
        channel expired, before this side's reader learned of it) ran nothing of the request: the
        channel is replaced and the request sent once more."""
        handle = self.decode_handles[worker_id]
        finished = dead = False
        channel: DecodeChannel | None = None
        ref: ray.ObjectRef | None = None  # the run call that owns the request on the worker
        watch: asyncio.Future[None] | None = None
        try:
            for attempt in (1, 2):
                channel = await self._channel(worker_id, handle)
                queue = channel.register(spec.request_id)
                try:
                    ref = handle.run.remote(spec, prefill, channel.id)
                except BaseException:
                    channel.unregister(spec.request_id)
                    raise
                watch = asyncio.ensure_future(_report_end(ref, queue))
                try:
                    async with contextlib.aclosing(self._events(worker_id, queue)) as events:
                        async for item in events:
                            finished = item.finished
                            yield item
                    return
                except RayTaskError as exc:
                    if attempt == 2 or not _refused(exc):
                        raise
                    channel.close()  # stale on this side: the next attempt opens a new one
                    channel.unregister(spec.request_id)
                    watch.cancel()
                    ref = None  # refused: nothing of it runs, nothing to cancel or drop
        except RayActorError as exc:
            dead = True
            if channel is not None:
                channel.close()  # the worker died: its stream is dead too, and the next request needs a new one
            raise WorkerUnavailableError(f"decode worker {worker_id} is unavailable") from exc
        except RayTaskError as exc:
            raise _worker_error("decode", worker_id, exc) from exc
        finally:
            if ref is not None:  # registered, and its run sent
                assert channel is not None and watch is not None
                channel.unregister(spec.request_id)
                watch.cancel()
                if not finished:
                    ray.cancel(ref)
                    # Ray loses a cancel that comes while the actor is starting the task, and the
                    # request would run to max_tokens unread: the drop ends it by id, begun or not.
                    if not dead:
                        handle.drop.remote(spec.request_id)  # not awaited: idempotent

    @staticmethod
    async def _events(worker_id: str, queue: asyncio.Queue[object]) -> AsyncIterator[DecodeEvent]:
        """One ``run`` call's events from its queue, up to the finished one or every event it sent;
        its error raised, a broken channel as WorkerUnavailableError. A channel that breaks before
        any event came (it ended on the worker as the run was refused for it, or the worker died)
        waits up to ``RUN_END_WAIT_S`` for the run's own end: a refusal is raised as such."""
        received, sent = 0, None
        while sent is None or received < sent:
            item = await queue.get()
            if isinstance(item, DecodeEvent):
                received += 1
                yield item
                if item.finished:
                    return
            elif isinstance(item, _RunEnded):
                if item.error is not None:
                    raise item.error
                sent = item.sent
            elif isinstance(item, Unread):  # the request ends (decode's exit cancels and drops its run)
                raise Overloaded(f"the client left {MAX_UNREAD_EVENTS} events of its output unread: it reads "
                                 "slower than its tokens come; the request is ended")  # fmt: skip
            else:  # the channel broke: the worker died or restarted, or the channel expired
                end = await _run_end(queue, RUN_END_WAIT_S) if received == 0 else None
                if end is not None and end.error is not None and _refused(end.error):
                    raise end.error
                raise WorkerUnavailableError(f"decode worker {worker_id} is unavailable") from item.error

    async def _channel(self, worker_id: str, handle: ray.actor.ActorHandle) -> DecodeChannel:
        """This loop's open channel to ``worker_id``, opened now where there is none (one opening at
        a time per worker; a broken one is replaced)."""
        channel = self._channels.get(worker_id)
        if channel is not None and channel.usable(handle):
            return channel
        loop = asyncio.get_running_loop()
        for key in [k for k in self._opening if k[1].is_closed()]:
            del self._opening[key]  # a loop's locks serve no other loop
        lock = self._opening.setdefault((worker_id, loop), asyncio.Lock())
        async with lock:
            channel = self._channels.get(worker_id)
            if channel is None or not channel.usable(handle):
                if channel is not None:
                    channel.close()
                try:
                    channel = await DecodeChannel.open(handle, worker_id, self.channel_ttl_s)
                except TimeoutError as exc:  # alive, but not answering: taken for down (RouterCore)
                    raise WorkerUnavailableError(f"decode worker {worker_id} did not open an event channel within "
                                                 f"{self.channel_ttl_s:g} s") from exc  # fmt: skip
                self._channels[worker_id] = channel
            return channel

    def close(self) -> None:
        """Close the event channels (their requests end as if their worker were gone)."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    async def scrape(self, timeout_s: float) -> dict[str, list[Metric] | None]:
        """Every worker's metric families (``metrics`` of its actor), asked of all at once; None
        for a worker that failed or did not answer within ``timeout_s``."""
        handles = {**self.prefill_handles, **self.decode_handles}

        async def one(handle: ray.actor.ActorHandle) -> list[Metric] | None:
            try:
                return await asyncio.wait_for(handle.metrics.remote(), timeout_s)
            except Exception:  # noqa: BLE001 - dead, restarting or slow: shown as down
                return None

        results = await asyncio.gather(*(one(h) for h in handles.values()))
        return dict(zip(handles, results))
