"""The HTTP edge against vLLM's behaviour, over a real router's HTTP server in this process (no
workers behind it: a request it accepts gets as far as the 503 for want of a worker): fields that
would change the output are honoured or refused by name, never ignored; chat renders as /tokenize
does (special tokens, tool-call history); a JSON schema nested past the parser's recursion, a
seed near the top of its range, stream options without a stream, a body not declared JSON and
JSON that does not parse get the answers vLLM gives; /ping is /health. Responses name the served
model and carry one ``created`` per request (over scripted workers)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.engine.chat_template import render_chat
from pdserve.engine.model import load_tokenizer
from pdserve.router import openai_responses
from pdserve.router.actor import Router
from pdserve.router.config import RouterConfig
from pdserve.router.openai_protocol import (
    CONTINUE_FINAL_MESSAGE,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    choice_seed,
)  # fmt: skip
from pdserve.router.requests import tokenize
from tests.router.test_http_edge import run_router
from tests.router.test_output_stop_token import ScriptedWorkers, serve_scripted

MESSAGES = [{"role": "user", "content": "hi"}]
# Field, a value that changes the output, the neutral values (vLLM's defaults) that are accepted.
REFUSED: list[tuple[str, Any, list[Any]]] = [
    ("allowed_token_ids", [70], [None]),
    ("bad_words", ["a", "b"], [None, []]),
    ("use_beam_search", True, [None, False]),
    ("return_tokens_as_token_ids", True, [None, False]),
    ("reasoning_effort", "high", [None]),
    ("length_penalty", 0.5, [None, 1, 1.0]),
    ("spaces_between_special_tokens", False, [None, True]),
    ("logprob_token_ids", [5], [None, []]),
    ("truncation_side", "left", [None]),
]


def test_fields_that_change_the_output_are_refused_by_name_and_neutral_values_accepted(tiny_model: str) -> None:
    name = Path(tiny_model).name
    chat = {"model": name, "messages": MESSAGES, "max_tokens": 2}
    completion = {"model": name, "prompt": "hi", "max_tokens": 2}

    async def test(_router: Router, address: str) -> None:
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=60) as client:
            async def status(path: str, body: dict) -> tuple[int, dict]:
                r = await client.post(path, json=body)
                return r.status_code, (r.json().get("error") or {}) if r.content else {}

            for path, base in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
                for field, bad, neutral in REFUSED:
                    code, err = await status(path, {**base, field: bad})
                    assert (code, err.get("param")) == (400, field), (path, field, err)
                    assert "not supported" in err["message"], err
                    for value in neutral:
                        code, err = await status(path, {**base, field: value})
                        assert code == 503, (path, field, value, err)  # accepted: no worker behind it

    run_router(tiny_model, RouterConfig(), test)


def test_chat_refuses_echo_and_continue_final_message_as_completions_and_tokenize_do(tiny_model: str) -> None:
    async def check(client: httpx.AsyncClient, completion: dict) -> None:
        chat = {"model": completion["model"], "messages": MESSAGES, "max_tokens": 2}
        r = await client.post("/v1/chat/completions", json={**chat, "echo": True})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "echo"), r.text
        # continue_final_message: as /tokenize answers it (vLLM refuses it with add_generation_prompt too).
        by_tokenize = {"model": chat["model"], "messages": MESSAGES}
        for path, body in (("/v1/chat/completions", chat), ("/tokenize", by_tokenize)):
            r = await client.post(path, json={**body, "continue_final_message": True, "add_generation_prompt": False})
            assert (r.status_code, r.json()["error"]["message"]) == (400, CONTINUE_FINAL_MESSAGE), (path, r.text)
        for neutral in ({"echo": False}, {"continue_final_message": False}):
            r = await client.post("/v1/chat/completions", json={**chat, **neutral})
            assert r.status_code == 503, r.text

    against_router(tiny_model, check)


def test_chat_honours_add_special_tokens_as_tokenize_does(tiny_model: str) -> None:
    """The template writes its own BOS; ``add_special_tokens: true`` adds the tokenizer's too."""
    tok = load_tokenizer(tiny_model)
    for flag in (None, False, True):
        fields = {} if flag is None else {"add_special_tokens": flag}
        chat = tokenize(ChatCompletionRequest(model="m", messages=MESSAGES, **fields).prompt(), tok)
        assert chat == tokenize(TokenizeRequest(messages=MESSAGES, **fields).to_prompt(), tok)
        assert chat.count(tok.bos_token_id) == (2 if flag else 1)


