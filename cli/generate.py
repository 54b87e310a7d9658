"""``pdserve generate --model DIR|FILE.gguf``: run one prompt through an in-process engine."""

from __future__ import annotations

import time

from pdserve.cli.client import GenerateResult, print_result
from pdserve.engine.sampling_params import SamplingParams


def generate_offline(
    model: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None, as_json: bool,
    chat: bool = False,
) -> int:  # fmt: skip
    """Generate for ``prompt`` (with ``chat``: a text sent as one user message through the model's
    chat template) and print the result as ``--router`` does: the text ends before the first of
    ``params.stop`` (finish reason ``"stop"``), as it does there. ``model`` is a local checkpoint
    (a Hub id is resolved before). ValueError (a message for the user) on a bad prompt or
    parameters, or a model without a chat template under ``chat``."""
    from pdserve.engine.detokenizer import TextStream
    from pdserve.engine.llm import LLM

    if not prompt:
        raise ValueError("prompt: must not be empty")
    llm = LLM(model)
    t0 = time.perf_counter()
    engine = llm.engine
    if chat:
        assert isinstance(prompt, str)
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    else:
        ids = llm.encode(prompt) if isinstance(prompt, str) else prompt
    req = engine.add_request(ids, params, cache_salt=cache_salt)
    text = TextStream(llm.tokenizer, params.stop)
    result = GenerateResult()
    cached = 0
    while result.finish_reason is None:
        for out in engine.step():
            if out.request_id != req.request_id:
                continue
            if out.error is not None:
                raise out.error
            if out.new_token_ids and result.ttft_ms is None:
                result.ttft_ms = (time.perf_counter() - t0) * 1000
            result.token_ids.extend(out.new_token_ids)
            cached = out.num_cached_tokens
            result.text += text.push(out.new_token_ids, final=out.finished)
            if text.stopped is not None:  # a stop string: the text ends before it
                result.finish_reason = "stop"
                engine.abort(req.request_id)
            elif out.finished:
                result.finish_reason = out.finish_reason
    result.usage = {"prompt_tokens": len(ids), "completion_tokens": len(result.token_ids), "cached_tokens": cached,
                    "transferred_tokens": 0}  # fmt: skip
    print_result(result, as_json)
    return 0
