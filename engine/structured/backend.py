"""The grammar library behind structured outputs: xgrammar (the ``structured`` extra).

Chosen over llguidance on the measurements of ``benchmarks/grammar.py`` (docs/http.md, "Structured
outputs", has them): its per-token masks are about ten times faster, which every decode step of a
constrained request pays, while its slower compile is paid once per distinct constraint (cached).

- ``check(params)``: the constraint's grammar, built without a tokenizer: what the router does to
  refuse a bad schema, regex or grammar (``ConstraintError``) before any worker sees it.
- ``check_tokenizer(tokenizer)``: None, or why this tokenizer cannot be constrained.
- ``StructuredOutputs``: one engine's compiler. Each distinct constraint is compiled once (the most
  recently used are kept, within ``MAX_COMPILED`` and ``MAX_COMPILED_BYTES``); each request gets a
  ``GrammarState`` of its own.

Without xgrammar installed every entry point raises ``StructuredOutputsUnavailable`` (a
``ValueError``) naming the extra to install.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from pdserve.engine.structured.params import MAX_JSON_WHITESPACE, ConstraintError, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from pdserve.engine.tokenizer import ModelTokenizer

INSTALL_HINT = "pip install 'pdserve[structured]'"
# Compiled grammars kept per engine, least recently used dropped first: at most this many, and
# at most this many bytes (a JSON schema's is about 3 MB for a 50k vocabulary).
MAX_COMPILED = 64
MAX_COMPILED_BYTES = 128 * 1024**2
# Tokenizer models whose vocabulary entries spell the text they decode to (with GPT-2's byte
# alphabet, or SentencePiece's "▁" and <0xNN> byte pieces): what the library can read.
SUPPORTED_TOKENIZER_MODELS = ("BPE",)
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class StructuredOutputsUnavailable(ValueError):
    """The grammar library is not installed here."""


def library() -> ModuleType:
    """The ``xgrammar`` module, or ``StructuredOutputsUnavailable`` naming the extra."""
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputsUnavailable(
            f"structured outputs need the xgrammar library, which this server does not have ({INSTALL_HINT})"
        ) from None
    return xgrammar


def _reason(error: BaseException) -> str:
    """The library's message without its source location, on one line, bounded."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = _LOCATION.sub("", text)
    return text if len(text) <= 300 else text[:297] + "..."


def grammar(params: StructuredOutputsParams) -> Any:
    """The constraint as the library's ``Grammar`` (no tokenizer needed); ``ConstraintError``
    naming the kind when the library refuses it (invalid schema, regex or grammar)."""
    xgr = library()
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            free = not params.disable_any_whitespace
            return xgr.Grammar.from_json_schema(
                params.json if kind == "json" else '{"type": "object"}', any_whitespace=free,
                max_whitespace_cnt=MAX_JSON_WHITESPACE if free else None, strict_mode=True,
            )  # fmt: skip
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            # JSON string literals are EBNF string literals: quotes, backslashes and control
            # characters come out escaped.
            assert params.choice is not None
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        assert params.grammar is not None
        if "::=" in params.grammar:  # EBNF (llama.cpp's GBNF): rules "name ::= ...", the first "root"
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_lark(params.grammar)  # Lark: rules "name: ...", the first "start"
    except (RuntimeError, ValueError, TypeError) as e:
        if isinstance(e, StructuredOutputsUnavailable):
            raise
        raise ConstraintError(kind, _reason(e)) from None


@functools.lru_cache(maxsize=256)
def check(params: StructuredOutputsParams) -> None:
    """Refuse a constraint the library cannot build (``ConstraintError``), or every constraint
    where the library is missing (``StructuredOutputsUnavailable``). Accepted ones are
    remembered: a request with ``n`` choices, or the same schema again, is checked once."""
    grammar(params)


