"""Offline API: ``LLM(model, **options).generate(prompts, params)`` and ``.chat(conversations, params)``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.detokenizer import TextStream, stop_token, text_tokens
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs

Message = Mapping[str, Any]

_CACHE_KEYS = {f for f in CacheConfig.__dataclass_fields__}
_SCHED_KEYS = {f for f in SchedulerConfig.__dataclass_fields__}
_PARALLEL_KEYS = {f for f in ParallelConfig.__dataclass_fields__}


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" (aborted from another thread)
    num_cached_tokens: int = 0
    # vLLM's stop_reason: the stop string or the stop token id that ended it (None for EOS, length, abort).
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per token, when the params asked for them


def build_engine_config(model: str, **options: Any) -> EngineConfig:
    """Split flat keyword options into the component configs; unknown names are an error."""
    cache = {k: options.pop(k) for k in list(options) if k in _CACHE_KEYS}
    sched = {k: options.pop(k) for k in list(options) if k in _SCHED_KEYS}
    parallel = {k: options.pop(k) for k in list(options) if k in _PARALLEL_KEYS}
    engine_keys = {"dtype", "device", "cpu_onednn", "cpu_fp32_gemm", "disable_cascade_attn"}
    unknown = set(options) - engine_keys
    if unknown:
        raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
    return EngineConfig(str(model), cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched),
                        parallel=ParallelConfig(**parallel), **options)  # fmt: skip


class LLM:
    """Generates completions for a batch of prompts with continuous batching.

    Options are the fields of ``CacheConfig`` (block_size, num_blocks, ...),
    ``SchedulerConfig`` (max_num_batched_tokens, max_num_seqs, max_model_len),
    ``ParallelConfig`` (tensor_parallel_size, ...) and ``EngineConfig`` (dtype, device, cpu_onednn,
    cpu_fp32_gemm, disable_cascade_attn).
    """

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = LLMEngine(build_engine_config(model, **options))
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Release the engine's disk tier and tensor-parallel ranks, if it has them (``LLMEngine.close``)."""
        self.engine.close()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, special tokens added the way the tokenizer says (BOS for Llama 3)."""
        return self.tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[CompletionOutput]:
        """``generate`` over conversations rendered with the model's chat template (one
        conversation, a list of ``{"role", "content"}`` messages, or a list of them)."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.tokenizer.encode_chat(list(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, params, cache_salt)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[CompletionOutput]:
        """One output per prompt, in order. Prompts are strings or lists of token ids.

        All prompts are validated before any is queued, so a bad prompt leaves nothing behind.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        if engine.driver is not None:
            raise RuntimeError("this engine is stepped by an EngineLoop: submit requests to the loop instead")
        if any(isinstance(p, int) for p in prompts):
            raise ValueError("prompts: each prompt is a string or a list of token ids "
                             "(wrap a single tokenized prompt in a list: [[1, 2, 3]])")
        if any(isinstance(p, str) and not p for p in prompts):
            raise ValueError("prompt: must not be empty")
        id_lists = [self.encode(p) if isinstance(p, str) else p for p in prompts]
        reqs = [engine.make_request(ids, p, cache_salt=cache_salt) for ids, p in zip(id_lists, plist)]
        outputs = {r.request_id: CompletionOutput(r.request_id, r.prompt_token_ids) for r in reqs}
        texts = {r.request_id: TextStream(self.tokenizer, r.sampling_params.stop) for r in reqs}
        stop_ids = {r.request_id: r.sampling_params.stop_token_ids for r in reqs}
        for r in reqs:
            engine.enqueue(r)
        try:
            while any(o.finish_reason is None for o in outputs.values()):
                for step_out in engine.step():
                    o = outputs.get(step_out.request_id)
                    if o is None or o.finish_reason is not None:
                        continue
                    if step_out.error is not None:
                        raise step_out.error
                    o.token_ids.extend(step_out.new_token_ids)
                    if step_out.logprobs is not None:
                        o.logprobs = (o.logprobs or []) + step_out.logprobs
                    o.num_cached_tokens = step_out.num_cached_tokens
                    text = texts[o.request_id]
                    shown = text_tokens(step_out.new_token_ids, step_out.finished, step_out.finish_reason)
                    o.text += text.push(shown, final=step_out.finished)
                    if text.stopped is not None:  # a stop string: the text ends before it
                        o.finish_reason, o.stop_reason = "stop", text.stopped
                        engine.abort(o.request_id)
                    elif step_out.finished:
                        o.finish_reason = step_out.finish_reason
                        o.stop_reason = stop_token(o.token_ids, o.finish_reason, stop_ids[o.request_id])
                # Aborted elsewhere (engine.abort from another thread): no output will come.
                for rid, o in outputs.items():
                    if o.finish_reason is None and rid not in engine.requests:
                        o.finish_reason = "abort"
        except BaseException:
            for rid in outputs:
                engine.abort(rid)
            raise
        return [outputs[r.request_id] for r in reqs]
