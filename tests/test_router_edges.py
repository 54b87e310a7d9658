"""Router edges without Ray: request validation (to_spec) and binding the public port."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from engine.model import load_tokenizer, make_tiny_model
from pdserve.v1 import router_pb2 as pb
from router.actor import Router
from router.core import RouterConfig
from router.servicer import InvalidRequest, ModelLimits, to_spec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1))


def test_request_larger_than_a_pool_is_refused_before_any_work(model_dir: str) -> None:
    tok = load_tokenizer(model_dir)
    limits = ModelLimits(vocab_size=258, max_model_len=1024, block_size=16, kv_blocks=8)
    ok = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100), sampling=pb.SamplingOptions(max_tokens=28))
    assert len(to_spec(ok, tok, limits).prompt_token_ids) == 100  # 128 tokens = 8 blocks: fits
    big = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100), sampling=pb.SamplingOptions(max_tokens=29))
    with pytest.raises(InvalidRequest, match=r"sampling\.max_tokens: .* need 9 KV blocks, a worker's pool has 8"):
        to_spec(big, tok, limits)
    # max_model_len caps what a request can grow to, as in the engine.
    capped = ModelLimits(vocab_size=258, max_model_len=128, block_size=16, kv_blocks=8)
    assert to_spec(big, tok, capped).params.max_tokens == 29


def test_taken_port_is_an_error_not_shared(model_dir: str) -> None:
    """gRPC's default SO_REUSEPORT would let a second server share a port; the router refuses."""
    other = grpc.server(futures.ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    router = Router(model_dir, RouterConfig(), "redis://127.0.0.1:1/0", "edges", {}, {})
    try:
        with pytest.raises(OSError, match=f"cannot bind the router to 127.0.0.1:{port}"):
            asyncio.run(router.start("127.0.0.1", port))
    finally:
        other.stop(None)


def test_service_config_types_are_checked(tmp_path) -> None:
    from router.service_config import ServiceConfig

    assert ServiceConfig(load_weight=2, dtype=None).load_weight == 2  # an int is a fine number
    for bad, needle in [
        ({"prefill": "2"}, "prefill must be an integer, got '2'"),
        ({"port": 1.5}, "port must be an integer"),
        ({"cpu_onednn": 1}, "cpu_onednn must be true or false"),
        ({"model": 3}, "model must be a string or null"),
        ({"load_weight": True}, "load_weight must be a number"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ServiceConfig(**bad)
    path = tmp_path / "c.json"
    path.write_text('"just a string"')
    with pytest.raises(ValueError, match="must be a JSON object"):
        ServiceConfig.load(path)
