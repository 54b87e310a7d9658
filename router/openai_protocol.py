"""The OpenAI-compatible request bodies (pydantic) and their conversion to router requests.

Fields follow OpenAI's API and vLLM's extensions to it (``cache_salt``, ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``add_special_tokens``, ``add_generation_prompt``). Fields of
either API that would change the output and that this server cannot honour are refused by name
(400) when set to anything but their neutral value (``UNSUPPORTED``); fields it does not know at
all are ignored, as OpenAI's clients send more over time.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pdserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve.router.requests import InvalidRequest, Prompt, sampling_params

MAX_N = 16  # choices per request
MAX_PROMPTS = 64  # prompts in one completions request, times n
OPENAI_TEMPERATURE = 1.0  # OpenAI's default (pdserve's gRPC API defaults to greedy)

Number = Annotated[float, Field(allow_inf_nan=False)]

# Fields of OpenAI's or vLLM's API that change the output, with their neutral values: any other
# value is refused (never silently ignored).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "prompt_logprobs": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "functions": (None, []),
    "function_call": (None, "none"),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "truncate_prompt_tokens": (None,),
}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage so far in every chunk


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept in model_extra, to refuse UNSUPPORTED ones by name

    model: StrictStr
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    cache_salt: StrictStr | None = None

    def _refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and not any(type(extra[name]) is type(v) and extra[name] == v for v in neutral):
                raise InvalidRequest(f"{name}: not supported by this server (leave it out or send {neutral[-1]!r})")

    def params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """The sampling parameters of choice ``choice`` (of ``n``): with a seed, choice i samples
        with seed + i, so the n choices differ and each is reproducible."""
        self._refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return sampling_params(
            max_tokens=max_tokens,
            temperature=OPENAI_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,  # -1: vLLM's "off"
            seed=None if self.seed is None else self.seed + choice,
            stop=tuple(stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
    add_special_tokens: StrictBool = True

    def prompts(self) -> list[Prompt]:
        if self.echo:
            raise InvalidRequest("echo: not supported by this server")
        if self.suffix:
            raise InvalidRequest("suffix: not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of: not supported by this server (leave it out or equal to n)")
        p = self.prompt
        if isinstance(p, str):
            prompts = [Prompt(text=p, add_special_tokens=self.add_special_tokens)]
        elif not p:
            raise InvalidRequest("prompt: must not be empty")
        elif all(isinstance(x, int) for x in p):
            prompts = [Prompt(token_ids=p)]  # type: ignore[arg-type]
        elif all(isinstance(x, str) for x in p):
            prompts = [Prompt(text=x, add_special_tokens=self.add_special_tokens) for x in p]  # type: ignore[arg-type]
        else:
            prompts = [Prompt(token_ids=x) for x in p]  # type: ignore[arg-type]
        if len(prompts) * self.n > MAX_PROMPTS:
            raise InvalidRequest(f"prompt: {len(prompts)} prompts x n={self.n} choices, at most {MAX_PROMPTS}")
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None

    def text(self, i: int) -> str:
        """The content as one string: text parts are joined; other parts (images...) are refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content[{j}]: only text parts are supported, got {part.get('type')!r}")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def prompt(self) -> Prompt:
        if self.tools:
            raise InvalidRequest("tools: tool calling is not supported by this server")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequest("response_format: only {'type': 'text'} is supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs: true")
        messages = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]
        return Prompt(messages=messages, add_generation_prompt=self.add_generation_prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
