"""A request that a worker ends on a stop token (one of its ``stop_token_ids``, or EOS): as in
vLLM, that token's text is not part of the output, while its id stays in the gRPC stream's
``token_ids`` and in ``usage``. Over a real router (its HTTP and gRPC servers in this process, the
real router core, Redis the embedded server); the workers are scripted (plain Python objects
that stand for the fleet) and answer every request with the same tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc
import httpx

from pdserve.engine.config import EngineConfig
from pdserve.engine.model import load_tokenizer
from pdserve.kvindex.config import IndexConfig
from pdserve.router.actor import Router
from pdserve.router.config import RouterConfig
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc
from pdserve.worker.messages import DecodeEvent, PrefillResult, RequestSpec
from tests.support.redis import unique_namespace


class ScriptedWorkers:
    """One prefill and one decode worker: the prefill samples ``tokens[0]`` (and ends the request
    when that is all), the decode stream sends the rest one event each (all of them when the
    router has it prefill too), the last finishing with ``reason``."""

    prefill_ids = ["p0"]
    decode_ids = ["d0"]

    def __init__(self, tokens: list[int], reason: str) -> None:
        self.tokens = tokens
        self.reason = reason

    async def prefill(self, worker_id: str, spec: RequestSpec) -> PrefillResult:
        alone = len(self.tokens) == 1  # the first token ends the request
        return PrefillResult(spec.request_id, self.tokens[0], alone, self.reason if alone else None,
                             None if alone else "lease-1", "127.0.0.1:1", worker_id, len(spec.prompt_token_ids),
                             0)  # fmt: skip

    async def decode(self, worker_id: str, spec: RequestSpec,
                     prefill: PrefillResult | None) -> AsyncIterator[DecodeEvent]:  # fmt: skip
        rest = self.tokens[1:] if prefill is not None else self.tokens
        for i, t in enumerate(rest):
            last = i == len(rest) - 1
            yield DecodeEvent(spec.request_id, (t,), last, self.reason if last else None)
            await asyncio.sleep(0)

    def prefetch(self, decode_id: str, spec: RequestSpec, prefill_id: str) -> None:
        pass

    def release(self, worker_id: str, lease_id: str) -> None:
        pass

    async def ping(self, worker_id: str) -> None:
        pass


def sse_texts(body: str) -> tuple[str, list[str | None], dict]:
    """A completions stream's text, its finish reasons, and its usage chunk."""
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    usage = next(e["usage"] for e in events if e.get("usage"))
    return "".join(c["text"] for c in choices), [c["finish_reason"] for c in choices if c["finish_reason"]], usage


def test_the_stop_tokens_text_is_not_output(redis_server, tiny_model: str) -> None:  # noqa: ANN001
    tok = load_tokenizer(tiny_model)
    hi, bang = tok.encode("Hi", False, False), tok.encode("!", False, False)[0]
    name = Path(tiny_model).name
    cases = [  # (tokens, finish reason, stop_token_ids, text, stop_reason): "!" ends it, its text not output
        (hi + [bang], "stop", [bang], "Hi", bang),
        (hi + [tok.eos_token_id], "stop", [], "Hi", None),  # EOS: no stop_reason, as in vLLM
        ([bang], "stop", [bang], "", bang),  # the first token stops it
        (hi + [bang], "length", [], "Hi!", None),  # max_tokens: every token's text
    ]

    async def run(router: Router, http: str, address: str) -> None:
        channel = grpc.aio.insecure_channel(address)
        stub = pb_grpc.RouterStub(channel)
        try:
            async with httpx.AsyncClient(base_url=f"http://{http}", timeout=60) as client:
                for tokens, reason, stop_ids, text, stop_reason in cases:
                    router.core.workers = ScriptedWorkers(tokens, reason)
                    body = {"model": name, "prompt": "hello", "max_tokens": len(tokens), "stop_token_ids": stop_ids}
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    choice, usage = r.json()["choices"][0], r.json()["usage"]
                    assert (choice["text"], choice["finish_reason"]) == (text, reason), (tokens, r.text)
                    assert choice["stop_reason"] == stop_reason, r.text
                    assert usage["completion_tokens"] == len(tokens)
                    streaming = {**body, "stream": True, "stream_options": {"include_usage": True}}
                    r = await client.post("/v1/completions", json=streaming)
                    streamed, reasons, usage = sse_texts(r.text)
                    assert (streamed, reasons, usage["completion_tokens"]) == (text, [reason], len(tokens)), r.text
                    r = await client.post("/v1/chat/completions", json={
                        "model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": len(tokens),
                        "stop_token_ids": stop_ids})  # fmt: skip
                    assert r.json()["choices"][0]["message"]["content"] == text, r.text
                    assert r.json()["choices"][0]["stop_reason"] == stop_reason, r.text
                    request = pb.GenerateRequest(text="hello", sampling=pb.SamplingOptions(
                        max_tokens=len(tokens), stop_token_ids=stop_ids))  # fmt: skip
                    out = [m async for m in stub.Generate(request)]
                    assert [t for m in out for t in m.token_ids] == tokens  # gRPC's ids: every token
                    assert "".join(m.text for m in out) == text and out[-1].finish_reason == reason
                # A stop string: the text ends before it, and it is the stop_reason.
                router.core.workers = ScriptedWorkers(hi + [bang], "length")
                body = {"model": name, "prompt": "hello", "max_tokens": 3, "stop": ["i"], "stream": True}
                events = [json.loads(x[6:]) for x in (await client.post("/v1/completions", json=body)).text.splitlines()
                          if x.startswith("data: {")]  # fmt: skip
                last = events[-1]["choices"][0]
                assert (last["finish_reason"], last["stop_reason"]) == ("stop", "i"), events
                assert "".join(e["choices"][0]["text"] for e in events) == "H"
        finally:
            await channel.close()

    serve_scripted(redis_server, tiny_model, run)


def serve_scripted(redis_server, tiny_model: str,  # noqa: ANN001
                   run: Callable[[Router, str, str], Coroutine[Any, Any, None]]) -> None:  # fmt: skip
    """``run(router, http_address, grpc_address)`` against a real router whose workers ``run``
    scripts (``router.core.workers = ScriptedWorkers(...)``)."""
    router = Router(RouterConfig(), EngineConfig(tiny_model),
                    IndexConfig(redis_server.url, namespace=unique_namespace()), {}, {})  # fmt: skip

    async def main() -> None:
        grpc_port = await router.start("127.0.0.1", 0)
        http_port = await router.start_http("127.0.0.1", 0)
        try:
            await asyncio.wait_for(run(router, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"), timeout=120)
        finally:
            await router.stop()

    asyncio.run(main())
