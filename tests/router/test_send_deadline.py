"""A gRPC client that stops reading its stream: the router's next message waits at most the send
deadline, then the call ends and so does its request (admission slot back, the worker's stream
closed). Over a real grpc.aio server and the real router core; the workers are scripted (plain
Python objects that stand for the fleet); Redis is the real embedded server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest

from pdserve.engine.config import CacheConfig
from pdserve.engine.limits import RequestLimits
from pdserve.engine.model import load_tokenizer
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.lookup import PrefixLookup
from pdserve.kvindex.stats import StatsRecorder
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.servicer import RouterServicer, add_router_to_server
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from tests.support.polling import wait_until_async
from tests.support.redis import unique_namespace


class EndlessWorkers:
    """A prefill that returns one token, and a decode stream of 512-token events that never ends
    by itself; ``closed`` is set when the router closes it."""

    prefill_ids = ["p0"]
    decode_ids = ["d0"]

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.sent = 0

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult:
        return PrefillResult(spec.request_id, 7, False, None, "lease-1", "127.0.0.1:1", worker_id,
                             len(spec.prompt_token_ids), 0)  # fmt: skip

    async def decode(self, worker_id: str, spec: RequestSpec,
                     prefill: PrefillResult | None) -> AsyncIterator[DecodeEvent]:  # fmt: skip
        try:
            while True:
                self.sent += 1
                yield DecodeEvent(spec.request_id, tuple(range(100, 612)), False, None)
                await asyncio.sleep(0)
        finally:
            self.closed.set()

    def prefetch(self, decode_id: str, spec: RequestSpec, prefill_id: str) -> None:
        pass

    def release(self, worker_id: str, lease_id: str) -> None:
        pass


def serve(redis_server, tiny_model: str, client: Callable[[pb_grpc.RouterStub, EndlessWorkers, RouterCore],  # noqa: ANN001
                                                          Awaitable[None]]) -> None:  # fmt: skip
    """``client`` against a real grpc.aio server of a router servicer over endless workers, with
    a send deadline of 0.5 s."""
    workers = EndlessWorkers()
    index = IndexConfig(redis_server.url, namespace=unique_namespace())
    core = RouterCore(RouterConfig(local_prefill_threshold=0), CacheConfig(block_size=16), workers,
                      PrefixLookup(index), StatsRecorder(index))  # fmt: skip
    limits = RequestLimits(vocab_size=1000, max_model_len=1 << 30, block_size=16)
    servicer = RouterServicer(core, load_tokenizer(tiny_model), limits, send_timeout_s=0.5)

    async def main() -> None:
        server = grpc.aio.server()
        add_router_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            await client(pb_grpc.RouterStub(channel), workers, core)
        finally:
            await channel.close()
            await server.stop(0)
            core.close()

    asyncio.run(main())


REQUEST = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 41))),
                             sampling=pb.SamplingOptions(max_tokens=1 << 29, ignore_eos=True))  # fmt: skip


def test_a_grpc_client_that_stops_reading_is_cut_off_at_the_send_deadline(redis_server, tiny_model: str) -> None:  # noqa: ANN001
    async def client(stub: pb_grpc.RouterStub, workers: EndlessWorkers, core: RouterCore) -> None:
        call = stub.Generate(REQUEST)
        first = await call.read()  # one message, then nothing more is read
        assert first.token_ids
        await asyncio.wait_for(workers.closed.wait(), timeout=60)
        assert await wait_until_async(lambda: core.admission.in_flight == 0, timeout=30)
        assert workers.sent > 1
        call.cancel()

    serve(redis_server, tiny_model, client)


def test_a_grpc_client_that_cancels_mid_stream_ends_its_request_quietly(redis_server, tiny_model: str,  # noqa: ANN001
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Clients that cancel while their stream is written: each request ends, and nothing is logged
    as a failure (a write to a call that is over is the client leaving, not an error)."""
    async def client(stub: pb_grpc.RouterStub, workers: EndlessWorkers, core: RouterCore) -> None:
        for _ in range(20):
            workers.closed.clear()
            call = stub.Generate(REQUEST)
            assert (await call.read()).token_ids
            call.cancel()
            await asyncio.wait_for(workers.closed.wait(), timeout=60)
        assert await wait_until_async(lambda: core.admission.in_flight == 0, timeout=30)

    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        serve(redis_server, tiny_model, client)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
