"""Dropping a call by its request id (``worker/drops.py``), the router's backstop for a Ray cancel
that never reached the call: ``DecodeService`` and ``PrefillService`` over real WorkerRuntimes (real
gRPC KV transfer, real Redis)."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pdserve import SamplingParams
from pdserve.decode_worker.service import DecodeService
from pdserve.prefill_worker.service import PrefillService
from pdserve.worker.drops import Dropped
from pdserve.worker.messages import RequestSpec
from pdserve.worker.runtime import WorkerRuntime
from tests.support.polling import wait_until, wait_until_async
from tests.support.redis import unique_namespace
from tests.workers.test_worker_services import metric, runtime


@contextmanager
def prefill_and_decode(model: str, url: str, num_blocks: int = 64) -> Iterator[tuple[WorkerRuntime, DecodeService]]:
    """A prefill runtime and a decode service over one namespace, closed on the way out."""
    ns = unique_namespace()
    prt = runtime(model, url, ns, "prefill-0", "prefill", num_blocks=num_blocks)
    drt = runtime(model, url, ns, "decode-0", "decode", num_blocks=num_blocks)
    service = DecodeService(drt)
    try:
        yield prt, service
    finally:
        service.close()
        drt.close()
        prt.close()


def test_a_stream_nobody_reads_ends_when_dropped_and_gives_every_block_back(tiny_model: str, redis_server) -> None:
    """A handed-over request decoding 2000 tokens, its stream left unread and never cancelled (a lost
    cancel): the drop ends it before it runs out. Its blocks return, nothing stays registered, and
    the prefill worker's lease was released."""
    with prefill_and_decode(tiny_model, redis_server.url, num_blocks=256) as (prt, service):
        drt = service.rt
        spec = RequestSpec("unread", tuple(range(1, 41)), SamplingParams(max_tokens=2000, ignore_eos=True))

        async def run() -> int:
            pre = await PrefillService(prt).prefill(spec)
            gen = service.generate(spec, pre)
            first = await anext(gen)
            assert not first.finished
            # Ray reads the stream on and forwards it; the router no longer takes it.
            reader = asyncio.ensure_future(_drain(gen))
            assert service.drop("unread") is True
            tokens = await asyncio.wait_for(reader, timeout=60)
            return len(first.token_ids) + tokens

        produced = asyncio.run(run())
        assert produced < 2000  # ended by the drop, not by running out
        assert wait_until(lambda: prt.pool_state()["leases"] == 0)
        state = drt.pool_state()
        assert state["requests"] == state["registered"] == 0 and state["free_blocks"] == state["num_blocks"], state
        assert service.drops.num_running == 0


async def _drain(gen) -> int:  # noqa: ANN001 - an async iterator of DecodeEvents
    n = 0
    async for ev in gen:
        assert not ev.finished  # a dropped stream ends without a finished event
        n += len(ev.token_ids)
    return n


def test_a_stream_dropped_before_it_began_registers_nothing_and_releases_the_lease(tiny_model: str,
                                                                                   redis_server) -> None:  # fmt: skip
    """The drop comes first (the router gave up while the stream was on its way): the stream yields
    nothing, registers nothing, and the prefill worker's lease is released at once."""
    with prefill_and_decode(tiny_model, redis_server.url) as (prt, service):
        drt = service.rt
        spec = RequestSpec("early", tuple(range(1, 41)), SamplingParams(max_tokens=50, ignore_eos=True))

        async def run() -> list:
            pre = await PrefillService(prt).prefill(spec)
            assert prt.pool_state()["leases"] == 1
            assert service.drop("early") is False
            events = [ev async for ev in service.generate(spec, pre)]
            assert await wait_until_async(lambda: prt.pool_state()["leases"] == 0)
            return events

        assert asyncio.run(run()) == []
        state = drt.pool_state()
        assert state["requests"] == state["registered"] == 0 and state["free_blocks"] == state["num_blocks"], state
        assert prt.pool_state()["free_blocks"] == prt.pool_state()["num_blocks"]



