"""Structured outputs end to end: the official ``openai`` client against a real service (local
Ray, embedded Redis, 1 prefill + 1 decode worker). The prefill worker samples the first token
under the constraint and the decode worker continues it (its matcher advanced over that token):
the answer is the offline engine's, token for token, and it parses and validates; choices and
regexes hold for every one of ``n`` sampled, streamed choices."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from pdserve import LLM, SamplingParams
from pdserve.cluster.config import ServiceConfig
from pdserve.cluster.launcher import Service
from pdserve.engine.structured import StructuredOutputsParams
from tests.support.service import shared_ray

pytestmark = pytest.mark.slow
pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (xgrammar)")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Describe the weather as JSON, please."}]  # > 8 tokens: prefilled apart


@pytest.fixture(scope="module")
def service(tiny_model: str):
    config = ServiceConfig.load(
        port=0, http_port=0, engine__model=tiny_model, engine__cache__kv_cache_memory_bytes=8 * 1024**2,
        router__local_prefill_threshold=8,
    )  # fmt: skip
    shared_ray()
    svc = Service(config, progress=lambda _m: None)
    svc.start()
    yield svc
    svc.stop()


def test_constraints_follow_requests_from_the_prefill_to_the_decode_worker(service: Service, tiny_model: str) -> None:
    client = openai.OpenAI(base_url=f"http://{service.http_address}/v1", api_key="unused", max_retries=0)
    model = Path(tiny_model).name
    # Free whitespace between items (the default): this random model uses it, up to its bound.
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, max_tokens=250,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and out.usage.prompt_tokens_details.transferred_tokens > 0
    jsonschema.validate(json.loads(text), SCHEMA)
    offline = LLM(tiny_model, num_blocks=256)
    params = SamplingParams(max_tokens=250, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    ref = offline.chat(MESSAGES, params)
    assert text == ref[0].text

    choices = ["sunny", "rain", "fog"]
    stream = client.completions.create(model=model, prompt="Tomorrow the weather will be", n=3, temperature=1.0,
                                       seed=11, max_tokens=16, stream=True, extra_body={"guided_choice": choices})
    texts = ["", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(t in choices for t in texts), texts

    regex = r"[0-9]{2}:[0-9]{2} (am|pm)"
    out = client.completions.create(model=model, prompt="The time is now", temperature=0.8, seed=3, max_tokens=16,
                                    logprobs=1, extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    assert len(out.choices[0].logprobs.tokens) == out.usage.completion_tokens


def test_the_grpc_edge_takes_the_same_constraints(service: Service, tiny_model: str) -> None:
    """``SamplingOptions.structured_outputs``: vLLM's object as JSON text, checked as the HTTP edge
    checks it; the output is the offline engine's under the same constraint."""
    import grpc

    from pdserve.cli.client import build_request, generate
    from pdserve.v1 import router_pb2_grpc as pb_grpc

    stub = pb_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{service.port}"))
    regex = r"[0-9]{2}:[0-9]{2} (am|pm)"
    req = build_request("The time is now", SamplingParams(max_tokens=16))
    req.sampling.structured_outputs = json.dumps({"regex": regex})
    out = generate(stub, req)
    offline = LLM(tiny_model, num_blocks=256).generate(
        ["The time is now"], SamplingParams(max_tokens=16, structured_outputs=StructuredOutputsParams(regex=regex)))
    assert re.fullmatch(regex, out.text) and out.finish_reason == "stop"
    assert out.token_ids == offline[0].token_ids
    for bad, needle in [('{"regex": "(unclosed"}', "sampling.structured_outputs.regex"),
                        ('{"regex": "a", "choice": ["b"]}', "one structured-output constraint"),
                        ("[1]", "must be a JSON object"), ("{", "not JSON")]:  # fmt: skip
        req.sampling.structured_outputs = bad
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details(), bad
