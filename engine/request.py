"""Request: one sequence's tokens, progress and block hashes (pure Python)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.engine.kvcache.hashing import BlockHasher
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.structured import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # its prompt's KV is being loaded from outside (KV handover)
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Prefilled here, first token sampled, KV held for another engine to continue it (KV handover).
    FINISHED_HANDED_OFF = "handoff"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED_")


class Request:
    """A generation request. ``all_token_ids`` is prompt + output; ``block_hashes`` grows with it.

    ``num_computed_tokens`` counts tokens whose KV is in the request's blocks;
    ``num_cached_tokens`` the prompt tokens whose KV was found rather than computed here (a
    prefix-cache hit, or KV handed over), known once the request is first scheduled or loaded.
    ``handoff``: after its prefill and first sampled token the request ends here with its KV
    held for another engine (KV-handover API), unless that token already ends it.
    ``grammar``: the state of its structured-output constraint, if it has one: every output
    token advances it once, as it is appended (so a recomputed request, whose old tokens are not
    appended again, never advances it twice); a token it refuses is a ValueError, and a grammar
    that ended (matched in full, then EOS) ends the request with ``FINISHED_STOPPED``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        block_size: int,
        hash_seed: str = "0",
        cache_salt: str | None = None,
        lora_name: str | None = None,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int | None = None,
        handoff: bool = False,
        grammar: GrammarState | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.cache_salt = cache_salt or None  # an empty salt is no salt
        self.lora_name = lora_name
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len  # prompt + output never exceed it
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.counted_in_prefix_stats = False  # its prefix lookup was counted (at its first admission)
        self.handoff = handoff
        self.grammar = grammar
        self.hasher = BlockHasher(block_size, seed=hash_seed, cache_salt=cache_salt, lora_name=lora_name)
        self.hasher.extend(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        return self.hasher.hashes

    def append_output_token(self, token_id: int) -> None:
        if self.grammar is not None and not self.grammar.accept(token_id):
            raise ValueError(f"request {self.request_id!r}: token {token_id} is not allowed by its structured-output "
                             "constraint here")  # fmt: skip
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.hasher.extend((token_id,))

    def check_stop(self) -> RequestStatus | None:
        """The finished status if the last output token ends the request, else None."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={len(self.output_token_ids)}, {self.status.value})"
