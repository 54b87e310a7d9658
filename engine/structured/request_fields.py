"""A request body's structured-output fields (OpenAI's and vLLM's) to one checked constraint.

The fields, as the OpenAI-compatible edge takes them (docs/http.md, "Structured outputs"):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``
  with the flags ``disable_any_whitespace`` (honoured), ``disable_fallback`` and
  ``disable_additional_properties`` (accepted: there is one backend, and an object gets the
  properties its schema allows, whatever they say); ``structural_tag`` and ``whitespace_pattern``
  are refused;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

At most one constraint per request. Errors are ``ConstraintError`` whose ``kind`` is the field's
path in the body (``response_format.json_schema.schema``, ``structured_outputs.regex``...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.structured.backend import StructuredOutputsUnavailable, check
from pdserve.engine.structured.params import KINDS, ConstraintError, StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # fmt: skip
FLAGS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
REFUSED = ("structural_tag", "whitespace_pattern")


def _response_format(rf: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    kind = rf.get("type")
    if kind == "json_object":
        return "response_format", {"json_object": True}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ConstraintError("response_format.json_schema.schema", "required: a JSON schema (an object)")
        return "response_format.json_schema.schema", {"json": spec["schema"]}
    if kind != "text":
        raise ConstraintError("response_format", f"type {kind!r} is not supported (text, json_object or json_schema)")
    return None


def _structured_outputs(so: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    for key, value in so.items():
        if key in REFUSED and value is not None:
            raise ConstraintError(f"structured_outputs.{key}", "not supported by this server")
        if key not in (*KINDS, *FLAGS, *REFUSED):
            raise ConstraintError(f"structured_outputs.{key}", f"unknown (known: {', '.join(KINDS + FLAGS)})")
        if key in FLAGS and value is not None and not isinstance(value, bool):
            raise ConstraintError(f"structured_outputs.{key}", "must be true or false")
    kinds = [k for k in KINDS if so.get(k) is not None and so.get(k) is not False]
    if not kinds:
        raise ConstraintError("structured_outputs", f"give one of {', '.join(KINDS)}")
    flags = {"disable_any_whitespace": so.get("disable_any_whitespace") is True}
    return [(f"structured_outputs.{k}", {k: so[k], **flags}) for k in kinds]


def from_request(response_format: Mapping[str, Any] | None, structured_outputs: Mapping[str, Any] | None,
                 guided: Mapping[str, Any]) -> tuple[str, StructuredOutputsParams] | None:  # fmt: skip
    """The body's constraint, or None: (the field that sets it, the constraint), checked with
    the grammar library (``check``). ``guided``: the ``guided_*`` fields by name (unset: None).
    ``ConstraintError`` (``kind`` = the field) for two constraints, a bad or unsupported one, or
    one this server cannot build because the library is missing (the message names the extra)."""
    found: list[tuple[str, dict[str, Any]]] = []
    if response_format is not None and (rf := _response_format(response_format)) is not None:
        found.append(rf)
    if structured_outputs is not None:
        found += _structured_outputs(structured_outputs)
    found += [(name, {key: guided[name]}) for name, key in GUIDED_FIELDS.items() if guided.get(name) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise ConstraintError(found[1][0], f"one structured-output constraint per request, and {found[0][0]} sets "
                                           "one already")  # fmt: skip
    field, kwargs = found[0]
    try:
        params = StructuredOutputsParams(**kwargs)
        check(params)
    except StructuredOutputsUnavailable as e:
        raise ConstraintError(field, str(e)) from None
    except ConstraintError as e:
        raise ConstraintError(field, e.reason) from None
    return field, params
