"""Dropping a decode stream by its request id (``decode_worker/streams.py``): the router's backstop
for a Ray cancel that never reached the stream. ``Streams`` alone, then ``DecodeService`` over real
WorkerRuntimes (real gRPC KV transfer, real Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pdserve import SamplingParams
from pdserve.decode_worker.service import DecodeService
from pdserve.decode_worker.streams import Dropped, Streams
from pdserve.prefill_worker.service import PrefillService
from pdserve.worker.messages import RequestSpec
from pdserve.worker.runtime import WorkerRuntime
from tests.support.polling import wait_until, wait_until_async
from tests.support.redis import unique_namespace
from tests.workers.test_worker_services import runtime


def test_a_drop_reaches_the_open_stream_of_its_id_only() -> None:
    async def run() -> None:
        streams = Streams()
        a, b = streams.open("a"), streams.open("b")
        assert a is not None and b is not None and streams.num_open == 2
        assert streams.drop("a") is True
        assert isinstance(a.get_nowait(), Dropped) and b.empty()
        streams.close("a", a)
        streams.close("b", b)
        assert streams.num_open == 0 and streams.num_kept == 0

    asyncio.run(run())


def test_a_drop_before_its_stream_opened_ends_that_stream_once_within_keep_s() -> None:
    now = [0.0]

    async def run() -> None:
        streams = Streams(keep_s=60.0, clock=lambda: now[0])
        assert streams.drop("early") is False and streams.num_kept == 1
        assert streams.open("early") is None  # ended as it opens
        assert streams.open("early") is not None  # once: the drop is used up
        streams.drop("late")
        now[0] = 61.0
        assert streams.open("late") is not None and streams.num_kept == 0  # kept keep_s, no longer

    asyncio.run(run())


def test_drops_kept_are_bounded_the_oldest_forgotten_first() -> None:
    async def run() -> None:
        streams = Streams(max_kept=3)
        for i in range(5):
            streams.drop(f"r{i}")
        assert streams.num_kept == 3
        assert streams.open("r1") is not None and streams.open("r2") is None

    asyncio.run(run())


def test_a_second_stream_of_an_open_id_does_not_take_the_first_ones_drops() -> None:
    async def run() -> None:
        streams = Streams()
        first, second = streams.open("r"), streams.open("r")
        assert first is not None and second is not None and first is not second
        streams.close("r", second)  # the second ends (its registration failed): the first is still reachable
        assert streams.drop("r") is True and isinstance(first.get_nowait(), Dropped)

    asyncio.run(run())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="keep_s"):
        Streams(keep_s=0)


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
        assert service.streams.num_open == 0


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

