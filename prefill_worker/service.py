"""PrefillService: run a prompt, sample its first token, hold its KV under a lease."""

from __future__ import annotations

import asyncio
import dataclasses

from engine.engine import RequestOutput
from kvtransfer.handoff import PrefillResult, RequestSpec
from kvtransfer.worker_runtime import WorkerRuntime


class PrefillService:
    """Plain-Python core of the prefill worker (the Ray actor is a shell around it).

    Guarantees: when ``prefill`` returns a result with a ``lease_id``, the request's
    blocks are held by that lease (released by the puller or expired after the TTL);
    in every other outcome (finished on the first token, error, cancellation) the
    request holds no blocks when ``prefill`` returns or raises.
    """

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime

    async def prefill(self, spec: RequestSpec) -> PrefillResult:
        rt = self.rt
        engine = rt.engine
        # Only the first token is sampled here; the decode worker continues with the real params.
        req = engine.make_request(
            spec.prompt_token_ids, dataclasses.replace(spec.params, max_tokens=1), spec.request_id, spec.cache_salt
        )
        req.hold_kv = True
        aloop = asyncio.get_running_loop()
        done: asyncio.Future[RequestOutput] = aloop.create_future()

        def on_output(out: RequestOutput | BaseException) -> None:
            if isinstance(out, BaseException):
                aloop.call_soon_threadsafe(lambda: done.done() or done.set_exception(out))
            elif out.finished:
                aloop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

        rt.loop.submit(req, on_output)
        leased = False
        try:
            out = await done
            if not out.new_token_ids:
                raise RuntimeError(f"prefill of {spec.request_id!r} was aborted")
            first = out.new_token_ids[0]
            # Judge the first token with the request's own limits.
            req.sampling_params = spec.params
            status = req.check_stop()
            finished = status is not None
            lease_id = None
            if not finished:
                lease_id = rt.source.lease_request(req, num_tokens=req.num_prompt_tokens)
                leased = True
            rt.stats.record(
                {"prefill_computed_tokens": req.num_prompt_tokens - max(req.num_cached_tokens, 0)}, spec.cache_salt
            )
            return PrefillResult(
                spec.request_id,
                first,
                finished,
                status.value if status else None,
                lease_id,
                rt.address,
                rt.config.worker_id,
                req.num_prompt_tokens,
                max(req.num_cached_tokens, 0),
            )
        finally:
            if not leased:
                rt.drop_request(spec.request_id)
