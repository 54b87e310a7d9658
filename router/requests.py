"""One request as both edges (gRPC, HTTP) hand it to the router core: prompt in, RequestSpec out.

The edges parse their wire format into a ``Prompt`` and ``SamplingParams``; ``prepare`` tokenizes
(text with the tokenizer's special tokens, chat through the model's template, ids as given) and
checks the request against the engines' limits, so nothing reaches a worker that it would refuse.
``InvalidRequest`` messages start with the offending field.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from typing import Any

from pdserve.engine.chat_template import ChatTemplateError
from pdserve.engine.limits import RequestLimits
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import ModelTokenizer, TooManyTokens
from pdserve.worker.messages import RequestSpec

MAX_CACHE_SALT_CHARS = 256
MAX_CHAT_MESSAGES = 1024


class InvalidRequest(ValueError):
    """The client's request is wrong (gRPC INVALID_ARGUMENT, HTTP 400); the message names the field."""


@dataclass(frozen=True)
class Prompt:
    """Exactly one of ``text``, ``token_ids`` and ``messages`` (chat: dicts with string ``role``
    and ``content``). ``add_special_tokens``: whether the tokenizer adds its special tokens (BOS...)
    to the text, or to the chat its template rendered; None: the default for the kind, as
    vLLM's: a text gets them, a chat only those its template writes. Ids are used as given."""

    text: str | None = None
    token_ids: Sequence[int] | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    add_special_tokens: bool | None = None
    split_special_tokens: bool = False
    add_generation_prompt: bool = True
    # Chat: more variables for the template (checked by the edge that takes them).
    chat_template_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("text", "token_ids", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise InvalidRequest(f"prompt: give exactly one of text, token ids or chat messages, got {given or 'none'}")


def tokenize(prompt: Prompt, tokenizer: ModelTokenizer, max_model_len: int | None = None) -> list[int]:
    """The prompt's token ids. With ``max_model_len``, a text (or rendered chat) with no room left
    to generate is refused with bounded work, mostly before it is tokenized
    (``ModelTokenizer.encode_limited``). Tokenizing takes a while on long text: call it off the
    event loop (the tokenizer itself releases the GIL)."""
    if prompt.text is not None:
        if not prompt.text:  # would be just the special tokens (e.g. BOS) the tokenizer adds
            raise InvalidRequest("prompt: the text must not be empty")
        return _encode(tokenizer, prompt.text, "prompt", max_model_len, prompt.add_special_tokens is not False,
                       prompt.split_special_tokens)  # fmt: skip
    if prompt.token_ids is not None:
        return [int(t) for t in prompt.token_ids]
    assert prompt.messages is not None
    messages = prompt.messages
    if not messages:
        raise InvalidRequest("messages: must not be empty")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"messages: {len(messages)} messages, at most {MAX_CHAT_MESSAGES}")
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidRequest(f"messages[{i}].role: must be a non-empty string")
        if not isinstance(m.get("content"), str):
            raise InvalidRequest(f"messages[{i}].content: must be a string")
    try:
        text = tokenizer.render_chat(messages, prompt.add_generation_prompt, **(prompt.chat_template_kwargs or {}))
    except ChatTemplateError as e:
        raise InvalidRequest(f"messages: {e}") from e
    return _encode(tokenizer, text, "messages", max_model_len, add_special_tokens=bool(prompt.add_special_tokens))


def _encode(tokenizer: ModelTokenizer, text: str, field: str, max_model_len: int | None,
            add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:  # fmt: skip
    check_unicode(text, field)
    if max_model_len is None:
        return tokenizer.encode(text, add_special_tokens, split_special_tokens)
    try:
        return tokenizer.encode_limited(text, max_model_len - 1, add_special_tokens, split_special_tokens)
    except TooManyTokens as e:
        raise InvalidRequest(f"{field}: {e.count}, more than the {max_model_len - 1} that leave room to generate "
                             f"within max_model_len={max_model_len}") from e


def check_unicode(text: str, field: str) -> None:
    """InvalidRequest when ``text`` is not valid Unicode: JSON's escapes can spell a lone
    surrogate (``"\\ud800"``), which no tokenizer, hash or response encoder takes."""
    if text.isascii():  # constant time: CPython records it
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{field}: not valid Unicode (a lone surrogate {text[e.start]!r} at character "
                             f"{e.start})") from None


def prepare(prompt: Prompt, params: SamplingParams, cache_salt: str | None, tokenizer: ModelTokenizer,
            limits: RequestLimits) -> RequestSpec:  # fmt: skip
    """Tokenize and check one request. Call it off the event loop (it tokenizes)."""
    return make_spec(tokenize(prompt, tokenizer, limits.max_model_len), params, cache_salt, limits)


def make_spec(ids: Sequence[int], params: SamplingParams, cache_salt: str | None,
              limits: RequestLimits) -> RequestSpec:  # fmt: skip
    """Check tokenized request against the engines' limits, before any worker spends work on it."""
    if cache_salt is not None and len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt: {len(cache_salt)} characters, at most {MAX_CACHE_SALT_CHARS}")
    try:
        limits.check(ids, params.max_tokens)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    # Workers always see a fresh id: a client reusing its own id (a retry) must never share
    # blocks or leases with an earlier request that is still held somewhere.
    return RequestSpec(uuid.uuid4().hex, tuple(ids), params, cache_salt or None)


def sampling_params(**fields: object) -> SamplingParams:
    """SamplingParams from the fields a client set; InvalidRequest names a refused one."""
    try:
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise InvalidRequest(str(e)) from e
