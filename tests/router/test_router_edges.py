"""Router edges without Ray: request validation (to_spec) and binding the public port."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.limits import RequestLimits
from pdserve.engine.model import load_tokenizer
from pdserve.kvindex.config import IndexConfig
from pdserve.router.actor import Router
from pdserve.router.config import RouterConfig
from pdserve.router.servicer import InvalidRequest, to_spec
from pdserve.v1 import router_pb2 as pb


def test_request_larger_than_a_pool_is_refused_before_any_work(tiny_model: str) -> None:
    tok = load_tokenizer(tiny_model)
    limits = RequestLimits(vocab_size=258, max_model_len=1024, block_size=16, kv_blocks=8)
    ok = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100), sampling=pb.SamplingOptions(max_tokens=28))
    assert len(to_spec(ok, tok, limits).prompt_token_ids) == 100  # 128 tokens = 8 blocks: fits
    big = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100), sampling=pb.SamplingOptions(max_tokens=29))
    with pytest.raises(InvalidRequest, match=r"max_tokens: .* need 9 KV blocks, the pool holds 8"):
        to_spec(big, tok, limits)
    # max_model_len caps what a request can grow to, as in the engine.
    capped = RequestLimits(vocab_size=258, max_model_len=128, block_size=16, kv_blocks=8)
    assert to_spec(big, tok, capped).params.max_tokens == 29
    # A sliding window bounds what a request holds: the same request fits a windowed model.
    windowed = RequestLimits(vocab_size=258, max_model_len=1024, block_size=16, kv_blocks=8, sliding_window=32,
                             max_chunk_tokens=64)  # fmt: skip
    assert to_spec(big, tok, windowed).params.max_tokens == 29


def test_the_advertised_length_is_what_a_request_can_use(tiny_model: str) -> None:
    """/v1/models says max_model_len: the model's, or the pool's when that is smaller. A prompt one
    token shorter than it is served (one token generated); one as long is refused."""
    tok = load_tokenizer(tiny_model)
    pooled = RequestLimits(vocab_size=258, max_model_len=1024, block_size=16, kv_blocks=8)
    assert pooled.usable_len == 128
    fits = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 127), sampling=pb.SamplingOptions(max_tokens=1))
    assert to_spec(fits, tok, pooled).params.max_tokens == 1
    over = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 128), sampling=pb.SamplingOptions(max_tokens=1))
    with pytest.raises(InvalidRequest, match="need 9 KV blocks"):
        to_spec(over, tok, pooled)
    assert RequestLimits(vocab_size=258, max_model_len=100, block_size=16, kv_blocks=8).usable_len == 100
    assert RequestLimits(vocab_size=258, max_model_len=100, block_size=16).usable_len == 100


def test_taken_port_is_an_error_not_shared(tiny_model: str) -> None:
    """gRPC's default SO_REUSEPORT would let a second server share a port; the router refuses."""
    other = grpc.server(futures.ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    router = Router(RouterConfig(), EngineConfig(tiny_model), IndexConfig("redis://127.0.0.1:1/0", namespace="edges"),
                    {}, {})  # fmt: skip
    try:
        with pytest.raises(OSError, match=f"cannot bind the router to 127.0.0.1:{port}"):
            asyncio.run(router.start("127.0.0.1", port))
    finally:
        asyncio.run(router.stop())
        other.stop(None)


def spec_of(raw: bytes, tiny_model: str) -> object:
    from pdserve.router.servicer import _parse_generate_request

    limits = RequestLimits(vocab_size=258, max_model_len=1024, block_size=16)
    request = _parse_generate_request(raw)
    if isinstance(request, InvalidRequest):
        raise request
    return to_spec(request, load_tokenizer(tiny_model), limits)


def test_request_fields_are_bounded_and_wire_errors_say_what_is_wrong(tiny_model: str) -> None:
    ok = pb.GenerateRequest(text="hi")
    with pytest.raises(InvalidRequest, match="request_id: 4000000 characters, at most 128"):
        spec_of(pb.GenerateRequest(text="hi", request_id="x" * 4_000_000).SerializeToString(), tiny_model)
    with pytest.raises(InvalidRequest, match="cache_salt: 300 characters, at most 256"):
        spec_of(pb.GenerateRequest(text="hi", cache_salt="s" * 300).SerializeToString(), tiny_model)
    # text (field 2) sent as a number; sampling.max_tokens (field 1 of field 4) sent as bytes.
    with pytest.raises(InvalidRequest, match=r"GenerateRequest.text: wrong type on the wire \(varint, expected "
                                             r"length-delimited\)"):  # fmt: skip
        spec_of(b"\x10\x05", tiny_model)
    with pytest.raises(InvalidRequest, match=r"sampling.max_tokens: wrong type on the wire \(length-delimited, "
                                             r"expected varint\)"):  # fmt: skip
        spec_of(ok.SerializeToString() + b"\x22\x03\x0a\x01\x41", tiny_model)
    with pytest.raises(InvalidRequest, match=r"unknown field number\(s\) 100"):
        spec_of(ok.SerializeToString() + b"\xa0\x06\x01", tiny_model)


def test_special_tokens_in_text_are_special_unless_split(tiny_model: str) -> None:
    """As in transformers and vLLM, "</s>" typed in a prompt is the EOS token; split_special_tokens
    reads it as the four characters. Text gets the tokenizer's special tokens (the tiny model's
    post-processor adds BOS <s> = 256) unless add_special_tokens is false."""
    tok = load_tokenizer(tiny_model)
    limits = RequestLimits(vocab_size=258, max_model_len=1024, block_size=16)
    special = to_spec(pb.GenerateRequest(text="hi </s>"), tok, limits)
    split = to_spec(pb.GenerateRequest(text="hi </s>", split_special_tokens=True), tok, limits)
    bare = to_spec(pb.GenerateRequest(text="hi </s>", add_special_tokens=False), tok, limits)
    assert special.prompt_token_ids == (256, 104, 105, 32, 257)
    assert split.prompt_token_ids == (256, 104, 105, 32, *b"</s>")
    assert bare.prompt_token_ids == (104, 105, 32, 257)


def test_router_refuses_oversized_messages_keeps_answering_while_tokenizing_and_drains(tiny_model: str) -> None:
    """No workers behind it: what is checked is the edge. A 4 MB prompt is tokenized off the event
    loop (health checks answer meanwhile); a message over max_request_bytes is refused unread; a
    draining router says NOT_SERVING and refuses new requests."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.v1 import router_pb2_grpc as pb_grpc

    config = RouterConfig(max_request_bytes=8 << 20)
    router = Router(config, EngineConfig(tiny_model), IndexConfig("redis://127.0.0.1:1/0", namespace="edges"), {}, {})

    async def main() -> None:
        port = await router.start("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.RouterStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            big = stub.Generate(pb.GenerateRequest(text="lorem ipsum dolor sit amet " * 150_000), timeout=120)
            consume = asyncio.ensure_future(big.code())
            await asyncio.sleep(0.3)  # the big prompt is being tokenized now
            worst = 0.0
            while not consume.done():
                t0 = asyncio.get_running_loop().time()
                await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                worst = max(worst, asyncio.get_running_loop().time() - t0)
            assert worst < 1.0, f"a health check waited {worst:.2f}s behind the tokenizer"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text="x" * (9 << 20)), timeout=30).read()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await router.drain(0.1) == 0
            status = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text="hi"), timeout=30).read()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
        await router.stop()

    asyncio.run(main())


def test_router_over_tls_and_mutual_tls(tiny_model: str, tmp_path) -> None:  # noqa: ANN001
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.cli.client import router_channel
    from pdserve.security import TLSConfig
    from tests.support.tls import make_certs

    certs = make_certs(tmp_path)
    config = RouterConfig(tls=TLSConfig(certs.server_cert, certs.server_key, ca_file=certs.ca))
    router = Router(config, EngineConfig(tiny_model), IndexConfig("redis://127.0.0.1:1/0", namespace="edges"), {}, {})

    def check(address: str, tls: TLSConfig | None) -> bool:
        with router_channel(address, tls) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            except grpc.RpcError:
                return False
            return True

    async def main() -> None:
        port = await router.start("127.0.0.1", 0)
        address = f"localhost:{port}"
        loop = asyncio.get_running_loop()
        member = TLSConfig(certs.client_cert, certs.client_key, ca_file=certs.ca)
        assert await loop.run_in_executor(None, check, address, member)
        for tls in (None, TLSConfig(ca_file=certs.ca), TLSConfig(certs.client_cert, certs.client_key,
                                                                  ca_file=certs.other_ca)):
            assert not await loop.run_in_executor(None, check, address, tls)
        await router.stop()

    asyncio.run(main())
