"""The OpenAI-compatible request bodies (pydantic) and their conversion to router requests.

Fields follow OpenAI's API and vLLM's extensions to it (``cache_salt``, ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``add_special_tokens``, ``add_generation_prompt``,
``chat_template_kwargs``, ``structured_outputs`` and the older ``guided_*``). A structured-output
constraint (``response_format``, ``structured_outputs`` or a ``guided_*`` field: one per request)
is built and checked with the grammar library here (``_Common.constraint``), so a bad one is a
400 before any worker sees it. Fields of either API that would change the output and that this
server cannot honour are refused by name (400) when set to anything but their neutral value
(``UNSUPPORTED``); fields it does not know at all are ignored, as OpenAI's clients send more over
time. Every string of a body, known field or not, must be valid Unicode (JSON's escapes can spell
a lone surrogate): 400 naming where, before anything else reads it. Chat messages reach the
model's template as vLLM passes them, tool-call history included (``ChatMessage.template_dict``).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from pdserve.engine.chat_template import reserved_variable
from pdserve.engine.sampling_params import MAX_LOGPROBS, SEED_RANGE, SamplingParams
from pdserve.engine.structured import ConstraintError, StructuredOutputsParams
from pdserve.engine.structured.request_fields import GUIDED_FIELDS, from_request
from pdserve.router.requests import InvalidRequest, Prompt, sampling_params

MAX_N = 16  # choices per request
MAX_PROMPTS = 64  # prompts in one completions request, times n
OPENAI_TEMPERATURE = 1.0  # OpenAI's default (pdserve's gRPC API defaults to greedy)
# chat_template_kwargs: at most this much JSON, this many variables, nested this deep.
MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
MAX_TEMPLATE_KWARGS = 64
MAX_TEMPLATE_KWARGS_DEPTH = 16
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")

Number = Annotated[float, Field(allow_inf_nan=False, strict=True)]  # an int is a number; true, "0.5" are not

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
    "guided_whitespace_pattern": (None,),
    "truncate_prompt_tokens": (None,),
    "truncation_side": (None,),
    "echo": (None, False),  # chat's (completions declares it and refuses it itself)
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "return_tokens_as_token_ids": (None, False),
    "logprob_token_ids": (None, []),
    "spaces_between_special_tokens": (None, True),
    "reasoning_effort": (None,),
}
# Assistant tool calls (with their parsed arguments) nest at most this deep in a message.
MAX_TOOL_CALLS_DEPTH = 16
CONTINUE_FINAL_MESSAGE = "continue_final_message: not supported by this server (leave it out or send False)"


def _invalid_unicode_at(data: Any) -> str | None:
    """Where the first string (a value or a key) of parsed JSON that is not valid Unicode is, as
    ``messages[0].content``; None when there is none. Iterative: nesting depth costs no stack."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(k, str) and not _valid(k):  # named escaped: the key itself cannot be encoded
                    escaped = k.encode("utf-8", "backslashreplace").decode("utf-8")
                    return f"{path}.{escaped}" if path else escaped
                sub = f"{path}.{k}" if path else str(k)
                if isinstance(v, (str, dict, list)):
                    stack.append((v, sub))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value) if isinstance(v, (str, dict, list)))
        elif isinstance(value, str) and not _valid(value):
            return path or "body"
    return None


