"""``pdserve generate --model DIR``: run one prompt through an in-process engine."""

from __future__ import annotations

import json
import time

from pdserve.engine.sampling_params import SamplingParams


def generate_offline(
    model_dir: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None, as_json: bool
) -> int:
    from pdserve.engine.llm import LLM

    llm = LLM(model_dir)
    t0 = time.perf_counter()
    engine = llm.engine
    ids = llm.encode(prompt) if isinstance(prompt, str) else prompt
    req = engine.add_request(ids, params, cache_salt=cache_salt)
    tokens: list[int] = []
    ttft_ms: float | None = None
    reason = None
    cached = 0
    while reason is None:
        for out in engine.step():
            if out.request_id != req.request_id:
                continue
            if out.new_token_ids and ttft_ms is None:
                ttft_ms = (time.perf_counter() - t0) * 1000
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
            if out.finished:
                reason = out.finish_reason
    text = llm.decode(tokens)
    if as_json:
        print(
            json.dumps(
                {
                    "token_ids": tokens,
                    "text": text,
                    "finish_reason": reason,
                    "usage": {"prompt_tokens": len(ids), "cached_tokens": cached, "transferred_tokens": 0},
                    "ttft_ms": ttft_ms,
                }
            )
        )
    else:
        print(text)
    return 0
