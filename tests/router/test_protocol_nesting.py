"""gRPC's ``SamplingOptions.structured_outputs`` nested past the JSON parser's recursion, as the
object's text or as the schema inside it: ``INVALID_ARGUMENT`` naming the field (the HTTP edge's
400 for the same is in test_http_compat.py), not a server error."""

from __future__ import annotations

import pytest

from pdserve.engine.limits import RequestLimits
from pdserve.engine.model import load_tokenizer
from pdserve.router.servicer import InvalidRequest, to_spec
from pdserve.v1 import router_pb2 as pb

pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (xgrammar)")

DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(("text", "field"), [
    (DEEP, "sampling.structured_outputs"),
    ('{"json": "' + DEEP + '"}', "sampling.structured_outputs.json"),
], ids=["the-object", "the-schema"])  # fmt: skip
def test_a_grpc_constraint_nested_too_deeply_is_invalid_argument(tiny_model: str, text: str, field: str) -> None:
    limits = RequestLimits(vocab_size=258, max_model_len=1024, block_size=16)
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(max_tokens=2, structured_outputs=text))
    with pytest.raises(InvalidRequest, match=f"^{field}: .*nested too deeply"):
        to_spec(request, load_tokenizer(tiny_model), limits)
