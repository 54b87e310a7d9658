"""DecodeService: take over a prefilled request (pull its KV) or prefill locally, then stream tokens."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from engine.engine import RequestOutput
from engine.request import Request
from kvtransfer.client import KVTransferClient
from kvtransfer.errors import LayoutMismatchError, PeerUnavailableError, TransferError
from kvtransfer.handoff import DecodeEvent, PrefillResult, RequestSpec
from kvtransfer.pull import KVPullResult, pull_request_kv
from kvtransfer.worker_runtime import WorkerRuntime

logger = logging.getLogger(__name__)


class DecodeService:
    """Plain-Python core of the decode worker (the Ray actor is a shell around it).

    ``generate`` yields DecodeEvents until the request finishes. Whatever happens (the
    consumer stops iterating, is cancelled, or a pull fails) the request's blocks are
    back in the pool when the generator closes, and the prefill worker's lease is
    released once this worker will not pull it. A failed pull is not an error for the
    client: the prompt is recomputed here and counted in ``recomputed_tokens``.
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self._tasks: set[asyncio.Task[None]] = set()

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` without awaiting it (a reference is kept until it is done)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pull(self, spec: RequestSpec, prefill: PrefillResult, req: Request) -> KVPullResult | None:
        """Pull the prompt's KV into this pool; None when it must be recomputed instead."""
        rt = self.rt
        used: list[KVTransferClient] = []

        def work() -> KVPullResult | None:
            client = rt.client(prefill.address)
            used.append(client)
            return pull_request_kv(
                rt.engine.kv, rt.engine.kv_cache, req, client, req.num_prompt_tokens,
                lease_id=prefill.lease_id, lock=rt.engine.lock,
            )  # fmt: skip

        # The pull thread cannot be interrupted, and it frees what it allocated when it fails.
        # So whatever cancellations arrive, wait until it is done before anyone may free the
        # request's blocks (they could still be being written), then re-raise the cancel.
        fut = asyncio.ensure_future(asyncio.to_thread(work))
        cancelled = False
        while not fut.done():
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                cancelled = True
            except BaseException:  # noqa: BLE001 - read from the future below
                break
        if cancelled:
            if not fut.cancelled():
                fut.exception()  # retrieved: the outcome no longer matters
            raise asyncio.CancelledError
        try:
            result = fut.result()
        except TransferError as exc:
            logger.warning("pull of %s from %s failed (%s); recomputing", spec.request_id, prefill.address, exc)
            if isinstance(exc, (PeerUnavailableError, LayoutMismatchError)):
                rt.drop_client(prefill.address, used[0] if used else None)
            rt.stats.record({"transfer_failures": 1}, spec.cache_salt)
            return None
        except Exception:  # noqa: BLE001 - a bug in the pull must not fail the request
            logger.exception("pull of %s from %s failed; recomputing", spec.request_id, prefill.address)
            rt.stats.record({"transfer_failures": 1}, spec.cache_salt)
            return None
        return result

    async def _release(self, prefill: PrefillResult) -> None:
        """Best effort: a lease this worker will not pull goes back now, not after its TTL."""
        if not prefill.lease_id:
            return
        try:
            await asyncio.to_thread(self.rt.release_lease, prefill.address, prefill.lease_id)
        except Exception as exc:  # noqa: BLE001 - the lease expires by itself
            logger.debug("release of lease %s failed: %s", prefill.lease_id, exc)

    async def generate(self, spec: RequestSpec, prefill: PrefillResult | None = None) -> AsyncIterator[DecodeEvent]:
        rt = self.rt
        aloop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def on_output(out: RequestOutput | BaseException) -> None:
            aloop.call_soon_threadsafe(queue.put_nowait, out)

        local_hit = transferred = recomputed = 0
        lease_settled = False  # a successful pull released the lease, or this worker gave it back
        # The prompt is computed here (locally, or again after a failed pull) and not yet counted.
        computes_prompt = prefill is None
        try:
            req = rt.engine.make_request(spec.prompt_token_ids, spec.params, spec.request_id, spec.cache_salt)
            if prefill is None:
                rt.loop.submit(req, on_output)
            else:
                result = await self._pull(spec, prefill, req)
                # The first token came from the prefill worker; a seeded stream continues after it.
                req.append_output_token(prefill.first_token)
                rt.engine.runner.sampler.skip_draws(
                    req.request_id, req.sampling_params, rt.engine.model_config.vocab_size, rt.engine.device, 1
                )
                if result is None:
                    # Recompute here; the prefill worker's blocks are of no use any more. The
                    # release runs beside the recompute: a hung peer must not delay it.
                    self._in_background(self._release(prefill))
                    lease_settled = computes_prompt = True
                    rt.loop.submit(req, on_output)
                else:
                    lease_settled = True
                    local_hit, transferred = result.num_local_hit_tokens, result.num_external_tokens
                    rt.loop.submit(req, on_output, running=True)
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if computes_prompt:
                    # Counted once the engine knows its prefix hit (set at first scheduling).
                    local_hit = out.num_cached_tokens
                    computed = max(req.num_prompt_tokens - local_hit, 0)
                    if prefill is None:
                        rt.stats.record({"prefill_computed_tokens": computed}, spec.cache_salt)
                    else:
                        recomputed = computed
                        rt.stats.record({"recomputed_tokens": recomputed}, spec.cache_salt)
                    computes_prompt = False
                if out.new_token_ids or out.finished:
                    yield DecodeEvent(
                        spec.request_id, tuple(out.new_token_ids), out.finished, out.finish_reason,
                        local_hit, transferred, recomputed,
                    )  # fmt: skip
                if out.finished:
                    return
        finally:
            # Cancelled, consumer gone or failed: the engine drops the request and its blocks.
            await asyncio.to_thread(rt.drop_request, spec.request_id)
            if prefill is not None and not lease_settled:
                await self._release(prefill)
