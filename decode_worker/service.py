"""DecodeService: take over a prefilled request (pull its KV) or prefill locally, then stream tokens."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from pdserve.engine.engine import RequestOutput
from pdserve.engine.kv_handover import KVLoad, RemotePrefill
from pdserve.kvtransfer.client import KVTransferClient
from pdserve.kvtransfer.errors import LayoutMismatchError, PeerUnavailableError, TransferError
from pdserve.kvtransfer.pull import pull_kv, release_quietly
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from pdserve.worker.runtime import WorkerRuntime

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

    async def _pull(self, spec: RequestSpec, prefill: PrefillResult, load: KVLoad) -> bool:
        """Fill ``load`` from the prefill worker's lease and end it (``finish_load``): True when
        the KV landed, False when the request recomputes its prompt here instead."""
        rt = self.rt
        used: list[KVTransferClient] = []

        def work() -> KVTransferClient:
            # Runs to its end even if the request is cancelled meanwhile: finish_load is what
            # lets the engine free the blocks, and they may be being written until then.
            ok = False
            try:
                client = rt.client(prefill.address)
                used.append(client)
                pulled = pull_kv(client, rt.engine.handover.kv_tensor, load, lease_id=prefill.lease_id)
                rt.metrics.transfer_done(pulled.num_bytes, pulled.num_blocks, pulled.seconds)
                ok = True
            finally:
                rt.loop.finish_load(spec.request_id, ok)
            return client

        try:
            client = await asyncio.to_thread(work)
        except TransferError as exc:
            logger.warning("pull of %s from %s failed (%s); recomputing", spec.request_id, prefill.address, exc)
            if isinstance(exc, (PeerUnavailableError, LayoutMismatchError)):
                rt.drop_client(prefill.address, used[0] if used else None)
            rt.stats.record({"transfer_failures": 1}, spec.cache_salt)
            rt.metrics.transfer_failed()
            return False
        except Exception:  # noqa: BLE001 - a bug in the pull must not fail the request
            logger.exception("pull of %s from %s failed; recomputing", spec.request_id, prefill.address)
            rt.stats.record({"transfer_failures": 1}, spec.cache_salt)
            rt.metrics.transfer_failed()
            return False
        assert prefill.lease_id is not None
        # The KV is here: give the lease back now (a failure only means it expires on its own).
        await asyncio.to_thread(release_quietly, client, prefill.lease_id)
        return True

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
        registered = False  # the engine holds this call's request (an id in use elsewhere is not ours)
        lease_settled = False  # a successful pull released the lease, or this worker gave it back
        # The prompt is computed here (locally, or again after a failed pull) and not yet counted.
        computes_prompt = prefill is None
        try:
            req = rt.engine.make_request(spec.prompt_token_ids, spec.params, spec.request_id, spec.cache_salt)
            if prefill is None:
                rt.loop.submit(req, on_output)
                registered = True
            else:
                # The first token came from the prefill worker; the engine continues after it.
                remote = RemotePrefill(len(spec.prompt_token_ids), (prefill.first_token,))
                load = rt.loop.submit_remote(req, on_output, remote)
                registered = True
                pulled = load is not None and await self._pull(spec, prefill, load)
                lease_settled = True
                if pulled:
                    assert load is not None
                    local_hit, transferred = load.num_local_hit_tokens, load.num_external_tokens
                else:
                    # Recomputed here; the prefill worker's blocks are of no use any more. The
                    # release runs beside the recompute: a hung peer must not delay it.
                    self._in_background(self._release(prefill))
                    computes_prompt = True
            while True:
                out = await queue.get()
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
                if out.new_token_ids or out.finished:
                    yield DecodeEvent(
                        spec.request_id, tuple(out.new_token_ids), out.finished, out.finish_reason,
                        local_hit, transferred, recomputed, None if out.logprobs is None else tuple(out.logprobs),
                    )  # fmt: skip
                if out.finished:
                    return
        finally:
            # Cancelled, consumer gone or failed: the engine drops the request and its blocks
            # (a load still being written keeps them until its finish_load).
            if registered:
                await asyncio.to_thread(rt.loop.abort, spec.request_id)
            if prefill is not None and not lease_settled:
                await self._release(prefill)
