"""DecodeService: take over a prefilled request (pull its KV) or prefill locally, then stream tokens."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from pdserve.decode_worker.call import CallThreads, DecodeCall
from pdserve.decode_worker.holder_slots import HolderSlots
from pdserve.decode_worker.prefetch import Prefetches
from pdserve.engine.cpu_threads import single_threaded_torch
from pdserve.engine.engine import RequestOutput
from pdserve.worker.drops import Dropped, Drops
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from pdserve.worker.runtime import WorkerRuntime

Outcome = RequestOutput | BaseException  # what the engine hands a stream: an output, or why it failed

MAX_CONCURRENT_PULLS = 16  # threads; one prefill worker's pulls take at most half of them (HolderSlots)
MAX_CONCURRENT_PREFETCHES = 4  # on threads of their own: a prefetch waiting on its holder must not hold up a pull


class DecodeService:
    """Plain-Python core of the decode worker (the Ray actor is a shell around it).

    ``generate`` yields DecodeEvents until the request finishes. Whatever happens (the
    consumer stops iterating, is cancelled, or a pull fails) the request's blocks are
    back in the pool when the generator closes, and the prefill worker's lease is
    released once this worker will not pull it: a ``DecodeCall`` owns both
    (``decode_worker/call.py``). A failed pull is not an error for the client: the prompt
    is recomputed here and counted in ``recomputed_tokens``. ``drop`` ends a stream by its request
    id, whether it runs or has not begun (``worker/drops.py``).
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        # Pulls copy blocks into the pool: on one torch thread each, leaving the team to the engine loop.
        self._pulls = ThreadPoolExecutor(MAX_CONCURRENT_PULLS, thread_name_prefix="kv-pull",
                                         initializer=single_threaded_torch)
        self._registers = ThreadPoolExecutor(1, thread_name_prefix="request-register",
                                             initializer=single_threaded_torch)  # fmt: skip
        self._ender = ThreadPoolExecutor(1, thread_name_prefix="request-end", initializer=single_threaded_torch)
        self._releases = ThreadPoolExecutor(MAX_CONCURRENT_PULLS, thread_name_prefix="lease-release")
        per_holder = min(runtime.config.transfer.max_pulls_per_peer, MAX_CONCURRENT_PULLS // 2)
        self._compiles = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.threads = CallThreads(self._pulls, HolderSlots(per_holder), self._registers, self._ender,
                                   self._releases, self._compiles)  # fmt: skip
        self._prefetching = ThreadPoolExecutor(MAX_CONCURRENT_PREFETCHES, thread_name_prefix="kv-prefetch",
                                               initializer=single_threaded_torch)  # fmt: skip
        self.prefetches = Prefetches(runtime, self._prefetching, MAX_CONCURRENT_PREFETCHES)
        self.drops = Drops()

    def close(self) -> None:
        """Wait for pulls, prefetches, aborts and releases handed to this service's threads."""
        self.prefetches.close()
        self._prefetching.shutdown(wait=True)
        self._pulls.shutdown(wait=True)
        self._registers.shutdown(wait=True)
        self._ender.shutdown(wait=True)
        self._releases.shutdown(wait=True)
        self._compiles.shutdown(wait=True)

    def prefetch(self, spec: RequestSpec, address: str) -> bool:
        """Start pulling ``spec``'s prompt blocks from the prefill worker at ``address`` while it
        prefills them (``decode_worker/prefetch.py``); False when declined. ``generate`` for the
        same request ends it, and so does ``drop``, also when it came first."""
        if self.drops.kept(spec.request_id):
            return False
        return self.prefetches.start(spec, address)

    def drop(self, request_id: str) -> bool:
        """End ``request_id``'s stream (the router stopped reading it): at its next read if it
        runs (True), as it begins if it has not (False). Its prefetch, if any, stops."""
        self.prefetches.stop(request_id)
        return self.drops.drop(request_id)

    async def generate(self, spec: RequestSpec, prefill: PrefillResult | None = None) -> AsyncIterator[DecodeEvent]:
        queue: asyncio.Queue[Outcome] = asyncio.Queue()

        def on_drop() -> None:
            queue.put_nowait(Dropped(spec.request_id))

        begun = self.drops.begin(spec.request_id, on_drop)
        try:
            async with contextlib.aclosing(self._generate(spec, prefill, queue, begun)) as events:
                async for event in events:
                    yield event
        finally:
            self.drops.end(spec.request_id, on_drop)

    async def _generate(self, spec: RequestSpec, prefill: PrefillResult | None, queue: asyncio.Queue[Outcome],
                        begun: bool) -> AsyncIterator[DecodeEvent]:  # fmt: skip
        """``generate``, its outputs delivered to ``queue``; nothing but the lease's release when it
        was dropped before it began (``begun`` False)."""
        rt = self.rt
        aloop = asyncio.get_running_loop()

        def on_output(out: Outcome) -> None:
            aloop.call_soon_threadsafe(queue.put_nowait, out)

        local_hit = transferred = recomputed = 0
        # The prompt is computed here (locally, or again after a failed pull) and not yet counted.
        computes_prompt = prefill is None
        self.prefetches.stop(spec.request_id)  # the request is here: its own pull takes what is left
        # The call owns the request and the lease from here on, and ends both.
        async with DecodeCall(rt, spec, prefill, self.threads) as call:
            if not begun:
                return  # dropped before it began: the call's exit releases the lease
            await call.build()
            if prefill is not None:
                await call.stage()
            load = await call.register(on_output)
            if prefill is not None:
                if call.filled is not None:
                    local_hit, transferred = call.filled.num_local_hit_tokens, call.filled.num_external_tokens
                elif load is not None and await call.pull(load):
                    local_hit, transferred = load.num_local_hit_tokens, load.num_external_tokens
                else:
                    call.settle_lease(pulled=None)  # recomputed here: the prefill worker's blocks are of no use
                    computes_prompt = True
            pending: Outcome | None = None
            while True:
                out = pending if pending is not None else await queue.get()
                pending = None
                if isinstance(out, Dropped):
                    return  # nobody reads this stream: the call's exit aborts the request
                if isinstance(out, BaseException):
                    raise out
                if computes_prompt:
                    # Counted once the engine knows its prefix hit (set at first scheduling).
                    local_hit = out.num_cached_tokens
                    computed = max(out.num_prompt_tokens - local_hit, 0)
                    if prefill is None:
                        rt.stats.record({"prefill_computed_tokens": computed}, spec.cache_salt)
                    else:
                        recomputed = computed
                        rt.stats.record({"recomputed_tokens": recomputed}, spec.cache_salt)
                    computes_prompt = False
                # Steps the engine finished while this loop waited (a busy event loop, a slow consumer)
                # go out as one event: one message to the router for several tokens, not one each.
                tokens, logprobs = list(out.new_token_ids), None if out.logprobs is None else list(out.logprobs)
                while not out.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        pending = nxt
                        break
                    tokens += nxt.new_token_ids
                    if logprobs is not None and nxt.logprobs is not None:
                        logprobs += nxt.logprobs
                    out = nxt
                if tokens or out.finished:
                    yield DecodeEvent(
                        spec.request_id, tuple(tokens), out.finished, out.finish_reason,
                        local_hit, transferred, recomputed, None if logprobs is None else tuple(logprobs),
                        pull_bytes=call.pulled_bytes,
                    )  # fmt: skip
                if out.finished:
                    return
