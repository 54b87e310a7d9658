"""vLLM's routes (/tokenize, /detokenize, /version), the chat stream's first chunk and the API key,
against a real router's HTTP and gRPC servers in this process (no workers behind it: nothing here
reaches the router core), checked against transformers' tokenizer and the ``openai`` package's
typed models. tests/e2e/test_http_vllm.py runs the same against a whole service."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai.types.chat import ChatCompletionChunk

from pdserve.engine.config import EngineConfig
from pdserve.kvindex.config import IndexConfig
from pdserve.router.actor import Router
from pdserve.router.auth import bearer_matches
from pdserve.router.config import RouterConfig
from pdserve.router.openai_responses import ChoiceState, LogprobFormat, ResponseHead, chat_chunk, role_chunk, usage_body
from pdserve.router.output import Chunk, Usage
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc

KEY = "sk-test-0123456789abcdef"


def run_router(tiny_model: str, config: RouterConfig,
               test: Callable[[Router, str, str], Coroutine[Any, Any, None]]) -> None:  # fmt: skip
    """``test(router, http_address, grpc_address)`` against a router serving both edges."""
    router = Router(config, EngineConfig(tiny_model), IndexConfig("redis://127.0.0.1:1/0", namespace="vllm"), {}, {})

    async def main() -> None:
        grpc_port = await router.start("127.0.0.1", 0)
        http_port = await router.start_http("127.0.0.1", 0)
        try:
            await test(router, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}")
        finally:
            await router.stop()

    asyncio.run(main())


def test_tokenize_and_detokenize_answer_as_transformers(tiny_model: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)
    name = Path(tiny_model).name
    text = "The quick brown fox, ünïcödé 😀"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    chat_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    rendered = hf.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)

    async def test(router: Router, address: str, _grpc: str) -> None:
        max_len = router.openai.model.max_model_len
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=60) as client:
            async def tokens(**body: Any) -> dict:
                r = await client.post("/tokenize", json=body)
                assert r.status_code == 200, r.text
                assert set(r.json()) == {"count", "max_model_len", "tokens", "token_strs"}
                return r.json()

            out = await tokens(model=name, prompt=text)
            assert out["tokens"] == hf(text)["input_ids"] and out["count"] == len(out["tokens"])
            assert out["max_model_len"] == max_len and out["token_strs"] is None
            bare = await tokens(prompt=text, add_special_tokens=False, return_token_strs=True)  # model: optional
            assert bare["tokens"] == hf(text, add_special_tokens=False)["input_ids"]
            assert bare["token_strs"] == hf.convert_ids_to_tokens(bare["tokens"])
            chat = await tokens(model=tiny_model, messages=messages)  # the path it was loaded from names it too
            assert chat["tokens"] == list(chat_ids)
            no_gen = await tokens(model=name, messages=messages, add_generation_prompt=False)
            assert no_gen["tokens"] == hf(rendered, add_special_tokens=False)["input_ids"]
            with_special = await tokens(model=name, messages=messages, add_generation_prompt=False,
                                        add_special_tokens=True)  # fmt: skip
            assert with_special["tokens"] == hf(rendered)["input_ids"]
            for ids in (out["tokens"], chat["tokens"], []):
                r = await client.post("/detokenize", json={"model": name, "tokens": ids})
                assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids)}, r.text
            assert (await client.get("/version")).json() == {"version": importlib.metadata.version("pdserve")}

    run_router(tiny_model, RouterConfig(), test)


def test_tokenize_refusals_are_openai_error_objects(tiny_model: str) -> None:
    name = Path(tiny_model).name
    messages = [{"role": "user", "content": "hi"}]
    bad = [
        ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model_not_found"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model_not_found"),
        ("/tokenize", {"model": name}, 400, "exactly one of prompt"),
        ("/tokenize", {"model": name, "prompt": "hi", "messages": messages}, 400, "exactly one of prompt"),
        ("/tokenize", {"model": name, "prompt": ""}, 400, "must not be empty"),
        ("/tokenize", {"model": name, "prompt": "x" * 100_000}, 400, "max_model_len"),
        ("/tokenize", {"model": name, "prompt": 5}, 400, "prompt"),
        ("/tokenize", {"model": name, "messages": messages, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        ("/tokenize", {"model": name, "messages": messages, "chat_template_kwargs": {"bos_token": "x"}}, 400,
         "chat_template_kwargs.bos_token"),
        ("/tokenize", {"model": name, "messages": messages, "continue_final_message": True}, 400,
         "continue_final_message"),
        ("/tokenize", {"model": name, "prompt": "a\ud800"}, 400, "lone surrogate"),
        ("/detokenize", {"model": name, "tokens": [1, 1 << 40]}, 400, "tokens[1]"),
        ("/detokenize", {"model": name, "tokens": [-1]}, 400, "outside the vocabulary"),
        ("/detokenize", {"model": name, "tokens": [1] * 100_000}, 400, "at most max_model_len"),
        ("/detokenize", {"model": name, "tokens": "abc"}, 400, "tokens"),
    ]

    async def test(_router: Router, address: str, _grpc: str) -> None:
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=60) as client:
            for path, body, status, needle in bad:
                content = json.dumps(body).encode()  # ASCII escapes: "\\ud800" stays a lone surrogate
                r = await client.post(path, content=content, headers={"content-type": "application/json"})
                assert r.status_code == status, (body, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, r.text
                assert needle in err["message"] + str(err["code"]), (body, r.text)

    run_router(tiny_model, RouterConfig(), test)


def test_the_chat_stream_opens_each_choice_with_the_role_alone() -> None:
    """OpenAI's and vLLM's shape: ``{"role": "assistant", "content": ""}``, then the text."""
    head = ResponseHead("chatcmpl-1", "m")
    usage = Usage(prompt_tokens=7, completion_tokens=1)
    first = role_chunk(head, 2)
    parsed = ChatCompletionChunk.model_validate(first)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert parsed.choices[0].index == 2 and parsed.choices[0].finish_reason is None and parsed.usage is None
    with_usage = ChatCompletionChunk.model_validate(role_chunk(head, 0, usage_body([usage], 0)))
    assert with_usage.usage is not None
    assert (with_usage.usage.prompt_tokens, with_usage.usage.completion_tokens) == (7, 0)
    state = ChoiceState(started=True)
    fmt = LogprobFormat(None)  # type: ignore[arg-type]  # no logprobs asked
    text = chat_chunk(head, 0, state, Chunk([5], "Hi", False, None, usage), fmt, False)
    assert text["choices"][0]["delta"] == {"content": "Hi"}
    last = ChatCompletionChunk.model_validate(chat_chunk(head, 0, state, Chunk([6], "", True, "length", usage),
                                                         fmt, False))  # fmt: skip
    assert last.choices[0].delta.role is None and last.choices[0].finish_reason == "length"


def test_bearer_matches_only_the_key() -> None:
    key = KEY.encode()
    assert bearer_matches(f"Bearer {KEY}", key) and bearer_matches(f"bearer  {KEY} ".encode(), key)
    for value in (None, "", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}", "Bearer", f"Token {KEY}"):
        assert not bearer_matches(value, key), value


def test_api_key_config_reads_the_environment_and_never_shows_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    config = RouterConfig()
    assert config.api_key == KEY and KEY not in repr(config)
    monkeypatch.setenv("PDSERVE_API_KEY", "")
    assert RouterConfig().api_key is None
    for bad in ("", "has space", "tab\tkey", "ünï"):
        with pytest.raises(ValueError, match="api_key must be") as e:
            RouterConfig(api_key=bad)
        assert not bad or bad not in str(e.value)


def test_the_api_key_guards_both_edges_but_not_health_or_metrics(tiny_model: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    name = Path(tiny_model).name

    async def test(router: Router, address: str, grpc_address: str) -> None:
        url = f"http://{address}"
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            paths = (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                     ("POST", "/detokenize"), ("GET", "/version"), ("GET", "/no-such-path"))  # fmt: skip
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):  # fmt: skip
                for method, path in paths:
                    r = await client.request(method, path, headers=headers, json={"model": name, "prompt": "hi"})
                    assert r.status_code == 401, (headers, path, r.text)
                    assert r.headers["www-authenticate"] == "Bearer"
                    assert r.json()["error"]["code"] == "invalid_api_key" and KEY not in r.text
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ping")).status_code == (await client.post("/ping")).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
            ok = {"Authorization": f"Bearer {KEY}"}
            assert (await client.get("/v1/models", headers=ok)).json()["data"][0]["id"] == name
            assert (await client.post("/tokenize", headers=ok, json={"prompt": "hi"})).json()["count"] > 0
            assert (await client.get("/version", headers=ok)).status_code == 200
        # The official client: its api_key is the bearer token.
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError) as e:
                await wrong.models.list()
            assert e.value.body["code"] == "invalid_api_key"
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as right:
            assert [m.id for m in (await right.models.list()).data] == [name]
        assert router.http_edge.rejected["unauthorized"] == 25
        await check_grpc(grpc_address)

    with caplog.at_level(logging.INFO, logger="pdserve"):
        run_router(tiny_model, RouterConfig(api_key=KEY), test)
    access = [r for r in caplog.records if r.name == "pdserve.access"]
    refused = [r for r in access if r.status == "rejected:unauthorized"]  # type: ignore[attr-defined]
    assert len(refused) == 25 and all(r.http_status == 401 for r in refused)  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if KEY in r.getMessage() or KEY in str(r.__dict__)]


async def check_grpc(address: str) -> None:
    """No key, a wrong one: UNAUTHENTICATED; the right one gets through to the request's checks
    (an empty prompt: INVALID_ARGUMENT); health checking needs none."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        request = pb.GenerateRequest(text="")
        for metadata in (None, (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(request, metadata=metadata, timeout=30):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and KEY not in (e.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=30):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