def test_a_prefill_dropped_while_queued_ends_holding_nothing(tiny_model: str, redis_server) -> None:
    """The drop comes while the prefill waits for the engine (a step holds its lock): its
    registration still lands, after it, and then the prefill raises ``Dropped``, its blocks and
    registration are gone, no lease was taken, and its id is free."""
    with prefill_and_decode(tiny_model, redis_server.url) as (prt, _):
        service = PrefillService(prt)
        spec = RequestSpec("queued", tuple(range(1, 41)), SamplingParams(max_tokens=5))

        async def run() -> None:
            with prt.engine.lock:  # no step and no registration until the drop has landed
                task = asyncio.ensure_future(service.prefill(spec))
                assert await wait_until_async(lambda: service.drops.num_running == 1)
                assert service.drop("queued") is True
                assert not task.done()  # the event loop is free meanwhile: it answered the drop
            with pytest.raises(Dropped):
                await task

        asyncio.run(run())
        state = prt.pool_state()
        assert state["requests"] == state["registered"] == state["leases"] == 0, state
        assert state["free_blocks"] == state["num_blocks"] and service.drops.num_running == 0
        prt.engine.make_request([1, 2, 3], SamplingParams(), "queued")  # the id is free again


def test_a_prefill_dropped_and_cancelled_while_it_registers_leaves_no_error_behind(
    tiny_model: str, redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    """The router drops and cancels a prefill whose registration waits for the engine: the drop's
    error is read (asyncio logs none as never retrieved), and the request ends holding nothing."""
    with prefill_and_decode(tiny_model, redis_server.url) as (prt, _):
        service = PrefillService(prt)
        spec = RequestSpec("both", tuple(range(1, 41)), SamplingParams(max_tokens=5))

        async def run() -> None:
            with prt.engine.lock:
                task = asyncio.ensure_future(service.prefill(spec))
                assert await wait_until_async(lambda: service.drops.num_running == 1)
                assert service.drop("both") is True
                task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gc.collect()  # a future whose exception nobody read is logged when it is collected
            await asyncio.sleep(0)

        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run(run())
        assert not [r for r in caplog.records if r.name == "asyncio"], caplog.text
        service.close()
        state = prt.pool_state()
        assert state["requests"] == state["registered"] == state["leases"] == 0, state
        assert state["free_blocks"] == state["num_blocks"]


def test_a_prefill_dropped_before_it_began_submits_nothing(tiny_model: str, redis_server) -> None:
    with prefill_and_decode(tiny_model, redis_server.url) as (prt, _):
        service = PrefillService(prt)
        assert service.drop("early") is False
        with pytest.raises(Dropped):
            asyncio.run(service.prefill(RequestSpec("early", tuple(range(1, 41)), SamplingParams(max_tokens=5))))
        state = prt.pool_state()
        assert state["requests"] == state["leases"] == 0 and state["free_blocks"] == state["num_blocks"], state
        assert metric(prt, "pdserve_prefix_cache_queries_total") == 0  # never scheduled


def test_a_dropped_request_stops_its_prefetch_and_takes_no_new_one(
    tiny_model: str, redis_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client left while its prompt was prefilled and prefetched: the drop ends the prefetch,
    which would otherwise poll for blocks that never come for its whole idle time (set to an hour
    here), and a prefetch that comes after the drop is declined. Every block is back."""
    monkeypatch.setattr("pdserve.decode_worker.prefetch.IDLE_S", 3600.0)
    monkeypatch.setattr("pdserve.decode_worker.prefetch.PREFIX_WAIT_S", 0.1)
    with prefill_and_decode(tiny_model, redis_server.url) as (prt, service):
        spec = RequestSpec("left", tuple(range(300, 400)), SamplingParams(max_tokens=2))
        assert service.prefetch(spec, prt.address)
        assert service.prefetches.running() == 1
        assert service.drop("left") is False  # no stream yet: kept for one
        assert wait_until(lambda: service.prefetches.running() == 0, timeout=30)
        assert not service.prefetch(spec, prt.address)  # came after the drop
        state = service.rt.pool_state()
        assert state["free_blocks"] == state["num_blocks"], state
        service.rt.engine.handover.check_invariants()
