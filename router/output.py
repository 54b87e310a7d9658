"""What a client receives: the router core's token events turned into text, cut at stop strings.

Both edges iterate ``stream_output``; it detokenizes incrementally, applies the request's stop
strings (the request ends when one appears, as vLLM does: the text stops before it, finish reason
"stop") and counts the generated tokens for ``usage``. A request that a worker ends with finish
reason "stop" ended on a stop token (EOS, one of its ``stop_token_ids``, or the EOS that completes
a structured-output constraint): as in vLLM, that token's text is not part of the output, while its
id stays in ``token_ids`` and in ``usage``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.engine.detokenizer import TextStream, TokenDecoder, stop_token, text_tokens
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.router.core import Outcome, RouterCore
from pdserve.worker.messages import RequestSpec


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    transferred_tokens: int = 0  # prompt tokens whose KV was pulled over the wire

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Chunk:
    """New tokens and the text that became final with them (possibly empty: text that may still
    turn out to be part of a stop string or of a multi-byte character waits)."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    usage: Usage
    ttft_ms: float | None = None
    logprobs: list[TokenLogprobs] | None = field(default=None)
    # vLLM's stop_reason, on the finishing chunk: the stop string or the stop token id (one of the
    # request's stop_token_ids) that ended it; None otherwise (EOS, length).
    stop_reason: str | int | None = None


async def stream_output(core: RouterCore, spec: RequestSpec, tokenizer: TokenDecoder) -> AsyncIterator[Chunk]:
    """Stream one request's output. Errors of the core (``Overloaded``, ``Draining``,
    ``WorkerUnavailableError``, a worker's ``ValueError``) pass through. A stop string ends the
    request here: the core's stream is closed, which cancels the work behind it."""
    text = TextStream(tokenizer, spec.params.stop)
    completion = 0
    outcome = Outcome()
    async with contextlib.aclosing(core.generate(spec, outcome)) as events:
        async for ev in events:
            completion += len(ev.token_ids)
            delta = text.push(text_tokens(ev.token_ids, ev.finished, ev.finish_reason), final=ev.finished)
            stopped = text.stopped is not None
            usage = Usage(
                ev.usage.get("prompt_tokens", len(spec.prompt_token_ids)), completion,
                ev.usage.get("cached_tokens", 0), ev.usage.get("transferred_tokens", 0),
            )  # fmt: skip
            finished = ev.finished or stopped
            reason = "stop" if stopped else ev.finish_reason
            if stopped:
                outcome.finish_reason = "stop"  # the core's stream is closed next: not an abort
            stop_reason = text.stopped if stopped else stop_token(ev.token_ids, reason, spec.params.stop_token_ids)
            yield Chunk(list(ev.token_ids), delta, finished, reason, usage, ev.ttft_ms, ev.logprobs, stop_reason)
            if finished:
                return
