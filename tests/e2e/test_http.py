"""The OpenAI-compatible HTTP API end to end: the official ``openai`` client and raw HTTP against a
real service (local Ray, embedded Redis, 1 prefill + 1 decode), checked against the offline engine
and transformers."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve import LLM, SamplingParams
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.engine.tokenizer import ModelTokenizer
from tests.support.polling import wait_until
from tests.support.service import all_idle, pool_states, raw_post, shared_ray

pytestmark = pytest.mark.slow

SYSTEM = "You are the helpful assistant of a tiny random model. " * 3  # > 100 tokens: several blocks


@pytest.fixture(scope="module")
def service(tiny_model: str):
    config = ServiceConfig.load(
        port=0, http_port=0, engine__model=tiny_model, engine__cache__kv_cache_memory_bytes=8 * 1024**2,
        router__local_prefill_threshold=8, router__max_request_bytes=256 * 1024,
    )  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(service: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{service.http_address}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model: str) -> LLM:
    return LLM(tiny_model, num_blocks=256)


def model_name(tiny_model: str) -> str:
    return Path(tiny_model).name


def test_models_and_health(service: Service, client: openai.OpenAI, tiny_model: str) -> None:
    assert [m.id for m in client.models.list().data] == [model_name(tiny_model)]
    assert httpx.get(f"http://{service.http_address}/health").status_code == 200


def test_completions_match_the_offline_engine_streamed_or_not(client: openai.OpenAI, offline: LLM,
                                                              tiny_model: str) -> None:  # fmt: skip
    prompt = "The quick brown fox"
    ref = offline.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    kw = dict(model=model_name(tiny_model), prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    out = client.completions.create(**kw)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(offline.encode(prompt)) == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    # Streamed: the pieces add up to the same text; the usage chunk comes last, with no choices.
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # Token-id prompts are used as given (no special tokens added).
    by_ids = client.completions.create(**{**kw, "prompt": [5, 6, 7, 8]})
    assert by_ids.usage.prompt_tokens == 4
    ref_ids = offline.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert by_ids.choices[0].text == ref_ids.text


def test_chat_renders_the_template_as_transformers_and_answers_like_the_engine(
    client: openai.OpenAI, offline: LLM, tiny_model: str
) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    hf_ids = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(messages, add_generation_prompt=True,
                                                                            tokenize=True, return_dict=False)  # fmt: skip
    ref = offline.generate([list(hf_ids)], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    kw = dict(model=model_name(tiny_model), messages=messages, max_completion_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    out = client.chat.completions.create(**kw)
    assert out.usage.prompt_tokens == len(hf_ids)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(**kw, stream=True))
    # The role alone first (as OpenAI and vLLM send it), then the text.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_repeated_system_prompt_is_cached_per_tenant(client: openai.OpenAI, tiny_model: str) -> None:
    def ask(question: str, salt: str):  # noqa: ANN202
        return client.chat.completions.create(
            model=model_name(tiny_model), max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            extra_body={"cache_salt": salt},
        ).usage  # fmt: skip

    first = ask("What is one plus one?", "tenant-a")
    assert first.prompt_tokens > 150 and first.prompt_tokens_details.cached_tokens == 0
    again = ask("And two plus two?", "tenant-a")
    assert again.prompt_tokens_details.cached_tokens >= 144  # the system prompt's full blocks
    other = ask("And two plus two?", "tenant-b")  # same text, another tenant: nothing shared
    assert other.prompt_tokens_details.cached_tokens == 0


def scrape(service: Service) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"http://{service.http_address}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=")
    families = list(text_string_to_metric_families(r.text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family per name, whichever process reported it
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_one_scrape_shows_the_router_and_every_worker(service: Service, client: openai.OpenAI,
                                                      tiny_model: str) -> None:  # fmt: skip
    def ask(question: str) -> None:
        client.chat.completions.create(
            model=model_name(tiny_model), max_tokens=5, temperature=0, extra_body={"ignore_eos": True,
            "cache_salt": "metrics-tenant"}, messages=[{"role": "system", "content": SYSTEM},
            {"role": "user", "content": question}],
        )  # fmt: skip

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    wait_until(lambda: all_idle(service), timeout=60)
    before = scrape(service)
    ask("What is one plus one?")
    ask("And two plus two?")
    wait_until(lambda: all_idle(service), timeout=60)
    after = scrape(service)
    assert delta("pdserve_requests_total", finish_reason="length") == 2
    assert delta("pdserve_time_to_first_token_seconds_count") == 2
    assert delta("pdserve_inter_token_latency_seconds_count") == 2 * 4
    assert delta("pdserve_generation_tokens_total") == 10
    prompt = delta("pdserve_prompt_tokens_total")
    assert prompt > 300
    # The second request found the system prompt in the prefill worker's cache: the workers'
    # hits (tokens) add up to what the router reports as cached.
    hits = delta("pdserve_prefix_cache_hits_total", worker="prefill-0", role="prefill")
    assert hits >= 144 and hits == delta("pdserve_request_cached_tokens_total")
    assert delta("pdserve_prefix_cache_queries_total", worker="prefill-0", role="prefill") == prompt
    # Both prompts' KV went to the decode worker over the transfer plane: by shared memory (one host).
    assert delta("pdserve_kv_transfer_seconds_count", worker="decode-0", transport="shm") == 2
    assert delta("pdserve_kv_transfer_bytes_total", worker="decode-0", transport="shm") > 0
    assert delta("pdserve_kv_transfer_seconds_count", worker="decode-0", transport="grpc") == 0
    assert delta("pdserve_kv_transfer_failures_total", worker="decode-0") == 0
    for w, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert after[("pdserve_worker_up", (("worker", w),))] == 1
        assert after[("pdserve_num_requests_running", (("role", role), ("worker", w)))] == 0
        assert 0 <= after[("pdserve_kv_cache_usage_ratio", (("role", role), ("worker", w)))] < 1
    assert after[("pdserve_redis_outages_total", (("client", "stats"), ("process", "router")))] == 0


def test_stop_strings_cut_the_text_and_end_the_request(service: Service, client: openai.OpenAI,
                                                        tiny_model: str) -> None:  # fmt: skip
    kw = dict(model=model_name(tiny_model), prompt="Once upon a time", max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True})  # fmt: skip
    full = client.completions.create(**kw).choices[0].text
    stop = full[10:13]
    expected = full[: full.index(stop)]
    wait_until(lambda: all_idle(service), timeout=60)
    before = scrape(service)
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(**kw, stop=[stop, "\x00never"], stream=True))
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**kw, stop=[stop, "\x00never"])
            text, reason = out.choices[0].text, out.choices[0].finish_reason
            assert out.usage.completion_tokens < 40
        assert (text, reason) == (expected, "stop")
    # The router ended them at the stop string: counted as finished with "stop", not as clients leaving.
    wait_until(lambda: all_idle(service), timeout=60)
    after = scrape(service)
    for reason, n in (("stop", 2), ("abort", 0)):
        key = ("pdserve_requests_total", (("finish_reason", reason),))
        assert after[key] - before.get(key, 0) == n, reason


def test_logprobs_match_transformers(client: openai.OpenAI, tiny_model: str) -> None:
    from transformers import AutoModelForCausalLM

    tok = ModelTokenizer.from_path(tiny_model)
    messages = [{"role": "user", "content": "Count to three."}]
    out = client.chat.completions.create(model=model_name(tiny_model), messages=messages, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=3,
                                         extra_body={"ignore_eos": True})  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    prompt = tok.encode_chat(messages)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    # Greedy: each generated token is the reference's top-1, which extends the reference's context.
    with torch.no_grad():
        ids = list(prompt)
        for c in content:
            logits = hf(torch.tensor([ids])).logits[0, -1]
            lp = torch.log_softmax(logits.double(), -1)
            top = torch.topk(lp, 3)
            assert c.logprob == pytest.approx(top.values[0].item(), abs=1e-4)
            assert [t.logprob for t in c.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert [t.token for t in c.top_logprobs] == [tok.decode([i], skip_special_tokens=False)
                                                         for i in top.indices.tolist()]  # fmt: skip
            ids.append(int(top.indices[0]))


def test_completion_logprobs_list_the_sampled_token_and_alternatives(client: openai.OpenAI, tiny_model: str) -> None:
    out = client.completions.create(model=model_name(tiny_model), prompt="abc", max_tokens=5, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text or len(out.choices[0].text) < len("".join(lp.tokens))
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3
        if "\ufffd" not in token:  # bytes that are not whole characters all read "\ufffd" and collide as keys
            assert top[token] == value and max(top.values()) == value  # greedy: the sampled token is the best
    assert lp.text_offset[0] == 0


def test_n_choices_are_seeded_and_reproducible(client: openai.OpenAI, tiny_model: str) -> None:
    kw = dict(model=model_name(tiny_model), prompt="Pick a letter:", max_tokens=8, temperature=1.0, n=3, seed=7,
              extra_body={"ignore_eos": True})  # fmt: skip
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1  # each choice samples with its own seed (seed + index)
    assert a.usage.completion_tokens == 3 * 8 and a.usage.prompt_tokens == b.usage.prompt_tokens < 20  # counted once


def test_errors_are_openai_error_objects(service: Service, client: openai.OpenAI, tiny_model: str) -> None:
    url = f"http://{service.http_address}/v1"
    name = model_name(tiny_model)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    bad = [
        ({"model": name, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": name, "prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"model": name, "prompt": "hi", "top_p": 2}, "top_p"),
        ({"model": name, "prompt": ""}, "prompt"),
        ({"model": name, "prompt": [1, 99999]}, "vocabulary"),
        ({"model": name, "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
        ({"model": name, "prompt": "hi", "n": 100}, "n"),
        ({"model": name, "prompt": "hi", "cache_salt": "x" * 300}, "cache_salt"),
        ({"model": name, "prompt": "x" * 5000}, "max_model_len"),
        ({"model": name, "prompt": "hi", "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"model": name, "prompt": "hi", "skip_special_tokens": False}, "skip_special_tokens"),
        ({"model": name, "prompt": "hi", "stop_token_ids": list(range(300))}, "stop_token_ids"),
        ({"model": name, "prompt": ["a", "b", "c", "d", "e"], "n": 16}, "at most 64"),  # 80 choices: > a tenant's share
    ]
    for body, needle in bad:
        r = httpx.post(f"{url}/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
    chat_bad = [
        ({"model": name}, "messages"),
        ({"model": name, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        ({"model": name, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ]
    for body, needle in chat_bad:
        r = httpx.post(f"{url}/chat/completions", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.get(f"{url}/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{url}/completions")
    assert r.status_code == 405 and "error" in r.json() and r.headers["allow"] == "POST"
    ok = httpx.post(f"{url}/completions", json={"model": name, "prompt": "hi", "max_tokens": 2, "top_k": -1,
                                                 "presence_penalty": 0, "repetition_penalty": 1.0})  # fmt: skip
    assert ok.status_code == 200, ok.text  # vLLM's "off" values are fine
    r = httpx.post(f"{url}/completions", json={"model": name, "prompt": "y" * 300_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert client.completions.create(model=name, prompt="still serving", max_tokens=2).choices[0].text is not None


def _decoding(service: Service) -> bool:
    return any(s["requests"] > 0 for s in pool_states(service).values())


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(service: Service, tiny_model: str, stream: bool) -> None:
    """A long request (1500 tokens) whose client goes away is ended at once: the pools are idle
    long before the request would have finished, as timed by the same request run to its end."""
    assert wait_until(lambda: all_idle(service), timeout=30)
    body = {"model": model_name(tiny_model), "prompt": "tell me everything", "max_tokens": 1500,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    t0 = time.perf_counter()
    full = httpx.post(f"http://{service.http_address}/v1/completions", json={**body, "stream": False}, timeout=300)
    full_s = time.perf_counter() - t0
    assert full.json()["usage"]["completion_tokens"] == 1500
    assert wait_until(lambda: all_idle(service), timeout=30)
    sock = raw_post(service.http_address, "/v1/completions", body)
    assert wait_until(lambda: _decoding(service), timeout=30)
    t0 = time.perf_counter()
    sock.close()
    assert wait_until(lambda: all_idle(service), timeout=60)
    assert time.perf_counter() - t0 < full_s / 2, (time.perf_counter() - t0, full_s)


def test_grpc_edge_takes_chat_stop_strings_and_logprobs_like_http(service: Service, client: openai.OpenAI,
                                                                  tiny_model: str) -> None:  # fmt: skip
    """The same chat through both edges: the same prompt tokens, text, logprobs and usage."""
    from pdserve.v1 import router_pb2 as pb
    from tests.support.service import stub_for

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    http = client.chat.completions.create(model=model_name(tiny_model), messages=messages, max_tokens=30,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    text = http.choices[0].message.content
    stop = text[6:9]
    channel, stub = stub_for(f"127.0.0.1:{service.port}")
    with channel:
        def grpc_chat(**sampling: object) -> list[pb.GenerateResponse]:
            req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in messages]),
                                     sampling=pb.SamplingOptions(max_tokens=30, ignore_eos=True, **sampling))  # fmt: skip
            return list(stub.Generate(req, timeout=60))

        full = grpc_chat(logprobs=2)
        assert "".join(r.text for r in full) == text
        assert full[-1].usage.prompt_tokens == http.usage.prompt_tokens
        assert full[-1].usage.completion_tokens == http.usage.completion_tokens == 30
        lps = [lp for r in full for lp in r.logprobs]
        # The second request's prompt hits the prefix cache, so its uncached rows are projected in a
        # smaller batch than the first's whole prompt (another float32 product: equal to rounding).
        assert [lp.logprob for lp in lps] == pytest.approx([c.logprob for c in http.choices[0].logprobs.content],
                                                           abs=1e-4)  # fmt: skip
        assert all(len(lp.top) == 2 for lp in lps)
        cut = grpc_chat(stop=[stop])
        assert "".join(r.text for r in cut) == text[: text.index(stop)]
        assert cut[-1].finished and cut[-1].finish_reason == "stop" and cut[-1].usage.completion_tokens < 30
