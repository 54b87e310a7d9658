"""DecodeService: take over a prefilled request (pull its KV) or prefill locally, then stream tokens."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from engine.engine import RequestOutput
from kvtransfer.errors import TransferError
from kvtransfer.handoff import DecodeEvent, PrefillResult, RequestSpec
from kvtransfer.pull import pull_request_kv
from kvtransfer.worker_runtime import WorkerRuntime

logger = logging.getLogger(__name__)


class DecodeService:
    """Plain-Python core of the decode worker (the Ray actor is a shell around it).

    ``generate`` yields DecodeEvents until the request finishes. Whatever happens (the
    consumer stops iterating, is cancelled, or a pull fails) the request's blocks are
    back in the pool when the generator closes. A failed pull is not an error for the
    client: the prompt is recomputed here and counted in ``recomputed_tokens``.
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime

    async def _pull(self, spec: RequestSpec, prefill: PrefillResult, req) -> tuple[int, int] | None:
        """Pull the prompt's KV; (local hit tokens, transferred tokens), or None to recompute."""
        rt = self.rt
        try:
            client = await asyncio.to_thread(rt.client, prefill.address)
            result = await asyncio.to_thread(
                pull_request_kv,
                rt.engine.kv,
                rt.engine.kv_cache,
                req,
                client,
                req.num_prompt_tokens,
                lease_id=prefill.lease_id,
                lock=rt.engine.lock,
            )
        except TransferError as exc:
            logger.warning("pull of %s from %s failed (%s); recomputing", spec.request_id, prefill.address, exc)
            rt.drop_client(prefill.address)
            rt.stats.record({"transfer_failures": 1}, spec.cache_salt)
            return None
        if result is None:  # no room to pull now: the scheduler will admit and recompute it
            return None
        return result.num_local_hit_tokens, result.num_external_tokens

    async def generate(self, spec: RequestSpec, prefill: PrefillResult | None = None) -> AsyncIterator[DecodeEvent]:
        rt = self.rt
        engine = rt.engine
        req = engine.make_request(spec.prompt_token_ids, spec.params, spec.request_id, spec.cache_salt)
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def on_output(out: RequestOutput | BaseException) -> None:
            aloop.call_soon_threadsafe(queue.put_nowait, out)

        local_hit = transferred = recomputed = 0
        submitted = False
        try:
            if prefill is None:
                rt.loop.submit(req, on_output)
            else:
                pulled = await self._pull(spec, prefill, req)
                req.append_output_token(prefill.first_token)
                if pulled is None:
                    recomputed = req.num_prompt_tokens
                    rt.stats.record({"recomputed_tokens": recomputed}, spec.cache_salt)
                    rt.loop.submit(req, on_output)
                else:
                    local_hit, transferred = pulled
                    rt.loop.submit(req, on_output, running=True)
            submitted = True
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if out.finish_reason == "abort":
                    raise RuntimeError(f"request {spec.request_id!r} was aborted")
                if prefill is None and local_hit == 0:
                    local_hit = out.num_cached_tokens
                if out.new_token_ids or out.finished:
                    yield DecodeEvent(
                        spec.request_id,
                        tuple(out.new_token_ids),
                        out.finished,
                        out.finish_reason,
                        local_hit,
                        transferred,
                        recomputed,
                    )
                if out.finished:
                    return
        finally:
            # Cancelled, consumer gone or failed: the engine drops the request and its blocks.
            rt.loop.abort(spec.request_id)
            with engine.lock:
                if engine.kv.get_blocks(spec.request_id):
                    engine.kv.free(spec.request_id)
            if not submitted and prefill is not None and prefill.lease_id:
                try:
                    rt.client(prefill.address).release(prefill.lease_id)
                except Exception:  # noqa: BLE001 - the lease expires by itself
                    pass
