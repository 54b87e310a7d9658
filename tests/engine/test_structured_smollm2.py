"""Structured outputs on the shipped SmolLM2-135M-Instruct: one batch mixes constrained and free
requests; every constrained answer parses and validates against its own schema (``jsonschema``) or
fullmatches its regex (``re``), and the free ones are the model's own unconstrained answers."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.structured import StructuredOutputsParams
from tests.support.gguf_files import smollm2_path

pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (xgrammar)")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "population_millions": {"type": "number"}},
        "required": ["city", "population_millions"], "additionalProperties": False}  # fmt: skip
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


def test_a_batch_mixing_constrained_and_free_requests() -> None:
    llm = LLM(str(smollm2_path()), dtype="float32", max_model_len=2048)
    ask = [
        ("Give a made-up person as JSON with a name and an age.", StructuredOutputsParams(json=PERSON)),
        ("Name a European capital and its population as JSON.", StructuredOutputsParams(json=CITY)),
        ("What is today's date?", StructuredOutputsParams(regex=DATE)),
        ("Say hello in one short sentence.", None),
        ("Answer with a JSON object describing a cat.", StructuredOutputsParams(json_object=True)),
        ("Count from one to five.", None),
    ]
    params = [SamplingParams(max_tokens=96, structured_outputs=so, temperature=0.0) for _, so in ask]
    conversations = [[{"role": "user", "content": q}] for q, _ in ask]
    batch = llm.chat(conversations, params)
    for (q, so), out in zip(ask, batch):
        if so is None:
            continue
        assert out.finish_reason == "stop", (q, out.text)
        if so.regex is not None:
            assert re.fullmatch(DATE, out.text), out.text
        elif so.json_object:
            assert isinstance(json.loads(out.text), dict), out.text
        else:
            jsonschema.validate(json.loads(out.text), json.loads(so.json))
    # The free requests of the batch are what the model says without any constraint in the batch.
    free = [i for i, (_, so) in enumerate(ask) if so is None]
    alone = llm.chat([conversations[i] for i in free], [SamplingParams(max_tokens=96) for _ in free])
    assert [batch[i].token_ids for i in free] == [o.token_ids for o in alone]
