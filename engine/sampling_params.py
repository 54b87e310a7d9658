"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.engine.structured.params import StructuredOutputsParams

# Temperatures below this sample greedily: dividing logits by a tinier one overflows float32.
GREEDY_TEMPERATURE = 1e-5
# What torch.Generator.manual_seed accepts.
SEED_RANGE = (-(2**63), 2**64)
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256  # checked against every generated token


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options. ``temperature`` below ``GREEDY_TEMPERATURE`` (1e-5),
    0 included, means greedy.

    ``stop``: strings that end the request when they appear in its text; the text is cut before
    them. The engine works in tokens and leaves them to whoever detokenizes (the offline ``LLM``,
    the router). ``logprobs``: return the sampled token's log-probability and that many top
    alternatives (0: only the sampled one), from the model's distribution before temperature,
    top-k and top-p (vLLM's ``raw_logprobs``), and before a structured-output constraint.
    ``structured_outputs``: the constraint the output follows (``pdserve.engine.structured``);
    the engine refuses one it cannot compile (``ValueError`` naming the field).

    Validation errors name the offending field.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
            0.0 <= self.temperature < math.inf
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
            or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: {len(self.stop_token_ids)} ids, at most {MAX_STOP_TOKEN_IDS}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if len(stop) > MAX_STOP_STRINGS or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the ``top`` alternatives (id, log-probability), best
    first, under the model's distribution (before temperature, top-k and top-p)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
