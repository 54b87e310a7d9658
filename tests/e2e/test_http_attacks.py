"""Attacks on the OpenAI-compatible HTTP edge, each performed against a real service (local Ray,
embedded Redis, 1 prefill + 1 decode) and shown to fail while the service keeps serving:
huge prompts refused for their length, half-sent and slow requests, lone surrogates; and the
chat template variables a request may set (checked against transformers), and the README's
curl example run as written."""

from __future__ import annotations

import json
import re
import shutil
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray

from pdserve import LLM, SamplingParams
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from tests.support.polling import wait_until
from tests.support.service import shared_ray

pytestmark = pytest.mark.slow

# The tiny model's template, plus two variables a request may set (chat_template_kwargs): a note
# before the conversation, and Qwen3's switch for its thinking.
TEMPLATE = (
    "{{ bos_token }}{% if system_note is defined %}<|note|>\n{{ system_note }}{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}"
    "/no_think\n{% endif %}{% endif %}"
)
BUFFER_BUDGET = 4 << 20
BODY_TIMEOUT_S = 10.0
HEAD_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def model_dir(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("templated") / "tiny-templated"
    shutil.copytree(tiny_model, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(out)


@pytest.fixture(scope="module")
def service(model_dir: str):
    config = ServiceConfig.load(
        port=0, http_port=0, engine__model=model_dir, engine__cache__kv_cache_memory_bytes=8 * 1024**2,
        router__local_prefill_threshold=8, router__http_header_timeout_s=HEAD_TIMEOUT_S,
        router__http_body_timeout_s=BODY_TIMEOUT_S, router__http_max_connections=200,
        router__http_max_buffered_bytes=BUFFER_BUDGET,
    )  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def name(model_dir: str) -> str:
    return Path(model_dir).name


def http_state(service: Service) -> dict:
    return ray.get(service.router.http_state.remote(), timeout=60)


def p50(samples: list[float]) -> float:
    return statistics.median(samples)


def test_refused_huge_prompts_do_not_stall_health_or_other_tenants(service: Service, name: str) -> None:
    """Two clients loop ~1,040,000-character prompts (under the 1 MiB body cap, far over
    max_model_len): each is refused at once with a 400 naming max_model_len, from its length
    alone, untokenized. Meanwhile the p50 of /health and of another tenant's short request stay
    within 15x and 10x of those measured unloaded just before (about 4x and 3x here; before the
    fix, when each refused prompt was tokenized in full holding the GIL of the router's event
    loop, 31x and 170x here, 300x and 60x as reported)."""
    base = f"http://{service.http_address}"
    huge = json.dumps({"model": name, "prompt": "x" * 1_040_000, "max_tokens": 4, "cache_salt": "attacker"}).encode()
    assert len(huge) < 1 << 20
    short = {"model": name, "prompt": "hello", "max_tokens": 2, "temperature": 0, "cache_salt": "victim"}

    def measure(client: httpx.Client) -> tuple[float, float]:
        health, other = [], []
        for i in range(60):
            t0 = time.perf_counter()
            assert client.get(f"{base}/health").status_code == 200
            health.append(time.perf_counter() - t0)
            if i % 5 == 0:
                t0 = time.perf_counter()
                r = client.post(f"{base}/v1/completions", json=short)
                assert r.status_code == 200, r.text
                other.append(time.perf_counter() - t0)
        return p50(health), p50(other)

    refusals: list[str] = []
    stop = threading.Event()

    def attack() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                r = c.post(f"{base}/v1/completions", content=huge, headers={"content-type": "application/json"})
                refusals.append(f"{r.status_code} {r.json()['error']['message']}")

    with httpx.Client(timeout=120) as client:
        measure(client)  # warm up: connections, the workers' first steps
        health_base, other_base = measure(client)
        attackers = [threading.Thread(target=attack) for _ in range(2)]
        for t in attackers:
            t.start()
        try:
            assert wait_until(lambda: len(refusals) >= 4, timeout=120)
            start = len(refusals)
            health_attacked, other_attacked = measure(client)
            during = len(refusals) - start
        finally:
            stop.set()
            for t in attackers:
                t.join()
    assert during >= 4, "the attack was not running while we measured"
    assert all(r.startswith("400 prompt: at least") and "max_model_len=2048" in r for r in refusals), refusals[:3]
    assert health_attacked <= 15 * health_base, (health_base, health_attacked, during)
    assert other_attacked <= 10 * other_base, (other_base, other_attacked, during)


def _send_head_and_part(address: str, declared: int, part: int) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(120)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode()  # fmt: skip
    try:
        sock.sendall(head + b"x" * part)
    except OSError:  # refused at once and closed while we were still sending
        pass
    return sock


def _answer(sock: socket.socket) -> bytes:
    """What the server says before it closes the connection (b"" for a reset)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    sock.close()
    return data


def test_half_sent_requests_are_timed_out_or_refused_and_their_memory_returns(service: Service, name: str) -> None:
    """100 connections each declare a 1 MiB body, send 300,000 bytes of it and stall. Those that
    fit the 4 MiB budget of held bodies get 408 after the body deadline, the others 503 at once;
    a normal request succeeds meanwhile (a small body is never refused for the budget); once they
    are closed the server holds no body bytes."""
    address = service.http_address
    before = http_state(service)["rejected"]
    socks: list[socket.socket] = []
    lock = threading.Lock()

    def attacker() -> None:
        sock = _send_head_and_part(address, 1 << 20, 300_000)
        with lock:
            socks.append(sock)

    threads = [threading.Thread(target=attacker) for _ in range(100)]
    for t in threads:
        t.start()
    assert wait_until(lambda: http_state(service)["buffered_bytes"] >= BUFFER_BUDGET // 2, timeout=120)
    ok = httpx.post(f"http://{address}/v1/completions", json={"model": name, "prompt": "still here", "max_tokens": 2},
                    timeout=120)  # fmt: skip
    assert ok.status_code == 200, ok.text
    for t in threads:
        t.join()
    answers = [_answer(s) for s in socks]
    timed_out = sum(a.startswith(b"HTTP/1.1 408 ") for a in answers)
    assert 1 <= timed_out <= BUFFER_BUDGET // 300_000  # only what fits the budget was held
    assert all(b'"request_timeout"' in a for a in answers if a.startswith(b"HTTP/1.1 408 "))
    assert all(a == b"" or a.startswith((b"HTTP/1.1 408 ", b"HTTP/1.1 503 ")) for a in answers)
    assert wait_until(lambda: http_state(service)["buffered_bytes"] == 0, timeout=60)
    after = http_state(service)["rejected"]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("body_timeout", "buffer_full")}
    assert delta["body_timeout"] == timed_out and delta["body_timeout"] + delta["buffer_full"] == 100, delta


def test_slow_request_heads_are_timed_out(service: Service) -> None:
    """Slowloris: 20 connections send part of a request's head and stall; each is answered 408
    at the head deadline and closed."""
    before = http_state(service)["rejected"].get("header_timeout", 0)
    host, port = service.http_address.rsplit(":", 1)
    socks = []
    for _ in range(20):
        sock = socket.create_connection((host, int(port)))
        sock.settimeout(120)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        socks.append(sock)
    for sock in socks:
        answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer, answer
    assert http_state(service)["rejected"]["header_timeout"] - before == 20


def test_a_lone_surrogate_is_a_400_not_a_500(service: Service, name: str) -> None:
    base = f"http://{service.http_address}/v1"
    for path, body in (
        ("completions", f'{{"model": "{name}", "prompt": "hi \\ud800 there"}}'),
        ("chat/completions", f'{{"model": "{name}", "messages": [{{"role": "user", "content": "\\udfff"}}]}}'),
    ):
        r = httpx.post(f"{base}/{path}", content=body.encode(), headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and "lone surrogate" in err["message"]
    ok = httpx.post(f"{base}/completions", json={"model": name, "prompt": "fine", "max_tokens": 2}, timeout=120)
    assert ok.status_code == 200


def test_chat_template_kwargs_render_as_transformers_and_chat_template_is_refused(
    service: Service, model_dir: str, name: str
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    offline = LLM(model_dir, num_blocks=64)
    client = openai.OpenAI(base_url=f"http://{service.http_address}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    seen = set()
    for kwargs in ({}, {"enable_thinking": False}, {"system_note": "Answer in French.", "enable_thinking": True}):
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs)
        extra = {"chat_template_kwargs": kwargs, "ignore_eos": True}
        out = client.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0,
                                             extra_body=extra)  # fmt: skip
        assert out.usage.prompt_tokens == len(ids), kwargs
        ref = offline.generate([list(ids)], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        assert out.choices[0].message.content == ref.text, kwargs
        seen.add(len(ids))
    assert len(seen) == 3  # each variable changed the prompt
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=name, messages=messages, extra_body={"chat_template": "{{ 'x' * 9 }}"})
    assert err.value.body["param"] == "chat_template"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=name, messages=messages,
                                       extra_body={"chat_template_kwargs": {"eos_token": ""}})  # fmt: skip
    assert err.value.body["param"] == "chat_template_kwargs.eos_token"


def test_the_readme_curl_example_works_as_written(service: Service) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = re.search(r"or with curl.*?```bash\n(.*?)```", readme, re.S)
    assert block is not None
    script = block.group(1).replace("127.0.0.1:8000", service.http_address)
    out = subprocess.run(["bash", "-c", "set -eo pipefail\n" + script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("data: [DONE]") and '"error"' not in out.stdout, out.stdout[-500:]
    assert '"role":"assistant"' in out.stdout.replace(" ", "")
