"""The plain dataclasses passed between router, prefill and decode workers (pickled by Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    cache_salt: str | None = None


@dataclass(frozen=True)
class PrefillResult:
    """A finished prefill: the first token, and where its KV is held (``lease_id`` at ``address``)."""

    request_id: str
    first_token: int
    finished: bool  # the first token already ends the request (stop token or max_tokens == 1)
    finish_reason: str | None
    lease_id: str | None  # None when finished: nothing is held
    address: str
    worker_id: str
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefill worker found in its own prefix cache
    first_logprobs: TokenLogprobs | None = None  # when the params ask for logprobs


@dataclass(frozen=True)
class DecodeEvent:
    """One message of a decode stream; ``usage`` fields are final when ``finished``."""

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    num_local_hit_tokens: int = 0  # prompt tokens found in the decode worker's own cache
    num_transferred_tokens: int = 0
    num_recomputed_tokens: int = 0  # prompt tokens recomputed after a failed pull
    logprobs: tuple[TokenLogprobs, ...] | None = None  # one per token, when the params ask for them
    pull_bytes: int = 0  # KV bytes pulled for this request (the router's cost model fits its link on it)


class ChannelClosedError(RuntimeError):
    """A decode worker's refusal of a request sent for an event channel it does not have open (its
    reader stopped reading it, or the worker restarted): nothing of the request ran."""
