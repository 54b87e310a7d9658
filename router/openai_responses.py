"""OpenAI-shaped response bodies: completions, chat completions, their stream chunks, usage,
logprobs and error objects (plain dicts, ready for JSON)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.detokenizer import TokenDecoder
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.router.output import Chunk, Usage

# JSON has no -inf: a token the model gives no chance is reported at this log-probability (as vLLM does).
MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class ResponseHead:
    """What every body and chunk of one response repeats: its ``id``, the served ``model`` name
    and ``created``, taken once per request (as vLLM does: every chunk of a stream has the same)."""

    id: str
    model: str
    created: int = field(default_factory=now)

    def fields(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage_body(prompt: Sequence[Usage], completion_tokens: int) -> dict:
    """Usage of a request: each prompt counted once (however many choices it has)."""
    p = sum(u.prompt_tokens for u in prompt)
    return {
        "prompt_tokens": p,
        "completion_tokens": completion_tokens,
        "total_tokens": p + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(u.cached_tokens for u in prompt),
            # pdserve's own: prompt tokens whose KV the decode worker pulled over the wire.
            "transferred_tokens": sum(u.transferred_tokens for u in prompt),
        },
    }


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


class LogprobFormat:
    """Token strings for logprobs: each token decoded alone, special tokens included."""

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, lps: Sequence[TokenLogprobs]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
            ],
            "refusal": None,
        }

    def completion(self, lps: Sequence[TokenLogprobs], offset: int) -> tuple[dict, int]:
        """The legacy completions logprobs object; ``offset``: where the first token's text starts
        in the choice's text. Returns it and the offset after the last token."""
        tokens, offsets = [], []
        for lp in lps:
            offsets.append(offset)
            tokens.append(self.token(lp.token_id))
            offset += len(tokens[-1])
        body = {
            "tokens": tokens,
            "token_logprobs": [_lp(lp.logprob) for lp in lps],
            # As OpenAI's and vLLM's: the sampled token and the top alternatives.
            "top_logprobs": [
                {self.token(lp.token_id): _lp(lp.logprob), **{self.token(t): _lp(v) for t, v in lp.top}} for lp in lps
            ],
            "text_offset": offsets,
        }
        return body, offset


@dataclass
class ChoiceState:
    """One choice as it streams: its text so far and logprobs (unless ``keep`` is false: a stream
    sends them as they come and needs neither), finish reason and latest usage."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage = field(default_factory=Usage)
    offset: int = 0  # legacy logprobs: text offset of the next token
    started: bool = False  # chat streams: the role chunk was sent
    keep: bool = True

    def add(self, chunk: Chunk) -> None:
        if self.keep:
            self.text.append(chunk.text)
            if chunk.logprobs:
                self.logprobs.extend(chunk.logprobs)
        if chunk.finished:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason
        self.usage = chunk.usage


def request_usage(choices: Sequence[ChoiceState], n: int) -> dict:
    """``choices`` in order, ``n`` per prompt: prompt usage from each prompt's choices (the most
    cached of them: siblings may hit what the first computed), completion tokens of all."""
    per_prompt = []
    for i in range(0, len(choices), n):
        group = [c.usage for c in choices[i : i + n]]
        per_prompt.append(max(group, key=lambda u: (u.cached_tokens, u.transferred_tokens)))
    return usage_body(per_prompt, sum(c.usage.completion_tokens for c in choices))


def completion_body(head: ResponseHead, choices: Sequence[ChoiceState], n: int, fmt: LogprobFormat,
                    logprobs: bool) -> dict:  # fmt: skip
    out = []
    for i, c in enumerate(choices):
        lp = fmt.completion(c.logprobs, 0)[0] if logprobs else None
        out.append({"index": i, "text": "".join(c.text), "logprobs": lp, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason})  # fmt: skip
    return {**head.fields("text_completion"), "choices": out, "usage": request_usage(choices, n)}


def chat_body(head: ResponseHead, choices: Sequence[ChoiceState], n: int, fmt: LogprobFormat,
              logprobs: bool) -> dict:  # fmt: skip
    out = []
    for i, c in enumerate(choices):
        out.append({
            "index": i,
            "message": {"role": "assistant", "content": "".join(c.text)},
            "logprobs": fmt.chat(c.logprobs) if logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        })  # fmt: skip
    return {**head.fields("chat.completion"), "choices": out, "usage": request_usage(choices, n)}


def completion_chunk(head: ResponseHead, index: int, state: ChoiceState, chunk: Chunk, fmt: LogprobFormat,
                     logprobs: bool) -> dict:  # fmt: skip
    lp = None
    if logprobs and chunk.logprobs:
        lp, state.offset = fmt.completion(chunk.logprobs, state.offset)
    choice = {"index": index, "text": chunk.text, "logprobs": lp,
              "finish_reason": chunk.finish_reason if chunk.finished else None,
              "stop_reason": chunk.stop_reason if chunk.finished else None}  # fmt: skip
    return {**head.fields("text_completion"), "choices": [choice]}


def chat_chunk(head: ResponseHead, index: int, state: ChoiceState, chunk: Chunk, fmt: LogprobFormat,
               logprobs: bool) -> dict:  # fmt: skip
    """A choice's text (and logprobs, finish reason) as it streams; its role went in ``role_chunk``."""
    delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": fmt.chat(chunk.logprobs) if logprobs and chunk.logprobs else None,
        "finish_reason": chunk.finish_reason if chunk.finished else None,
        "stop_reason": chunk.stop_reason if chunk.finished else None,
    }
    return {**head.fields("chat.completion.chunk"), "choices": [choice]}


def role_chunk(head: ResponseHead, index: int, usage: dict | None = None) -> dict:
    """The first chunk of a streamed chat choice, as OpenAI and vLLM send it: the role and an
    empty content, nothing else (``usage``: vLLM's continuous usage, nothing generated yet)."""
    choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    body = {**head.fields("chat.completion.chunk"), "choices": [choice]}
    return body if usage is None else {**body, "usage": usage}


def usage_chunk(head: ResponseHead, obj: str, usage: dict) -> dict:
    return {**head.fields(obj), "choices": [], "usage": usage}