@functools.lru_cache(maxsize=8)
def check_tokenizer(tokenizer: ModelTokenizer) -> str | None:
    """None when requests on ``tokenizer`` can be constrained, else why not (remembered per
    tokenizer)."""
    try:
        model = (json.loads(tokenizer.raw.to_str()).get("model") or {}).get("type")
    except ValueError:
        model = None
    if model not in SUPPORTED_TOKENIZER_MODELS:
        return (f"structured outputs are not supported for this model's tokenizer ({model or 'unknown'}; "
                f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)})")  # fmt: skip
    return None


def tokenizer_info(tokenizer: ModelTokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """The library's view of ``tokenizer`` for a model of ``vocab_size`` logits. Special tokens
    (``<|im_start|>``, ``</s>``...) are never allowed inside constrained text, though the library
    would read them as their spelling: the detokenizer drops them, so the text would not be what
    the grammar matched. ``stop_token_ids`` (the model's EOS ids) end a complete match."""
    xgr = library()
    if (problem := check_tokenizer(tokenizer)) is not None:
        raise ConstraintError("tokenizer", problem)
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    stops = list(stop_token_ids) or None
    # The library's public detection of the vocabulary's spelling (byte-level, byte fallback...),
    # on a copy: the wrapper may change the padding and truncation settings of what it wraps.
    wrapper = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.raw.to_str()))
    detected = xgr.TokenizerInfo.from_huggingface(wrapper, vocab_size=vocab_size, stop_token_ids=stops or [0])
    special = {i for i, t in tokenizer.raw.get_added_tokens_decoder().items() if t.special}
    encoded = [""] * vocab_size  # the library treats an empty entry as a special token: never allowed
    for text, i in tokenizer.raw.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            encoded[i] = text
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=detected.add_prefix_space)  # fmt: skip


class GrammarState:
    """Where one request's output stands in its grammar. Advanced once per output token
    (``accept``), whoever sampled it; read by the sampler (``fill``)."""

    __slots__ = ("_matcher", "num_tokens")

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.num_tokens = 0  # tokens accepted so far

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (state unchanged) when the grammar does not allow it."""
        if not self._matcher.accept_token(int(token_id)):
            return False
        self.num_tokens += 1
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (CPU int32, one bit a token)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        """The grammar matched in full and a stop token (EOS) ended it: nothing more is allowed."""
        return bool(self._matcher.is_terminated())


class StructuredOutputs:
    """One engine's grammar compiler. Thread-safe: requests are made on several threads.

    ``state(params)`` compiles ``params`` unless a constraint equal to it is still cached, and
    returns a fresh ``GrammarState`` at the grammar's start. The cache keeps the most recently used
    compiled grammars: at most ``max_compiled`` of them and ``max_bytes`` together (the newest is
    kept even when it alone is larger). The library's tokenizer view is built on the first
    constrained request (under a second for a 50k vocabulary), so engines that never see one never
    pay for it.
    """

    def __init__(self, tokenizer: ModelTokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 max_compiled: int = MAX_COMPILED, max_bytes: int = MAX_COMPILED_BYTES) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_compiled = max_compiled
        self.max_bytes = max_bytes
        self.num_bytes = 0  # of the cached compiled grammars
        self.num_compiles = 0  # lifetime count (what the cache saved is visible against requests)
        self._compiled: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()
        self._compiler: Any = None
        self._lock = threading.Lock()

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        xgr = library()
        with self._lock:
            compiled = self._compiled.get(params)
            if compiled is None:
                if self._compiler is None:
                    info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                    self._compiler = xgr.GrammarCompiler(info, max_threads=min(4, os.cpu_count() or 1),
                                                         cache_enabled=False)  # fmt: skip
                try:
                    compiled = self._compiler.compile_grammar(grammar(params))
                except RuntimeError as e:
                    raise ConstraintError(params.kind, _reason(e)) from None
                self.num_compiles += 1
                self._compiled[params] = compiled
                self.num_bytes += compiled.memory_size_bytes
                while len(self._compiled) > 1 and (len(self._compiled) > self.max_compiled
                                                   or self.num_bytes > self.max_bytes):  # fmt: skip
                    self.num_bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes
            else:
                self._compiled.move_to_end(params)
        return GrammarState(xgr.GrammarMatcher(compiled))

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._compiled)
