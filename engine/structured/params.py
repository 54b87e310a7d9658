"""StructuredOutputsParams: the one constraint a request's output must follow (pure Python).

vLLM's ``StructuredOutputsParams`` under its names: exactly one of ``json`` (a JSON schema),
``regex``, ``choice`` (one of a list of strings), ``grammar`` (EBNF as llama.cpp's GBNF writes it,
or Lark) and ``json_object`` (any JSON object). ``disable_any_whitespace``: JSON on one line with
``", "`` and ``": "`` between items (else whitespace between items is free, at most
``MAX_JSON_WHITESPACE`` characters a run). The library that compiles it is imported only when a
request carries one (``pdserve.engine.structured.backend``); this module checks what it can
without it: shapes, types and sizes. Errors are ``ConstraintError`` naming the field.
"""

from __future__ import annotations

import json as _json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# A constraint's text (schema, regex, grammar, all choices together) in UTF-8 bytes, at most: it
# is compiled on every worker that serves it, and sent with every request that carries it.
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_CHOICES = 1024
# Whitespace between JSON items: at most this many characters a run, so a model that favours
# whitespace cannot fill its output with it between two items; a newline and four levels of
# four-space indentation still fit.
MAX_JSON_WHITESPACE = 20
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class ConstraintError(ValueError):
    """A constraint that cannot be used: ``kind`` names its field (``json``, ``regex``, ...),
    ``reason`` says why; ``str()`` is ``"kind: reason"``."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason

    def __reduce__(self) -> tuple[type[ConstraintError], tuple[str, str]]:
        return ConstraintError, (self.kind, self.reason)  # picklable: a worker's error reaches the router


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint; frozen and hashable (it keys the compiled-grammar cache) and picklable (it
    travels with ``SamplingParams`` to the workers).

    ``json`` may be given as a dict or as JSON text; it is kept as JSON text, in the given key
    order (a schema's properties are generated in the order it lists them). ``choice`` is kept as
    a tuple. The output of a request under a constraint is text the constraint matches in full
    once the request ends with finish reason ``"stop"``; a request cut by ``max_tokens`` (or a
    stop string, or a stop token id of the request's own) ends where it was cut.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, Mapping):
            try:
                object.__setattr__(self, "json", _json.dumps(dict(self.json), ensure_ascii=False))
            except RecursionError:  # nested past what the encoder's recursion takes
                raise ConstraintError("json", "nested too deeply") from None
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        for flag in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, flag), bool):
                raise ConstraintError(flag, f"must be true or false, got {_short(getattr(self, flag))}")
        given = [k for k in KINDS if (self.json_object if k == "json_object" else getattr(self, k) is not None)]
        if len(given) != 1:
            raise ConstraintError("structured_outputs", f"give exactly one of {', '.join(KINDS)}; got "
                                                        f"{' and '.join(given) if given else 'none'}")  # fmt: skip
        if self.json is not None and not isinstance(self.json, str):
            raise ConstraintError("json", f"a JSON schema must be an object (or its JSON text), got "
                                          f"{_short(self.json)}")  # fmt: skip
        for kind in ("json", "regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConstraintError(kind, f"must be a non-empty string, got {_short(value)}")
        if self.json is not None:
            _check_schema_text(self.json)
        if self.choice is not None:
            _check_choices(self.choice)
        try:
            size = self.num_bytes
        except UnicodeEncodeError:
            raise ConstraintError(self.kind, "not valid Unicode (a lone surrogate)") from None
        if size > MAX_CONSTRAINT_BYTES:
            raise ConstraintError(self.kind, f"{size} bytes, at most {MAX_CONSTRAINT_BYTES}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        if self.json_object:
            return "json_object"
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def num_bytes(self) -> int:
        """The constraint's text in UTF-8 bytes (the choices together)."""
        if self.choice is not None:
            return sum(len(c.encode("utf-8")) for c in self.choice)
        text = self.json or self.regex or self.grammar or ""
        return len(text.encode("utf-8"))


def _check_schema_text(text: str) -> None:
    """The schema text parses to a JSON object; ConstraintError (kind ``json``) otherwise, also
    for text nested past the parser's recursion (a client's, so a 400, not a server error)."""
    try:
        schema = _json.loads(text)
    except ValueError as e:
        raise ConstraintError("json", f"not valid JSON ({e})") from None
    except RecursionError:
        raise ConstraintError("json", "not valid JSON here (nested too deeply)") from None
    if not isinstance(schema, dict):
        raise ConstraintError("json", f"a JSON schema must be an object, got {type(schema).__name__}")


def _check_choices(choices: Any) -> None:
    if not isinstance(choices, tuple) or not choices:
        raise ConstraintError("choice", f"must be a non-empty list of strings, got {_short(choices)}")
    if len(choices) > MAX_CHOICES:
        raise ConstraintError("choice", f"{len(choices)} choices, at most {MAX_CHOICES}")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise ConstraintError("choice", f"[{i}] must be a non-empty string, got {_short(c)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
