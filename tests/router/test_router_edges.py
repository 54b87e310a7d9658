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