TOOL_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}]"
    "{% for c in m.tool_calls or [] %}call {{ c.id }} {{ c.function.name }}({{ c.function.arguments.city }});"
    "{% endfor %}{% if m.tool_call_id %}result of {{ m.tool_call_id }}: {% endif %}{{ m.content }}\n{% endfor %}"
)


def test_tool_call_history_reaches_the_template_as_vllm_passes_it() -> None:
    """An assistant's ``tool_calls`` (arguments parsed to an object), a tool's ``tool_call_id``
    and a message's ``name``; arguments that are not a JSON object read as ``{}``."""
    messages = [
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "thanks", "tool_call_id": "ignored: not a tool message"},
    ]  # fmt: skip
    prompt = ChatCompletionRequest(model="m", messages=messages).prompt()
    assert prompt.messages is not None
    text = render_chat(TOOL_TEMPLATE, prompt.messages, {})
    assert text == ("[user ann]weather?\n[assistant]call c1 weather(Oslo);call c2 weather();\n"
                    "[tool]result of c1: sunny\n[user]thanks\n")  # fmt: skip


@pytest.mark.parametrize(("tool_calls", "needle"), [
    ([{"id": "c1", "type": "retrieval", "function": {"name": "f"}}], "messages[0].tool_calls[0]: only tool calls"),
    ([{"id": "c1", "function": {"name": "f", "arguments": "[" * 30 + "]" * 30}}], None),
    ([{"id": "c1", "function": {"name": "f", "arguments": '{"a":' * 30 + "1" + "}" * 30}}],
     "messages[0].tool_calls: nested deeper than"),
    ([{"id": "c1", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}], None),
])  # fmt: skip
def test_tool_calls_are_checked_and_bounded(tool_calls: list[dict], needle: str | None) -> None:
    request = ChatCompletionRequest(model="m", messages=[{"role": "assistant", "tool_calls": tool_calls}])
    if needle is None:  # not an object (a list; nested past the parser's recursion): {}
        assert request.prompt().messages[0]["tool_calls"][0]["function"]["arguments"] == {}  # type: ignore[index]
        return
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        request.prompt()


def test_choice_seeds_wrap_at_the_top_of_the_seed_range() -> None:
    top = 2**64
    assert [choice_seed(top - 2, i) for i in range(4)] == [top - 2, top - 1, 0, 1]
    assert choice_seed(-5, 3) == -2 and choice_seed(7, 2) == 9
    assert choice_seed(top, 1) == top + 1  # out of range already: left for the sampling parameters to refuse
    params = [CompletionRequest(model="m", prompt="p", seed=top - 1, n=2).params(4, None, i) for i in range(2)]
    assert [p.seed for p in params] == [top - 1, 0]


def against_router(tiny_model: str, check: Callable[[httpx.AsyncClient, dict], Coroutine[Any, Any, None]]) -> None:
    """``check(client, completion)`` against a router's HTTP server without workers (an accepted
    request gets a 503); ``completion`` is a valid completions body. No error may be logged."""
    completion = {"model": Path(tiny_model).name, "prompt": "hello", "max_tokens": 2}

    async def test(_router: Router, address: str) -> None:
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=60) as client:
            await check(client, completion)

    with _no_errors_logged():
        run_router(tiny_model, RouterConfig(), test)


@contextlib.contextmanager
def _no_errors_logged() -> Iterator[None]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("pdserve")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