def _valid(text: str) -> bool:
    if text.isascii():  # constant time: CPython records it
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _nulls_as_defaults(model: type[BaseModel], data: Any) -> Any:
    """``data`` without the nulls of fields that cannot be null: an explicit null is the default,
    as OpenAI's API reads it (``"n": null`` is 1, ``"stream": null`` false)."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items()
            if not (v is None and k in fields and type(None) not in get_args(fields[k].annotation))}  # fmt: skip


class StreamOptions(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _nulls_as_defaults(cls, data)

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage so far in every chunk


class _Body(BaseModel):
    """A request body: every string in it, known field or not, valid Unicode (400 naming where)."""

    model_config = ConfigDict(extra="allow")  # kept in model_extra, to refuse UNSUPPORTED ones by name

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if (where := _invalid_unicode_at(data)) is not None:
            raise PydanticCustomError("invalid_unicode", "{message}", {
                "message": f"{where}: not valid Unicode (it holds a lone surrogate: a JSON escape such as \\ud800 "
                           "without its pair)"})  # fmt: skip
        return _nulls_as_defaults(cls, data)


class _Common(_Body):
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
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: StrictStr | dict[str, Any] | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        """vLLM's rule: ``stream_options`` (set to anything but empty) only with ``stream: true``."""
        if isinstance(data, dict) and data.get("stream_options") and data.get("stream") is not True:
            raise PydanticCustomError("stream_options", "{message}", {
                "message": "stream_options: stream options can only be defined when stream=True"})  # fmt: skip
        return data

    def _refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and not any(type(extra[name]) is type(v) and extra[name] == v for v in neutral):
                raise InvalidRequest(f"{name}: not supported by this server (leave it out or send {neutral[-1]!r})")

    def params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """The sampling parameters of choice ``choice`` (of ``n``): with a seed, choice i samples
        with ``choice_seed(seed, i)``, so the n choices differ and each is reproducible."""
        self._refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return sampling_params(
            max_tokens=max_tokens,
            temperature=OPENAI_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=self.top_p,
            top_k=0 if self.top_k == -1 else self.top_k,  # -1: vLLM's "off"
            seed=None if self.seed is None else choice_seed(self.seed, choice),
            stop=tuple(stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            structured_outputs=None if (c := self.constraint()) is None else c[1],
        )

    def constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """The request's structured-output constraint and the field that sets it, built and
        checked with the grammar library (``engine/structured/request_fields.py``); InvalidRequest
        naming the field for two at once, a bad or unsupported one, or none buildable here."""
        guided = {name: getattr(self, name) for name in GUIDED_FIELDS}
        try:
            return from_request(self.response_format, self.structured_outputs, guided)
        except ConstraintError as e:
            raise InvalidRequest(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def choice_seed(seed: int, choice: int) -> int:
    """Choice ``choice``'s seed: ``seed + choice``, wrapped past the top of the seed range (a
    64-bit integer) to its unsigned bottom, so a seed near the top still serves every choice. A
    seed outside the range is returned as it is, for the sampling parameters to refuse by value."""
    top = SEED_RANGE[1]
    return seed + choice - top if seed < top <= seed + choice else seed + choice


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
    """A chat message: its text, and the tool-call history the model's template may render
    (an assistant's ``tool_calls``, a tool's ``tool_call_id``, any message's ``name``)."""

    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None

    def template_dict(self, i: int) -> dict[str, Any]:
        """The message as the chat template gets it, as vLLM passes it: ``role``, ``content``
        (text), ``name`` when given, an assistant's non-empty ``tool_calls`` (each function's
        ``arguments`` parsed to an object: templates expect one) and a tool's ``tool_call_id``.
        InvalidRequest names a refused part."""
        out: dict[str, Any] = {"role": self.role, "content": self.text(i)}
        if self.role == "assistant" and self.tool_calls:
            out["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(self.tool_calls)]
            if _depth(out["tool_calls"]) > MAX_TOOL_CALLS_DEPTH:
                raise InvalidRequest(f"messages[{i}].tool_calls: nested deeper than {MAX_TOOL_CALLS_DEPTH}")
        if self.role == "tool" and self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

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


def _tool_call(call: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's tool call for the template: a function call whose ``arguments`` (OpenAI's
    JSON text) are an object; arguments that are not a JSON object read as ``{}``, as vLLM reads
    them (a malformed call in the history must not fail every later turn)."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise InvalidRequest(f"{where}: only tool calls of type 'function' (with a function object) are supported")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool | None = None
    tools: list[Any] | None = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    def prompt(self) -> Prompt:
        """The chat as /tokenize renders it for the same fields: ``add_special_tokens`` as there
        (the template's special tokens only, unless true), ``continue_final_message`` refused."""
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs: true")
        if self.continue_final_message:
            raise InvalidRequest(CONTINUE_FINAL_MESSAGE)
        return chat_prompt(self.messages, self.add_generation_prompt, self.chat_template, self.chat_template_kwargs,
                           self.tools, add_special_tokens=bool(self.add_special_tokens))  # fmt: skip

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def chat_prompt(messages: list[ChatMessage], add_generation_prompt: bool, chat_template: Any,
                chat_template_kwargs: dict[str, Any] | None, tools: list[Any] | None,
                add_special_tokens: bool | None = None) -> Prompt:  # fmt: skip
    """The chat prompt of a request (chat completions, /tokenize): text messages, the model's
    own template and checked ``chat_template_kwargs``; InvalidRequest names a refused field."""
    if tools:
        raise InvalidRequest("tools: tool calling is not supported by this server")
    if chat_template is not None:
        # A template is code: a request's own would run on the router's shared threads, and
        # the sandbox bounds what it can reach, not the CPU or memory it takes (vLLM, too,
        # refuses it unless the operator trusts every client).
        raise InvalidRequest("chat_template: per-request chat templates are not supported by this server (the "
                             "model's template is used; set its variables with chat_template_kwargs)")  # fmt: skip
    texts = [m.template_dict(i) for i, m in enumerate(messages)]
    return Prompt(messages=texts, add_generation_prompt=add_generation_prompt, add_special_tokens=add_special_tokens,
                  chat_template_kwargs=template_kwargs(chat_template_kwargs))  # fmt: skip


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs``, checked: identifiers that do not replace what the template
    gets from the request or the tokenizer, and bounded in number, size and depth."""
    if not kwargs:
        return None
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequest(f"chat_template_kwargs: {len(kwargs)} variables, at most {MAX_TEMPLATE_KWARGS}")
    for name in kwargs:
        if not _IDENTIFIER.match(name):
            raise InvalidRequest(f"chat_template_kwargs: {name[:80]!r} is not a variable name (letters, digits "
                                 "and _, at most 64)")  # fmt: skip
        if (why := reserved_variable(name)) is not None:
            raise InvalidRequest(f"chat_template_kwargs.{name}: {why}")
    if _depth(kwargs) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise InvalidRequest(f"chat_template_kwargs: nested deeper than {MAX_TEMPLATE_KWARGS_DEPTH}")
    size = len(json.dumps(kwargs, ensure_ascii=False).encode("utf-8"))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequest(f"chat_template_kwargs: {size} bytes of JSON, at most {MAX_TEMPLATE_KWARGS_BYTES}")
    return kwargs


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and dicts (a scalar: 0), without recursing."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d + 1)
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


class TokenizeRequest(_Body):
    """vLLM's ``POST /tokenize``: a text ``prompt`` or chat ``messages`` (exactly one). Special
    tokens: a text gets the tokenizer's (BOS...) unless ``add_special_tokens`` is false; chat gets
    those its template writes, and the tokenizer's too only with ``add_special_tokens: true``
    (vLLM's defaults). ``return_token_strs``: each token's vocabulary entry as well."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False
    tools: list[Any] | None = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    def to_prompt(self) -> Prompt:
        """The prompt to tokenize; InvalidRequest names a refused field."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("prompt: give exactly one of prompt (a text) or messages (a chat)")
        if self.prompt is not None:
            return Prompt(text=self.prompt, add_special_tokens=self.add_special_tokens is not False)
        if self.continue_final_message:
            raise InvalidRequest(CONTINUE_FINAL_MESSAGE)
        assert self.messages is not None
        return chat_prompt(self.messages, self.add_generation_prompt, self.chat_template, self.chat_template_kwargs,
                           self.tools, add_special_tokens=bool(self.add_special_tokens))  # fmt: skip


class DetokenizeRequest(_Body):
    """vLLM's ``POST /detokenize``: ``tokens`` back to text, special tokens included."""

    model: StrictStr | None = None
    tokens: list[StrictInt]
