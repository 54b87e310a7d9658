"""A request's structured-output constraint compiles off the worker's event loop: a slow compile
(seconds for a large schema over a large vocabulary) holds up no other request. ``PrefillService``
and ``DecodeService`` over real WorkerRuntimes (real gRPC KV transfer, real Redis)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from pdserve import SamplingParams
from pdserve.engine.structured import StructuredOutputsParams
from pdserve.prefill_worker.service import PrefillService
from pdserve.worker.messages import RequestSpec
from pdserve.worker.runtime import WorkerRuntime
from tests.workers.test_decode_drop import prefill_and_decode

CONSTRAINED = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
PLAIN = SamplingParams(max_tokens=2, ignore_eos=True)


def _slow_compiles(rt: WorkerRuntime, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """``rt``'s constraint compiles wait until the returned event is set (at most 30 s, then fail)."""
    gate = threading.Event()
    structured = rt.engine.structured
    compile_: Callable = structured.state

    def slow(params: StructuredOutputsParams) -> object:
        if not gate.wait(timeout=30):
            raise TimeoutError("nothing else finished while this constraint compiled")
        return compile_(params)

    monkeypatch.setattr(structured, "state", slow)
    return gate


def test_a_slow_compile_holds_up_no_other_prefill(tiny_model: str, redis_server,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    with prefill_and_decode(tiny_model, redis_server.url) as (prt, _):
        gate = _slow_compiles(prt, monkeypatch)
        service = PrefillService(prt)
        one_token = SamplingParams(max_tokens=1, structured_outputs=CONSTRAINED.structured_outputs)

        async def run() -> None:
            compiling = asyncio.ensure_future(service.prefill(RequestSpec("constrained", (1, 2, 3), one_token)))
            plain = await asyncio.wait_for(service.prefill(RequestSpec("plain", (4, 5, 6), SamplingParams(max_tokens=1))),
                                           timeout=60)  # fmt: skip
            assert plain.finished and not compiling.done()  # the compile still waits: it ran on its thread
            gate.set()
            assert (await asyncio.wait_for(compiling, timeout=60)).finished

        try:
            asyncio.run(run())
        finally:
            gate.set()
            service.close()
        assert prt.pool_state()["requests"] == 0


def test_a_slow_compile_holds_up_no_other_decode(tiny_model: str, redis_server,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    with prefill_and_decode(tiny_model, redis_server.url) as (_, service):
        gate = _slow_compiles(service.rt, monkeypatch)

        async def tokens(spec: RequestSpec) -> list[int]:
            return [t async for ev in service.generate(spec, None) for t in ev.token_ids]

        async def run() -> None:
            compiling = asyncio.ensure_future(tokens(RequestSpec("constrained", (1, 2, 3), CONSTRAINED)))
            plain = await asyncio.wait_for(tokens(RequestSpec("plain", (4, 5, 6), PLAIN)), timeout=60)
            assert len(plain) == 2 and not compiling.done()
            gate.set()
            assert 1 <= len(await asyncio.wait_for(compiling, timeout=60)) <= 2

        try:
            asyncio.run(run())
        finally:
            gate.set()
        state = service.rt.pool_state()
        assert state["requests"] == 0 and state["free_blocks"] == state["num_blocks"], state
