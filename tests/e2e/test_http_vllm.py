"""What a vLLM user's clients call, against a real ``pdserve up --api-key`` (local Ray, embedded
Redis, 1 prefill + 1 decode, run as a user runs it): /tokenize, /detokenize and /version against
transformers' tokenizer, the chat stream's role-only first chunk through the official ``openai``
client and as raw server-sent events, and the API key on both edges (HTTP and gRPC, the
``openai`` client and ``pdserve generate``), which never shows in the logs or the state file."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from pdserve.v1 import router_pb2 as pb
from tests.support import REPO
from tests.support.polling import wait_until
from tests.support.redis import unique_namespace
from tests.support.service import stub_for

pytestmark = pytest.mark.slow

KEY = "sk-vllm-dropin-5f1c0e9a7b3d"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


@dataclass
class Up:
    proc: subprocess.Popen[str]
    grpc: str  # HOST:PORT
    http: str  # HOST:PORT
    state: Path  # the state file
    log: Path  # up's stderr: every process's log lines
    stdout: list[str]  # up's lines so far
    env: dict[str, str]  # the environment `up` ran in (a client command runs in it too)


@pytest.fixture(scope="module")
def up(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("vllm-up")
    env = dict(os.environ, PDSERVE_STATE_DIR=str(tmp / "state"), RAY_AUTH_TOKEN_PATH=str(tmp / "ray_token"))
    for name in ("PDSERVE_API_KEY", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    log = tmp / "up.log"  # a file, not a pipe: the log stream must never block the service
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli.main", "up", "--model", tiny_model, "--port", "0", "--http-port", "0",
         "--namespace", unique_namespace(), "--api-key", KEY],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=REPO, env=env,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        while not lines or not lines[-1].startswith("API key required"):
            line = proc.stdout.readline()
            assert line, f"up ended: {lines}\n{log.read_text()[-3000:]}"
            lines.append(line.rstrip("\n"))
        found = {k: line.split(" on ", 1)[1] for line in lines for k in ("router", "http")
                 if line.startswith(f"{k} listening on ")}  # fmt: skip
        yield Up(proc, found["router"], found["http"], tmp / "state" / "up.json", log, lines, env)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        lines += proc.stdout.read().splitlines()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def model_name(tiny_model: str) -> str:
    return Path(tiny_model).name


def pdserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)  # fmt: skip


def test_tokenize_detokenize_and_version_answer_as_vllm(up: Up, tiny_model: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)
    name = model_name(tiny_model)
    url = f"http://{up.http}"
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()
    max_len = models["data"][0]["max_model_len"]
    text = "The quick brown fox jumps over the lazy dog"

    def tokenize(**body: object) -> dict:
        r = httpx.post(f"{url}/tokenize", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    out = tokenize(model=name, prompt=text)
    assert out == {"count": len(hf(text)["input_ids"]), "max_model_len": max_len, "tokens": hf(text)["input_ids"],
                   "token_strs": None}  # fmt: skip
    assert tokenize(model=name, prompt=text, add_special_tokens=False)["tokens"] == hf(text, add_special_tokens=False)[
        "input_ids"]  # fmt: skip
    chat = tokenize(model=name, messages=MESSAGES)
    hf_chat = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["tokens"] == list(hf_chat) and chat["count"] == len(hf_chat)
    # The count is what a chat completion of the same messages is charged.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
    assert answer.usage.prompt_tokens == chat["count"]
    for ids in (out["tokens"], chat["tokens"]):
        r = httpx.post(f"{url}/detokenize", json={"model": name, "tokens": ids}, headers=AUTH)
        assert r.json() == {"prompt": hf.decode(ids)}, r.text
    assert httpx.get(f"{url}/version", headers=AUTH).json() == {"version": importlib.metadata.version("pdserve")}
    # Errors: OpenAI error objects; a prompt that does not fit is refused as completions refuse it.
    for path, body, status, needle in (
        ("/tokenize", {"model": "no-such-model", "prompt": "hi"}, 404, "model_not_found"),
        ("/detokenize", {"model": "no-such-model", "tokens": [1]}, 404, "model_not_found"),
        ("/tokenize", {"model": name, "prompt": "x" * (8 * max_len)}, 400, "max_model_len"),
        ("/tokenize", {"model": name, "prompt": "hi", "messages": MESSAGES}, 400, "exactly one of"),
        ("/detokenize", {"model": name, "tokens": [10**9]}, 400, "vocabulary"),
    ):  # fmt: skip
        r = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)
        assert r.status_code == status and needle in json.dumps(r.json()["error"]), (body, r.text)
        if path == "/tokenize" and "messages" not in body:  # completions refuses the same prompt alike
            r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, headers=AUTH, timeout=60)
            assert r.status_code == status and needle in json.dumps(r.json()["error"]), (body, r.text)


def test_chat_streams_open_each_choice_with_the_role_alone(up: Up, tiny_model: str) -> None:
    name = model_name(tiny_model)
    kw = dict(model=name, messages=MESSAGES, max_tokens=8, temperature=0, n=2, extra_body={"ignore_eos": True})
    client = openai.OpenAI(base_url=f"http://{up.http}/v1", api_key=KEY, max_retries=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert mine[0].finish_reason is None and mine[0].logprobs is None
        assert len(mine) >= 2 and all(c.delta.role is None for c in mine[1:])
        if whole.choices[i].message.content:  # the text starts in the next chunk
            assert mine[1].delta.content
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[i].message.content
        assert mine[-1].finish_reason == "length"
    # Raw events, each validated by the client's own model; the role chunk exactly as vLLM sends it.
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, "ignore_eos": True, "stream": True, "logprobs": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", f"http://{up.http}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    raw = [json.loads(e) for e in events[:-1]]
    parsed = [ChatCompletionChunk.model_validate(c) for c in raw]
    assert {c.id for c in parsed} == {parsed[0].id} and all(c.object == "chat.completion.chunk" for c in parsed)
    for i in (0, 1):
        mine = [c for c in raw if c["choices"] and c["choices"][0]["index"] == i]
        first = mine[0]["choices"][0]
        assert first == {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}  # fmt: skip
        assert mine[0]["usage"]["completion_tokens"] == 0 and mine[0]["usage"]["prompt_tokens"] > 0
        assert all("role" not in c["choices"][0]["delta"] for c in mine[1:])
        assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in mine[1:] if c["choices"][0]["logprobs"]) == 8
    assert raw[-1]["choices"] == [] and raw[-1]["usage"]["completion_tokens"] == 16


def test_without_the_key_both_edges_refuse_but_health_and_metrics_answer(up: Up, tiny_model: str) -> None:
    url = f"http://{up.http}"
    body = {"model": model_name(tiny_model), "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"),
                             ("GET", "/version")):  # fmt: skip
            r = httpx.request(method, f"{url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error", r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="not-the-key", max_retries=0).completions.create(**body)
    assert httpx.get(f"{url}/health").status_code == 200
    metrics = httpx.get(f"{url}/metrics", timeout=30)
    assert metrics.status_code == 200 and 'pdserve_http_rejected_total{reason="unauthorized"}' in metrics.text
    channel, stub = stub_for(up.grpc)
    with channel:
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=2))
        for metadata in (None, (("authorization", "Bearer not-the-key"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, metadata=metadata, timeout=60))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    r = pdserve("generate", "--router", up.grpc, "--prompt", "hi", "--max-tokens", "2", env=up.env)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr and KEY not in r.stderr


def test_the_right_key_works_through_openai_grpc_and_pdserve_generate(up: Up, tiny_model: str) -> None:
    client = openai.OpenAI(base_url=f"http://{up.http}/v1", api_key=KEY, max_retries=0)
    text = "hello router"
    http = client.completions.create(model=model_name(tiny_model), prompt=text, max_tokens=4, temperature=0)
    # pdserve generate --router: the flag, then PDSERVE_API_KEY alone; greedy, the same text as HTTP's.
    common = ("generate", "--router", up.grpc, "--prompt", text, "--max-tokens", "4", "--json")
    for args, env in (((*common, "--api-key", KEY), up.env), (common, {**up.env, "PDSERVE_API_KEY": KEY})):
        r = pdserve(*args, env=env)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["text"] == http.choices[0].text and len(out["token_ids"]) == http.usage.completion_tokens
    r = pdserve("generate", "--model", tiny_model, "--prompt", text, "--api-key", KEY, env=up.env)
    assert r.returncode == 2 and "--api-key goes with --router" in r.stderr


def test_the_key_is_never_logged_nor_kept_in_the_state_file(up: Up) -> None:
    state = json.loads(up.state.read_text())
    assert state["router"] == up.grpc and KEY not in json.dumps(state)
    assert any(line.startswith("API key required") for line in up.stdout)
    assert KEY not in "\n".join(up.stdout)
    log = up.log.read_text()
    assert "pdserve.access" in log or "rejected:unauthorized" in log  # the refusals above were logged...
    assert KEY not in log  # ...without the key


def test_every_actor_logs_compact_text_lines(up: Up, tiny_model: str) -> None:
    """The workers and the router (Ray actors, each in its own process) log in pdserve's compact TEXT
    format, installed by each actor at its start: time, level, logger, message and the record's
    fields, behind Ray's ``(ActorName pid=N)``, never Ray's context ids."""
    r = httpx.post(f"http://{up.http}/v1/completions", headers=AUTH, timeout=60,
                   json={"model": model_name(tiny_model), "prompt": "compact lines", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    patterns = {
        "router": rf"\(Router pid=\d+\)(?:\x1b\[0m)? {stamp} INFO pdserve\.access: request \S+ length ",
        "prefill": rf"\(PrefillWorker pid=\d+\)(?:\x1b\[0m)? {stamp} INFO pdserve\.worker\.runtime: prefill worker prefill-0 ready",
        "decode": rf"\(DecodeWorker pid=\d+\)(?:\x1b\[0m)? {stamp} INFO pdserve\.worker\.runtime: decode worker decode-0 ready",
    }  # fmt: skip
    assert wait_until(lambda: all(re.search(p, up.log.read_text()) for p in patterns.values()), timeout=30), {
        k: bool(re.search(p, up.log.read_text())) for k, p in patterns.items()}  # fmt: skip
    actor_lines = [line for line in up.log.read_text().splitlines() if " pid=" in line]
    assert actor_lines and not any(k in line for line in actor_lines for k in ("job_id=", "worker_id=", "actor_id="))
