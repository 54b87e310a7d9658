"""A small client of the router's gRPC API (``pdserve generate --router``, the demo, tests)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import grpc

from pdserve.engine.sampling_params import SamplingParams
from pdserve.security import TLSConfig
from pdserve.v1 import router_pb2 as pb
from pdserve.v1 import router_pb2_grpc as pb_grpc


@dataclass
class GenerateResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    ttft_ms: float | None = None

    def to_json(self) -> dict:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "ttft_ms": self.ttft_ms,
        }


def build_request(
    prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None, request_id: str = "",
    chat: bool = False,
) -> pb.GenerateRequest:
    """The gRPC request; with ``chat``, the text ``prompt`` goes as one user message that the
    router renders with the model's chat template. ValueError for an empty prompt."""
    req = pb.GenerateRequest(request_id=request_id, cache_salt=cache_salt or "")
    if chat:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt: --chat needs a non-empty text prompt")
        req.chat.messages.add(role="user", content=prompt)
    elif isinstance(prompt, str):
        req.text = prompt
    elif not prompt:
        raise ValueError("prompt: must not be empty")
    else:
        req.token_ids.ids.extend(prompt)
    s = req.sampling
    s.max_tokens = params.max_tokens
    s.temperature = params.temperature
    s.top_p = params.top_p
    s.top_k = params.top_k
    if params.seed is not None:
        s.seed = params.seed
    s.stop_token_ids.extend(params.stop_token_ids)
    s.stop.extend(params.stop)
    s.ignore_eos = params.ignore_eos
    return req


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries the router's API key (None: no key, no metadata)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def generate(
    stub: pb_grpc.RouterStub, request: pb.GenerateRequest, timeout_s: float | None = 120.0,
    api_key: str | None = None,
) -> GenerateResult:  # fmt: skip
    """Consume one Generate stream (with ``api_key``: sent as ``authorization: Bearer KEY``);
    raises grpc.RpcError on a failed call."""
    out = GenerateResult()
    t0 = time.perf_counter()
    for resp in stub.Generate(request, timeout=timeout_s, metadata=auth_metadata(api_key)):
        if out.ttft_ms is None and resp.token_ids:
            out.ttft_ms = (time.perf_counter() - t0) * 1000
        out.token_ids.extend(resp.token_ids)
        out.text += resp.text
        if resp.HasField("usage"):
            u = resp.usage
            out.usage = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "cached_tokens": u.cached_tokens,
                "transferred_tokens": u.transferred_tokens,
            }
        if resp.finished:
            out.finish_reason = resp.finish_reason
    return out


def router_channel(address: str, tls: TLSConfig | None = None) -> grpc.Channel:
    """A channel to the router: plaintext, or TLS (mutual when ``tls`` has a certificate)."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())


def generate_via_router(
    address: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None, as_json: bool,
    tls: TLSConfig | None = None, api_key: str | None = None, chat: bool = False,
) -> int:  # fmt: skip
    request = build_request(prompt, params, cache_salt, chat=chat)
    with router_channel(address, tls) as channel:
        try:
            result = generate(pb_grpc.RouterStub(channel), request, api_key=api_key)
        except grpc.RpcError as e:
            print(f"pdserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print_result(result, as_json)
    return 0


def print_result(result: GenerateResult, as_json: bool) -> None:
    """One JSON object, or the text followed by a line with the token ids and why it stopped
    (the text of a random or tokenizer-less model says little; the ids always do)."""
    if as_json:
        print(json.dumps(result.to_json()))
        return
    print(result.text)
    u = result.usage
    print(f"[{result.finish_reason}; {len(result.token_ids)} tokens: {','.join(map(str, result.token_ids))}; "
          f"prompt {u.get('prompt_tokens', 0)}, cached {u.get('cached_tokens', 0)}, "
          f"transferred {u.get('transferred_tokens', 0)}]")  # fmt: skip
