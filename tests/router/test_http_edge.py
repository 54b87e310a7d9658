"""The HTTP edge's refusals, against a real router's HTTP server in this process (uvicorn, no
workers behind it: everything here is refused before the router core): each refusal is an
OpenAI error object and writes one access-log line without the prompt; malformed Unicode is a
400 that logs no error; chat_template is refused and chat_template_kwargs checked by name."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.responses import StreamingResponse

from pdserve.engine.config import EngineConfig
from pdserve.kvindex.config import IndexConfig
from pdserve.router.actor import Router
from pdserve.router.config import RouterConfig
from pdserve.router.http import CHUNKS_AHEAD, _merged
from pdserve.router.http_limits import EdgeState, HttpLimits, guarded_protocol
from tests.support.polling import wait_until_async

SECRET = "SECRET-PROMPT-TEXT"


def run_router(tiny_model: str, config: RouterConfig, test: Callable[[Router, str], Coroutine[Any, Any, None]]) -> None:
    router = Router(config, EngineConfig(tiny_model), IndexConfig("redis://127.0.0.1:1/0", namespace="edge"), {}, {})

    async def main() -> None:
        port = await router.start_http("127.0.0.1", 0)
        try:
            await test(router, f"127.0.0.1:{port}")
        finally:
            await router.stop()

    asyncio.run(main())


async def half_sent(address: str, declared: int, sent: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {declared}\r\n\r\n".encode() + b"x" * sent)  # fmt: skip
    await writer.drain()
    return reader, writer


def test_every_refusal_is_an_error_object_and_one_access_log_line(
    tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = RouterConfig(max_request_bytes=256 * 1024, http_max_buffered_bytes=256 * 1024, http_body_timeout_s=1.0)
    name = Path(tiny_model).name

    async def test(router: Router, address: str) -> None:
        url = f"http://{address}/v1/completions"
        async with httpx.AsyncClient(timeout=60) as client:
            bad_unicode = f'{{"model": "{name}", "prompt": "{SECRET} \\ud800"}}'.encode()
            r = await client.post(url, content=bad_unicode, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            r = await client.post(url, json={"model": "nope", "prompt": SECRET})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await client.post(url, json={"model": name, "prompt": SECRET * 20_000})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            # One body holds 200 KB of the 256 KiB budget: another that declares 100 KB is refused at
            # once; a small one still gets through (to the 400 of its bad field).
            reader, writer = await half_sent(address, 250_000, 200_000)
            assert await wait_until_async(lambda: router.http_edge.buffered_bytes >= 200_000, timeout=30)
            r = await client.post(url, content=b"{" + b" " * 100_000 + b"}",
                                  headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
            r = await client.post(url, json={"model": name, "prompt": SECRET, "n": 0})
            assert r.status_code == 400
            # The held one's body never completes: 408 after http_body_timeout_s, connection closed.
            answer = await asyncio.wait_for(reader.read(), timeout=60)
            assert answer.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in answer, answer
            writer.close()
            assert await wait_until_async(lambda: router.http_edge.buffered_bytes == 0, timeout=30)

    with caplog.at_level(logging.INFO, logger="pdserve.access"):
        run_router(tiny_model, config, test)
    lines = [r for r in caplog.records if r.name == "pdserve.access"]
    assert [(r.status, r.http_status) for r in lines] == [  # type: ignore[attr-defined]
        ("rejected:invalid", 400), ("rejected:not_found", 404), ("rejected:too_large", 413),
        ("rejected:unavailable", 503), ("rejected:invalid", 400), ("rejected:timeout", 408)]  # fmt: skip
    for r in lines:
        assert r.path == "/v1/completions" and r.request_id and r.e2e_ms >= 0  # type: ignore[attr-defined]
        assert SECRET not in json.dumps(r.__dict__, default=str)


def test_a_lone_surrogate_is_a_400_that_logs_no_error(tiny_model: str, caplog: pytest.LogCaptureFixture) -> None:
    """Every field where a client's string goes: the JSON escape \\ud800 (or \\udfff) spells a
    lone surrogate, which no tokenizer, hash or response encoder takes."""
    name = Path(tiny_model).name
    bodies = {
        "prompt": f'{{"model": "{name}", "prompt": "a\\ud800b"}}',
        "prompt[1]": f'{{"model": "{name}", "prompt": ["fine", "\\udfff"]}}',
        "messages[0].content": f'{{"model": "{name}", "messages": [{{"role": "user", "content": "x\\ud800"}}]}}',
        "messages[0].role": f'{{"model": "{name}", "messages": [{{"role": "\\ud800", "content": "x"}}]}}',
        "model": '{"model": "m\\ud800", "prompt": "hi"}',
        "cache_salt": f'{{"model": "{name}", "prompt": "hi", "cache_salt": "\\ud800"}}',
        "stop[0]": f'{{"model": "{name}", "prompt": "hi", "stop": ["\\ud800"]}}',
        "some_unknown_field": f'{{"model": "{name}", "prompt": "hi", "some_unknown_field": "\\ud800"}}',
        "\\ud800": f'{{"model": "{name}", "prompt": "hi", "\\ud800": 1}}',  # a key: named escaped
    }

    async def test(_router: Router, address: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for field, body in bodies.items():
                path = "chat/completions" if "messages" in body else "completions"
                r = await client.post(f"http://{address}/v1/{path}", content=body.encode(),
                                      headers={"content-type": "application/json"})  # fmt: skip
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == field and "lone surrogate" in err["message"], r.text

    with caplog.at_level(logging.WARNING, logger="pdserve"):
        run_router(tiny_model, RouterConfig(), test)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_nulls_read_as_defaults_wrong_types_refused_and_405_says_allow(tiny_model: str) -> None:
    """``null`` where OpenAI's API allows it is the field's default (the request reaches the router
    core, which has no workers here: 503); a boolean or a string as a number is a 400 naming the
    field; a wrong method is a 405 with ``Allow``."""
    name = Path(tiny_model).name
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    nulls = {"n": None, "stream": None, "logprobs": None, "ignore_eos": None, "add_generation_prompt": None,
             "temperature": None, "max_tokens": None}  # fmt: skip

    async def test(_router: Router, address: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.post(f"http://{address}/v1/chat/completions", json={**chat, **nulls})
            assert r.status_code == 503 and "decode worker" in r.json()["error"]["message"], r.text
            r = await client.post(f"http://{address}/v1/chat/completions",
                                  json={**chat, "stream": True, "stream_options": {"include_usage": None}})  # fmt: skip
            assert r.status_code == 503, r.text
            r = await client.post(f"http://{address}/v1/completions",
                                  json={"model": name, "prompt": "hi", "echo": None, "n": None})  # fmt: skip
            assert r.status_code == 503, r.text
            for bad in (True, "0.5"):
                r = await client.post(f"http://{address}/v1/chat/completions", json={**chat, "temperature": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
            r = await client.get(f"http://{address}/v1/completions")
            assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers

    run_router(tiny_model, RouterConfig(), test)


def test_chat_template_is_refused_and_template_kwargs_checked(tiny_model: str) -> None:
    name = Path(tiny_model).name
    messages = [{"role": "user", "content": "hi"}]
    bad = [
        ({"chat_template": "{{ messages }}"}, "chat_template", "not supported"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "not a template variable"),
        ({"chat_template_kwargs": {"bos_token": "<x>"}}, "chat_template_kwargs.bos_token", "special tokens"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt",
         "not a template variable"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat_template",
         "not a template variable"),
        ({"chat_template_kwargs": {"raise_exception": 1}}, "chat_template_kwargs.raise_exception", "function"),
        ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs.self", "not a template variable"),
        ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs", "not a variable name"),
        ({"chat_template_kwargs": {"x": "y" * 70_000}}, "chat_template_kwargs", "at most 65536"),
        ({"chat_template_kwargs": {f"v{i}": i for i in range(65)}}, "chat_template_kwargs", "at most 64"),
        ({"chat_template_kwargs": {"deep": json.loads("[" * 20 + "]" * 20)}}, "chat_template_kwargs", "nested"),
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "dictionary"),
    ]

    async def test(_router: Router, address: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for extra, param, needle in bad:
                r = await client.post(f"http://{address}/v1/chat/completions",
                                      json={"model": name, "messages": messages, **extra})  # fmt: skip
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == param and needle in err["message"], (extra, r.text)

    run_router(tiny_model, RouterConfig(), test)


def test_a_connection_over_the_cap_is_answered_503_and_closed(tiny_model: str) -> None:
    """Connections that send nothing take the slots; the next is refused as it is accepted, and
    the idle ones are closed (without an answer) at the head deadline."""
    config = RouterConfig(http_max_connections=4, http_header_timeout_s=1.0)

    async def test(router: Router, address: str) -> None:
        host, port = address.split(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
        assert await wait_until_async(lambda: router.http_edge.connections == 4, timeout=30)
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = await asyncio.wait_for(reader.read(), timeout=30)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"service_unavailable_error" in answer, answer
        writer.close()
        for r, w in idle:  # closed at the deadline, with nothing said: they never began a request
            assert await asyncio.wait_for(r.read(), timeout=30) == b""
            w.close()
        assert await wait_until_async(lambda: router.http_edge.connections == 0, timeout=30)
        assert router.http_edge.rejected["too_many_connections"] == 1

    run_router(tiny_model, config, test)


def test_a_client_that_reads_nothing_is_disconnected_at_the_send_deadline() -> None:
    """A streamed response to a client that never reads (a small receive buffer, nothing taken):
    once the socket's buffers are full and stay so for the send deadline, the connection is cut,
    which cancels the stream (in the router: its request ends, slot and blocks back)."""
    edge = EdgeState(HttpLimits(1024, send_timeout_s=0.5), access_log=False)
    sent, ended = [0], asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                sent[0] += 1
                yield b"x" * 65536
                await asyncio.sleep(0)  # as the router's streams wait between chunks
        finally:
            ended.set()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await StreamingResponse(body())(scope, receive, send)

    async def main() -> None:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http=guarded_protocol(edge),
                                               log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        client = socket.socket()
        try:
            assert await wait_until_async(lambda: server.started, timeout=30)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(sock.getsockname())
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # ... and never reads
            await asyncio.wait_for(ended.wait(), timeout=30)
            assert await wait_until_async(lambda: edge.connections == 0, timeout=30)
            assert edge.rejected["send_timeout"] == 1 and sent[0] > 1
        finally:
            client.close()
            server.should_exit = True
            await task

    asyncio.run(main())


def test_router_config_checks_the_http_limits() -> None:
    for bad in ({"http_header_timeout_s": 0}, {"http_body_timeout_s": float("inf")}, {"http_max_connections": 0},
                {"http_max_buffered_bytes": 1024}, {"http_header_timeout_s": True}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterConfig(**bad)  # type: ignore[arg-type]
    assert RouterConfig(http_body_timeout_s=0.5, http_max_buffered_bytes=1 << 20).http_body_timeout_s == 0.5


def test_a_stream_is_read_at_most_chunks_ahead_of_its_client() -> None:
    """The choices' streams are read only as far ahead of the response as CHUNKS_AHEAD: what a slow
    client has not taken stays where its events come in, which bounds it (``decode_channel.py``)."""
    produced = [0, 0]

    async def stream(i: int) -> AsyncIterator[int]:
        for n in range(10 * CHUNKS_AHEAD):
            produced[i] += 1
            yield n

    async def main() -> None:
        merged = _merged([stream(0), stream(1)], [None, None])
        first = await anext(merged)
        for _ in range(50):  # the pumps get every chance to run ahead
            await asyncio.sleep(0)
        assert max(produced) <= CHUNKS_AHEAD + 2, produced
        rest = [x async for x in merged]
        assert sorted([first, *rest]) == sorted((i, n) for i in (0, 1) for n in range(10 * CHUNKS_AHEAD))

    asyncio.run(main())
