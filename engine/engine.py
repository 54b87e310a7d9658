"""LLMEngine: one model, one paged KV cache, a continuous batch.

``add_request`` validates and queues; each ``step`` schedules a batch, runs it and
returns what every request produced. Every block a request takes is returned when it
finishes, is aborted or fails. All public methods hold ``self.lock``, so another
thread (a KV-transfer server reading the same pool) may share the engine.
"""

from __future__ import annotations

import operator
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheTensor, KVLayout
from engine.kvcache.events import EventSink
from engine.kvcache.manager import KVCacheManager, blocks_for_request
from engine.model import ModelConfig, load_model, load_tokenizer
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    """What one request produced in one step (``new_token_ids`` is empty mid-prefill)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length"; an aborted request gets no further output
    num_prompt_tokens: int
    num_cached_tokens: int


def _token_ids(prompt_token_ids: Sequence[int]) -> list[int]:
    """Plain ints from any integer sequence (numpy and 0-d tensor ids too); bools are refused."""
    if isinstance(prompt_token_ids, (str, bytes)):
        raise ValueError("prompt_token_ids: must be a sequence of integer token ids, got a string")
    try:
        items = list(prompt_token_ids)
    except TypeError:
        raise ValueError(
            f"prompt_token_ids: must be a sequence of integer token ids, got {type(prompt_token_ids).__name__}"
        ) from None
    ids: list[int] = []
    for t in items:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise ValueError(f"prompt_token_ids: {t!r} is not an integer token id") from None
    return ids


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, config: EngineConfig, event_sink: EventSink | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        dtype = _DTYPES[config.dtype] if config.dtype else None
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.model = load_model(config.model_dir, dtype=dtype, device=self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.onednn = config.cpu_onednn and self.model.pack_onednn()
        mc = self.model_config
        self.max_model_len = min(config.scheduler.max_model_len or mc.max_context_len, mc.max_context_len)
        cc = config.cache
        self.layout = KVLayout(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, cc.block_size, self.dtype)
        num_blocks = cc.num_blocks or max(1, self.layout.num_blocks_for_budget(cc.kv_cache_memory_bytes))
        self.kv_cache = KVCacheTensor(self.layout, num_blocks, self.device)
        medium = "GPU" if self.device.type == "cuda" else "CPU"
        self.kv = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching, medium, event_sink)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(self.model, self.kv_cache, cc.block_size)
        self.requests: dict[str, Request] = {}
        self.lock = threading.RLock()

    # -- requests ---------------------------------------------------------------------------
    def make_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate a prompt and build its Request (not queued). Errors name the field."""
        ids = _token_ids(prompt_token_ids)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids: {t} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={self.max_model_len}"
            )
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        need = blocks_for_request(len(ids), params.max_tokens, self.max_model_len, self.layout.block_size)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"prompt: {len(ids)} tokens + max_tokens={params.max_tokens} need "
                f"{need} KV blocks but the pool has {self.kv.num_blocks}"
            )
        rid = request_id or uuid.uuid4().hex
        if rid in self.requests or self.kv.get_blocks(rid):
            raise ValueError(f"request_id: {rid!r} is already in use")
        return Request(
            rid,
            ids,
            params,
            self.layout.block_size,
            hash_seed=self.config.cache.hash_seed,
            cache_salt=cache_salt,
            eos_token_ids=self.model_config.eos_token_ids,
            max_model_len=self.max_model_len,
        )

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        with self.lock:
            req = self.make_request(prompt_token_ids, params, request_id, cache_salt)
            self.enqueue(req)
            return req

    def enqueue(self, request: Request) -> None:
        """Queue a request built by :meth:`make_request` (ValueError if its id became live since)."""
        with self.lock:
            rid = request.request_id
            if rid in self.requests or self.kv.get_blocks(rid):
                raise ValueError(f"request_id: {rid!r} is already in use")
            self.requests[rid] = request
            self.scheduler.add(request)

    def add_running(self, request: Request) -> None:
        """Continue ``request`` whose KV already sits in the blocks it holds (a decode handover).

        Its ``num_computed_tokens`` must cover all but its last token (the one to decode next).
        """
        with self.lock:
            if request.num_computed_tokens != request.num_tokens - 1:
                raise ValueError(
                    f"request {request.request_id!r}: {request.num_computed_tokens} computed of {request.num_tokens} tokens"
                )
            if request.request_id in self.requests:
                raise ValueError(f"request_id: {request.request_id!r} is already in use")
            if request.num_tokens >= self.max_model_len or request.check_stop() is not None:
                raise ValueError(f"request {request.request_id!r} has already finished ({request!r})")
            self.requests[request.request_id] = request
            self.scheduler.add_running(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request and return its blocks; False if it is unknown or already finished."""
        with self.lock:
            req = self.requests.pop(request_id, None)
            if req is None:
                return False
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self.runner.sampler.forget(request_id)
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.lock:
            out = self.scheduler.schedule()
            if not out.scheduled:
                return []
            block_ids = [self.kv.get_block_ids(s.request.request_id) for s in out.scheduled]
            try:
                tokens = self.runner.execute(out.scheduled, block_ids)
            except BaseException:
                # A failed forward must not strand blocks, nor leave cached hashes on blocks
                # whose KV it never wrote: uncache this step's blocks, abort the batch.
                for s in out.scheduled:
                    self.kv.uncache_blocks(s.request, s.request.num_computed_tokens)
                    self.abort(s.request.request_id)
                raise
            outputs: list[RequestOutput] = []
            sampled = iter(tokens)
            for s in out.scheduled:
                req = s.request
                req.num_computed_tokens += s.num_new_tokens
                new: list[int] = []
                status = None
                if s.samples:
                    tok = next(sampled)
                    req.append_output_token(tok)
                    new.append(tok)
                    status = req.check_stop()
                if status is not None:
                    self.scheduler.finish(req, status)
                    self.requests.pop(req.request_id, None)
                    self.runner.sampler.forget(req.request_id)
                outputs.append(
                    RequestOutput(
                        req.request_id,
                        new,
                        status is not None,
                        status.value if status else None,
                        req.num_prompt_tokens,
                        max(req.num_cached_tokens, 0),
                    )
                )
            return outputs
