"""PrefillService: run a prompt, sample its first token, hold its KV under a lease."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from pdserve.engine.cpu_threads import single_threaded_torch
from pdserve.engine.engine import RequestOutput
from pdserve.engine.request import Request
from pdserve.worker.drops import Dropped, Drops
from pdserve.worker.messages import PrefillResult, RequestSpec
from pdserve.worker.runtime import WorkerRuntime
from pdserve.worker.threads import run_to_end, wait_to_end


class PrefillService:
    """Plain-Python core of the prefill worker (the Ray actor is a shell around it).

    Guarantees: when ``prefill`` returns a result with a ``lease_id``, the request's
    blocks are held by that lease (released by the puller or expired after the TTL);
    in every other outcome (finished on the first token, error, cancellation) the
    request holds no blocks when ``prefill`` returns or raises. ``drop`` ends a prefill by its
    request id, whether it runs or has not begun (``worker/drops.py``): it raises ``Dropped``.

    A registration and the end of a request given up on wait for the engine's lock, which a step
    holds: they run on a thread of their own, in order (a request's end after its registration),
    never on the event loop that answers the other prefills, and a cancelled waiter leaves them
    running to their end. A request's structured-output constraint compiles on a thread of its own
    too (seconds for a large schema over a large vocabulary: ``make_request``). ``close`` waits for them.
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.drops = Drops()
        self._engine_calls = ThreadPoolExecutor(1, thread_name_prefix="prefill-register",
                                                initializer=single_threaded_torch)  # fmt: skip
        self._compiles = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def close(self) -> None:
        """Wait for the registrations and ends handed to the service's thread."""
        self._engine_calls.shutdown(wait=True)
        self._compiles.shutdown(wait=True)

    def drop(self, request_id: str) -> bool:
        """End ``request_id``'s prefill (the router gave up on it): True when it runs, False when
        it has not begun (it ends as it begins)."""
        return self.drops.drop(request_id)

    async def _make_request(self, spec: RequestSpec) -> Request:
        """``spec``'s engine request (its checks raise ValueError), built where a constraint's compile
        cannot hold up the event loop: on the compile thread when it has one."""

        def make() -> Request:
            # handoff: the engine samples the first token with the request's own parameters and,
            # unless that token ends it, hands it off with its KV held (KV-handover API).
            return self.rt.engine.make_request(spec.prompt_token_ids, spec.params, spec.request_id, spec.cache_salt,
                                               handoff=True)  # fmt: skip

        return make() if spec.params.structured_outputs is None else await run_to_end(self._compiles, make)

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        rt = self.rt
        req = await self._make_request(spec)
        aloop = asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = aloop.create_future()

        def on_output(out: RequestOutput | BaseException) -> None:
            if isinstance(out, BaseException):
                aloop.call_soon_threadsafe(lambda: done.done() or done.set_exception(out))
            elif out.finished:
                aloop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        def on_drop() -> None:
            if not done.done():
                done.set_exception(Dropped(spec.request_id))

        if not self.drops.begin(spec.request_id, on_drop):
            raise Dropped(spec.request_id)  # nothing submitted: nothing held
        registering: Future[None] | None = None
        leased = False
        try:
            registering = self._engine_calls.submit(rt.loop.submit, req, on_output)
            await wait_to_end(registering)  # an id in use raises here: the other request is not ours to end
            out = await done
            lease_id = rt.source.lease(out.kv_handoff) if out.kv_handoff is not None else None
            leased = lease_id is not None  # from here the lease owns the KV, whatever follows
            return self._result(spec, out, lease_id)
        finally:
            self.drops.end(spec.request_id, on_drop)
            if not done.done():
                done.cancel()
            elif not done.cancelled():
                done.exception()  # a drop's, read: nobody else will (asyncio would log it as lost)
            if registering is not None and not leased:
                await self._end(spec.request_id, registering)

    def _result(self, spec: RequestSpec, out: RequestOutput, lease_id: str | None) -> PrefillResult:
        """The first token's answer (counted in the stats), its KV under ``lease_id`` if any."""
        rt = self.rt
        rt.stats.record({"prefill_computed_tokens": out.num_prompt_tokens - out.num_cached_tokens}, spec.cache_salt)
        return PrefillResult(
            spec.request_id,
            out.new_token_ids[0],
            lease_id is None,
            None if lease_id else out.finish_reason,
            lease_id,
            rt.address,
            rt.config.worker_id,
            out.num_prompt_tokens,
            out.num_cached_tokens,
            out.logprobs[0] if out.logprobs else None,
        )

    async def _end(self, request_id: str, registering: Future[None]) -> None:
        """Finished on its first token, failed, cancelled or dropped before a lease took its KV:
        nothing may stay held. The engine may have handed the request off already (its output not
        yet delivered here), so after the abort a held KV is released too; the engine lock orders
        both. On the service's thread, after the registration (also when cancelled again)."""
        rt = self.rt

        def end() -> None:
            wait_futures([registering])
            if registering.exception() is not None:  # refused: nothing of this call's is registered
                return
            rt.loop.abort(request_id)
            rt.engine.handover.release(request_id)

        await run_to_end(self._engine_calls, end)