def test_a_schema_nested_past_the_parsers_recursion_is_a_400_naming_the_field(tiny_model: str) -> None:
    deep = {
        "guided_json": "[" * 5000 + "]" * 5000,
        "structured_outputs.json": '{"type":"array","items":' * 20000 + "{}" + "}" * 20000,
    }

    async def check(client: httpx.AsyncClient, completion: dict) -> None:
        for field, schema in deep.items():
            body = {**completion, "guided_json": schema} if field == "guided_json" else \
                {**completion, "structured_outputs": {"json": schema}}  # fmt: skip
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
            assert "nested too deeply" in r.json()["error"]["message"]

    against_router(tiny_model, check)


def test_a_seed_at_the_top_of_its_range_serves_n_choices(tiny_model: str) -> None:
    async def check(client: httpx.AsyncClient, completion: dict) -> None:
        r = await client.post("/v1/completions", json={**completion, "seed": 2**64 - 1, "n": 2})
        assert r.status_code == 503, r.text  # accepted: choice 1 samples with seed 0
        r = await client.post("/v1/completions", json={**completion, "seed": 2**64, "n": 2})
        assert r.status_code == 400 and str(2**64) in r.json()["error"]["message"], r.text

    against_router(tiny_model, check)


def test_stream_options_need_a_stream(tiny_model: str) -> None:
    async def check(client: httpx.AsyncClient, completion: dict) -> None:
        r = await client.post("/v1/completions", json={**completion, "stream_options": {"include_usage": True}})
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (400, "stream_options") and "stream=True" in err["message"], r.text
        for stream in (True, False):  # an empty stream_options is fine either way, as in vLLM
            r = await client.post("/v1/completions", json={**completion, "stream": stream, "stream_options": {}})
            assert r.status_code == 503, r.text

    against_router(tiny_model, check)


def test_a_body_must_be_declared_json_and_bad_json_names_no_field(tiny_model: str) -> None:
    async def check(client: httpx.AsyncClient, completion: dict) -> None:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            for headers in ({"content-type": "text/plain"}, {}):
                r = await client.post(path, content=json.dumps(completion).encode(), headers=headers)
                err = r.json()["error"]
                assert (r.status_code, err["message"], err["param"]) == (
                    400, "Unsupported Media Type: Only 'application/json' is allowed", None), (path, headers, r.text)
        r = await client.post("/v1/completions", json=completion,
                              headers={"content-type": "application/json; charset=utf-8"})  # fmt: skip
        assert r.status_code == 503, r.text
        r = await client.post("/v1/completions", content=b'{"model": x}', headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] is None and "at character 10" in err["message"], r.text

    against_router(tiny_model, check)


def test_ping_is_health(tiny_model: str) -> None:
    async def check(client: httpx.AsyncClient, _completion: dict) -> None:
        for method in ("GET", "POST"):
            r = await client.request(method, "/ping")
            assert r.status_code == 200 and r.content == b"", (method, r.text)

    against_router(tiny_model, check)


class Clock:
    """``time.time`` for ``openai_responses``: a second later at every call."""

    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def time(self) -> float:
        self.t += 1
        return self.t


def test_responses_name_the_served_model_and_one_created_time(redis_server, tiny_model: str,  # noqa: ANN001
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A request that names the model by the path it was loaded from is answered with the served
    name (as vLLM does); every chunk of a stream has the request's ``created``."""
    monkeypatch.setattr(openai_responses, "time", Clock())
    name = Path(tiny_model).name

    async def run(router: Router, http: str, _grpc: str) -> None:
        router.core.workers = ScriptedWorkers([72, 105, 33, 33], "length")
        async with httpx.AsyncClient(base_url=f"http://{http}", timeout=60) as client:
            for path, body in (("/v1/completions", {"prompt": "hello"}),
                               ("/v1/chat/completions", {"messages": MESSAGES})):  # fmt: skip
                body = {**body, "model": tiny_model, "max_tokens": 4}
                r = await client.post(path, json=body)
                assert r.status_code == 200 and r.json()["model"] == name, r.text
                r = await client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
                chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
                assert len(chunks) >= 4 and {c["model"] for c in chunks} == {name}, r.text
                assert len({c["created"] for c in chunks}) == 1, r.text

    serve_scripted(redis_server, tiny_model, run)
