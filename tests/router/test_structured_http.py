"""Structured outputs at the HTTP edge: every request field that sets a constraint (OpenAI's
``response_format``, vLLM's ``structured_outputs`` and ``guided_*``) becomes the constraint the
workers get, on both endpoints; two at once, a bad schema, regex or grammar, an unsupported kind,
or a server without the grammar library is a 400 naming the field, answered by a real router's
HTTP server in this process before any worker is involved (it has none: an accepted request gets
as far as the 503 for want of a worker)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from pdserve.engine.structured import StructuredOutputsParams
from pdserve.router.config import RouterConfig
from pdserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.requests import InvalidRequest
from tests.router.test_http_edge import run_router

pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (xgrammar)")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["city", "n"]}  # fmt: skip
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA,
                                                                     "strict": True}}},
         StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
        ({"structured_outputs": {"regex": "[a-z]+", "disable_fallback": True}},
         StructuredOutputsParams(regex="[a-z]+")),
        ({"structured_outputs": {"choice": ["a", "b"], "json_object": False}},
         StructuredOutputsParams(choice=("a", "b"))),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, StructuredOutputsParams(grammar='root ::= "x"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_regex": r"\d+"}, StructuredOutputsParams(regex=r"\d+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'root ::= "x" | "y"'}, StructuredOutputsParams(grammar='root ::= "x" | "y"')),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ],
)
def test_every_field_becomes_the_constraint_the_workers_get(fields: dict, expected: StructuredOutputsParams | None
                                                           ) -> None:  # fmt: skip
    for req in (CompletionRequest(model="m", prompt="p", **fields),
                ChatCompletionRequest(model="m", messages=MESSAGES, **fields)):  # fmt: skip
        params = [req.params(16, None, i) for i in range(2)]
        assert all(p.structured_outputs == expected for p in params)


BAD = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one structured-output"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "one structured-output"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema", 'Unsupported type "objectx"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "required"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
    ({"guided_regex": "[a-"}, "guided_regex", "Unclosed '['"),
    ({"guided_grammar": 'root ::= "a'}, "guided_grammar", "string literal"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1]"}, "guided_json", "must be an object"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "give one of"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "true or false"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
]  # fmt: skip


def test_bad_constraints_are_400s_naming_the_field_and_good_ones_pass(tiny_model: str) -> None:
    name = Path(tiny_model).name

    async def test(_router: object, address: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for path, body in (("/v1/chat/completions", {"model": name, "messages": MESSAGES}),
                               ("/v1/completions", {"model": name, "prompt": "hi"})):  # fmt: skip
                for extra, param, needle in BAD:
                    r = await client.post(f"http://{address}{path}", json={**body, **extra})
                    assert r.status_code == 400, (path, extra, r.text)
                    err = r.json()["error"]
                    assert err["param"] == param and needle in err["message"], (path, extra, r.text)
                good = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                        "n": 2}  # fmt: skip
                r = await client.post(f"http://{address}{path}", json={**body, **good})
                assert r.status_code == 503, r.text  # past every check: no worker to serve it here

    run_router(tiny_model, RouterConfig(), test)


def test_without_the_grammar_library_a_constraint_is_a_400_naming_the_extra(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed: importing it fails
    name = Path(tiny_model).name
    req = CompletionRequest(model=name, prompt="p", guided_regex="[0-9]{4}-only-here")
    with pytest.raises(InvalidRequest, match=r"guided_regex: .*xgrammar.*pip install 'pdserve\[structured\]'"):
        req.params(16, None, 0)

    async def test(_router: object, address: str) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            # A schema no other test checks: an accepted constraint is remembered (``check``).
            unique = {"type": "object", "properties": {"only_here": {"type": "boolean"}}}
            body = {"model": name, "messages": MESSAGES,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": unique}}}
            r = await client.post(f"http://{address}/v1/chat/completions", json=body)
            assert r.status_code == 400 and "pdserve[structured]" in r.json()["error"]["message"], r.text
            r = await client.post(f"http://{address}/v1/chat/completions", json={**body, "response_format": None})
            assert r.status_code == 503, r.text  # unconstrained requests are not affected

    run_router(tiny_model, RouterConfig(), test)
