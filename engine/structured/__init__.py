"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regex, a
list of choices or a grammar (docs/http.md, "Structured outputs").

- ``params.py``: ``StructuredOutputsParams``, the constraint as ``SamplingParams`` carries it (pure
  Python: checked for shape without the grammar library).
- ``backend.py``: the grammar library (xgrammar, the ``structured`` extra): the router's
  ``check``, the engine's compile cache ``StructuredOutputs`` and each request's ``GrammarState``.
- ``bitmask.py``: the per-step bitmask of allowed tokens and its application to the logits.

How a constraint follows a request: the engine gives the request a ``GrammarState`` when it is
made; every output token the request gets, sampled here or by another engine (the prefill
worker's first token, given to ``add_remote``), advances it once, and a recomputed
(preempted) request gets no new tokens for its old ones, so none is counted twice. The sampler
masks the request's row with the state's allowed tokens before it samples. A request whose
grammar is complete may only end (EOS): it finishes with reason ``"stop"``.
"""

from __future__ import annotations

from pdserve.engine.structured.backend import (
    INSTALL_HINT,
    GrammarState,
    StructuredOutputs,
    StructuredOutputsUnavailable,
    check,
    check_tokenizer,
)
from pdserve.engine.structured.params import ConstraintError, StructuredOutputsParams

__all__ = [
    "INSTALL_HINT",
    "ConstraintError",
    "GrammarState",
    "StructuredOutputs",
    "StructuredOutputsParams",
    "StructuredOutputsUnavailable",
    "check",
    "check_tokenizer",
]
