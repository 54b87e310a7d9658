"""Structured outputs in the engine, on the tiny model (random weights, so nothing but the grammar
keeps its output in shape): JSON that parses and validates against its schema (``jsonschema``),
regexes that Python's ``re`` fullmatches, choices, grammars; greedy output that is, at every step,
the argmax of transformers' logits among the tokens an independently built matcher allows; the
matcher following a request through a prefill/decode handover and preemption; log-probabilities
that stay the model's; one compile per distinct constraint; bad constraints refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.structured import (
    ConstraintError,
    StructuredOutputs,
    StructuredOutputsParams,
    check,
    check_tokenizer,
)
from pdserve.engine.structured.bitmask import apply_bitmask, new_bitmask
from pdserve.engine.structured.params import MAX_CONSTRAINT_BYTES, MAX_JSON_WHITESPACE
from pdserve.engine.tokenizer import ModelTokenizer, TokenizerInfo
from tests.engine.test_kv_handover import hand_over
from tests.support.models import hf_logits, load_hf_reference, make_hf_checkpoint

xgr = pytest.importorskip("xgrammar", reason="structured outputs need the structured extra (xgrammar)")

# Bounded by construction (enums, booleans, bounded integers, patterned strings, at most 3 items),
# so a random model's output ends within max_tokens; strings have a pattern rather than a
# maxLength, since the library's maxLength strings admit raw control characters.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
        "code": {"type": "string", "pattern": "^[a-z]{2,4}$"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["ok", "n", "color", "code", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}(\.[A-Z])?"
PROMPTS = ["Hello", "The cat sat", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
EOS = 257  # the tiny model's </s>


@pytest.fixture(scope="module")
def llm(tiny_model: str) -> LLM:
    return LLM(tiny_model, num_blocks=128, block_size=8)


def constrained(so: StructuredOutputsParams, **kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, **kw}, structured_outputs=so)  # type: ignore[arg-type]


@pytest.mark.parametrize("whitespace", ["compact", "free"])
def test_json_schema_output_parses_and_validates(llm: LLM, whitespace: str) -> None:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=whitespace == "compact")
    if whitespace == "compact":
        params = [constrained(so), constrained(so, temperature=1.0, seed=3),
                  constrained(so, temperature=0.7, top_p=0.9, top_k=20, seed=4)]  # fmt: skip
    else:  # this random model favours whitespace: up to the bound in each of ~25 gaps
        params = [constrained(so, max_tokens=700, temperature=1.0, seed=3)]
    for p in params:
        for out in llm.generate(PROMPTS, p):
            assert out.finish_reason == "stop" and out.token_ids[-1] == EOS, out.text
            jsonschema.validate(json.loads(out.text), SCHEMA)
            runs = re.findall(r"[ \t\n\r]+", re.sub(r'"[^"]*"', '""', out.text))  # whitespace outside strings
            if whitespace == "compact":
                assert all(r == " " for r in runs), out.text  # only the ", " and ": " separators
            assert all(len(r) <= MAX_JSON_WHITESPACE for r in runs), out.text


def test_json_object_regex_choice_and_grammars(llm: LLM) -> None:
    cases = {
        "json_object": (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
                        lambda t: isinstance(json.loads(t), dict)),
        "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
        "choice": (StructuredOutputsParams(choice=["yes", "no", "it's \"maybe\"\n"]),
                   lambda t: t in ("yes", "no", "it's \"maybe\"\n")),
        "ebnf": (StructuredOutputsParams(grammar='root ::= "sum(" num ("," num)? ")"\nnum ::= [1-9] [0-9]?'),
                 lambda t: re.fullmatch(r"sum\([1-9][0-9]?(,[1-9][0-9]?)?\)", t) is not None),
        "lark": (StructuredOutputsParams(grammar='start: "go " DIR\nDIR: "north" | "south"'),
                 lambda t: t in ("go north", "go south")),
    }  # fmt: skip
    for name, (so, valid) in cases.items():
        for p in (constrained(so), constrained(so, temperature=1.0, seed=7)):
            outs = llm.generate(PROMPTS, p)
            for out in outs:
                # A JSON object's keys and strings are free: this random model's need not end in time.
                if name != "json_object" or out.finish_reason == "stop":
                    assert out.finish_reason == "stop" and valid(out.text), (name, out.text)
            assert any(o.finish_reason == "stop" for o in outs)


def test_stop_strings_and_max_tokens_cut_a_constrained_request(llm: LLM) -> None:
    so = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{4}")
    out = llm.generate(["Hello"], constrained(so, stop=["-"]))[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}", out.text)
    out = llm.generate(["Hello"], constrained(so, max_tokens=5))[0]
    assert out.finish_reason == "length" and re.fullmatch(r"[0-9]{3}-[a-z]", out.text)


def reference_tokenizer_info(model_dir: str, vocab_size: int) -> object:
    """The library's own view of the tokenizer, built by its public Hugging Face path (not ours)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[EOS])


@pytest.fixture(scope="module")
def ref(tiny_model: str) -> torch.nn.Module:
    return load_hf_reference(tiny_model)


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_constrained_greedy_is_the_argmax_of_transformers_logits_among_allowed_tokens(
    llm: LLM, ref: torch.nn.Module, tiny_model: str, kind: str
) -> None:
    vocab = ref.config.vocab_size
    compiler = xgr.GrammarCompiler(reference_tokenizer_info(tiny_model, vocab))
    compiled = (compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False) if kind == "json"
                else compiler.compile_regex(REGEX))  # fmt: skip
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if kind == "json" else (
        StructuredOutputsParams(regex=REGEX))  # fmt: skip
    # Special tokens other than EOS are never part of constrained text (the detokenizer drops them).
    special = torch.zeros(vocab, dtype=torch.bool)
    special[256] = True
    for prompt in PROMPTS:
        ids = llm.encode(prompt) if isinstance(prompt, str) else list(prompt)
        out = llm.generate([ids], constrained(so, logprobs=1))[0]
        logits = hf_logits(ref, ids + out.token_ids)[len(ids) - 1 :]
        matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            matcher.fill_next_token_bitmask(bitmask)
            allowed = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].bool()
            allowed &= ~special
            best = logits[step].masked_fill(~allowed, float("-inf")).max()
            assert allowed[token] and logits[step, token] >= best - 1e-4, (prompt, step, token)
            # The reported log-probability is the model's, unmasked.
            assert lp.logprob == pytest.approx(torch.log_softmax(logits[step], -1)[token].item(), abs=1e-4)
            assert matcher.accept_token(token)
        assert matcher.is_terminated() and out.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_decode_engine_continues_the_grammar_after_the_prefill_engines_token(
    tiny_model: str, temperature: float
) -> None:
    """The consumer advances its own matcher over the token the producer sampled: the stream
    equals one engine's, greedy or seeded (were the matcher at the start, '{' would come again)."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = constrained(so, temperature=temperature, seed=5)
    prompts = [[7, 8, 9, 10, 11] * 3, [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    expected = [o.token_ids for o in LLM(tiny_model, num_blocks=64, block_size=8).generate(prompts, params)]
    src, dst = LLM(tiny_model, num_blocks=64, block_size=8).engine, LLM(tiny_model, num_blocks=64, block_size=8).engine
    handed = [hand_over(src, dst, p, params) for p in prompts]
    assert all(r.grammar is not None and r.grammar.num_tokens == 1 for r in handed)  # the first token, before any step
    while dst.has_unfinished():
        dst.step()
    assert [r.output_token_ids for r in handed] == expected
    for r in handed:
        jsonschema.validate(json.loads(bytes(r.output_token_ids[:-1]).decode()), SCHEMA)


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return reqs


def test_a_preempted_request_does_not_advance_its_grammar_twice(tiny_model: str) -> None:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = constrained(so, temperature=1.0, seed=9)
    prompts = [[30 + i, 40 + i, 50 + i] * 5 for i in range(5)]
    roomy = LLM(tiny_model, num_blocks=64, block_size=4).engine
    alone = [run_all(roomy, [p], params)[0] for p in prompts]  # one at a time: never preempted
    assert roomy.stats().num_preemptions == 0
    tight = LLM(tiny_model, num_blocks=40, block_size=4).engine  # too few blocks for all five at once
    together = run_all(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    assert [r.output_token_ids for r in together] == [r.output_token_ids for r in alone]
    assert all(r.grammar.num_tokens == len(r.output_token_ids) for r in together)


def test_each_distinct_constraint_is_compiled_once_and_the_cache_is_bounded(tiny_model: str) -> None:
    tok = ModelTokenizer.from_path(tiny_model)
    structured = StructuredOutputs(tok, 258, (EOS,), max_compiled=2)
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    first, second = structured.state(a), structured.state(StructuredOutputsParams(regex="a+"))
    assert structured.num_compiles == 1 and first is not second  # one grammar, a matcher per request
    assert first.accept(ord("a")) and second.num_tokens == 0  # states are the requests' own
    structured.state(b)
    structured.state(c)  # drops a, the least recently used
    assert structured.num_cached == 2 and structured.num_compiles == 3
    structured.state(c)
    structured.state(a)
    assert structured.num_compiles == 4
    small = StructuredOutputs(tok, 258, (EOS,), max_bytes=1)  # every grammar is over it: only the newest stays
    small.state(a)
    small.state(b)
    assert small.num_cached == 1 and 0 < small.num_bytes
    small.state(b)
    assert small.num_compiles == 2
    # n requests of one constraint through the engine: one compile.
    llm = LLM(tiny_model, num_blocks=64, block_size=8)
    llm.generate(PROMPTS * 2, constrained(StructuredOutputsParams(choice=["x", "y"]), temperature=1.0))
    assert llm.engine.structured.num_compiles == 1


@pytest.mark.parametrize(
    ("kwargs", "kind", "reason"),
    [
        ({}, "structured_outputs", "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs", "regex and choice"),
        ({"json": [1, 2]}, "json", "must be an object"),
        ({"json": "{not json"}, "json", "not valid JSON"),
        ({"json": "[]"}, "json", "must be an object"),
        ({"choice": []}, "choice", "non-empty list"),
        ({"choice": ["a", ""]}, "choice", "[1]"),
        ({"choice": "ab"}, "choice", "non-empty list"),
        ({"regex": ""}, "regex", "non-empty"),
        ({"json_object": "yes"}, "json_object", "true or false"),
        ({"regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}, "regex", "bytes, at most"),
    ],
)
def test_malformed_constraints_are_refused_by_name(kwargs: dict, kind: str, reason: str) -> None:
    with pytest.raises(ConstraintError, match=re.escape(reason)) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.kind == kind


@pytest.mark.parametrize(
    ("so", "reason"),
    [
        (StructuredOutputsParams(regex="[a-"), "Unclosed '['"),
        (StructuredOutputsParams(regex="(?=a)b"), "Lookahead is not supported"),
        (StructuredOutputsParams(json={"type": "objectx"}), 'Unsupported type "objectx"'),
        (StructuredOutputsParams(json={"type": "object", "properties": 5}), "properties must be an object"),
        (StructuredOutputsParams(grammar='root ::= "a'), "string literal"),
        (StructuredOutputsParams(grammar="nothing ::= [a-z]"), 'root rule with name "root" is not found'),
    ],
)
def test_constraints_the_library_cannot_build_are_refused_with_its_reason(so: StructuredOutputsParams, reason: str,
                                                                          llm: LLM) -> None:  # fmt: skip
    with pytest.raises(ConstraintError, match=re.escape(reason)) as e:
        check(so)
    assert e.value.kind == so.kind and "/project/" not in str(e.value)  # no source location
    with pytest.raises(ValueError, match=re.escape(reason)):
        llm.engine.make_request([1, 2, 3], constrained(so))


def test_tokenizers_the_library_reads_and_one_it_cannot(tmp_path: Path) -> None:
    """SmolLM2's GGUF vocabulary (byte-level BPE, 49152 tokens): a JSON instance tokenized by it
    walks the grammar to the end, and its special tokens (ids 0..16) are never allowed inside a
    string, where nearly everything else is. A WordPiece tokenizer is refused by name."""
    from tests.support.gguf_files import smollm2_path

    tok = ModelTokenizer.from_path(smollm2_path())
    structured = StructuredOutputs(tok, 49152, (2,))
    state = structured.state(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    text = '{"ok": true, "n": 42, "color": "blue", "code": "abc", "tags": ["x", "y"]}'
    for t in tok.encode(text, add_special_tokens=False):
        assert state.accept(t), t
    assert state.accept(2) and state.terminated  # <|im_end|> ends a complete match
    inside = structured.state(StructuredOutputsParams(json_object=True))
    for t in tok.encode('{"a": "', add_special_tokens=False):
        assert inside.accept(t)
    bitmask = new_bitmask(1, 49152, torch.device("cpu"))
    inside.fill(bitmask, 0)
    logits = torch.zeros(1, 49152)
    apply_bitmask(logits, bitmask, [0])
    allowed = logits[0] == 0
    assert allowed.sum() > 40_000 and not allowed[:17].any()
    from tokenizers import Tokenizer, models

    wordpiece = ModelTokenizer(Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")), TokenizerInfo())
    with pytest.raises(ConstraintError, match="WordPiece") as e:
        StructuredOutputs(wordpiece, 2, (0,)).state(StructuredOutputsParams(regex="a"))
    assert e.value.kind == "tokenizer"
    assert "WordPiece" in (check_tokenizer(wordpiece) or "") and check_tokenizer(tok) is None  # the router's check


def test_a_sentencepiece_gguf_model_is_constrained(tmp_path: Path) -> None:
    from tests.support.gguf_files import write_gguf

    gguf = write_gguf(make_hf_checkpoint(tmp_path / "hf", "llama_gqa"), tmp_path / "spm.gguf", tokenizer="llama")
    llm = LLM(str(gguf), num_blocks=64, block_size=8)
    for so, valid in ((StructuredOutputsParams(regex=r"the [a-z]{2,4}"), lambda t: re.fullmatch(r"the [a-z]{2,4}", t)),
                      (StructuredOutputsParams(choice=["hello world", "in"]), lambda t: t in ("hello world", "in"))):
        for out in llm.generate(["hello", "the world"], constrained(so, temperature=1.0, seed=1)):
            assert out.finish_reason == "stop" and valid(out.text), out.text


def test_the_bitmask_is_applied_as_the_librarys_kernel_applies_it() -> None:
    """Ours (unpacked in torch, only the constrained rows) against xgrammar's own kernel."""
    g = torch.Generator().manual_seed(0)
    for vocab in (258, 49152, 100):
        bitmask = new_bitmask(4, vocab, torch.device("cpu"))
        bitmask[:] = torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=g, dtype=torch.int32)
        logits = torch.randn(4, vocab, generator=g)
        ours, theirs = logits.clone(), logits.clone()
        apply_bitmask(ours, bitmask, [0, 2])
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=[0, 2], backend="cpu")
        assert torch.equal(ours, theirs) and torch.equal(ours[[1, 3]], logits[[1, 3]])
        apply_bitmask(ours, bitmask, [0, 1, 2, 3])
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, backend="cpu")
        assert torch.equal(ours, theirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_bitmask_on_cuda_masks_as_on_the_cpu() -> None:
    g = torch.Generator().manual_seed(1)
    bitmask = new_bitmask(3, 49152, torch.device("cuda"))
    bitmask[:] = torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=g, dtype=torch.int32)
    logits = torch.randn(3, 49152, generator=g)
    on_gpu = logits.cuda()
    apply_bitmask(on_gpu, bitmask, [0, 2])
    apply_bitmask(logits, bitmask, [0, 2])
    assert torch.equal(on_gpu.cpu(), logits)


def test_logits_past_the_tokenizers_vocabulary_are_never_allowed(tmp_path: Path) -> None:
    """A checkpoint with more logits (300) than its tokenizer has entries (258): the ids without
    an entry decode to nothing, so the grammar never allows them."""
    llm = LLM(str(make_hf_checkpoint(tmp_path, "llama_gqa")), num_blocks=64, block_size=8)
    so = StructuredOutputsParams(regex=r"[a-z ]{1,30}\.")
    for out in llm.generate(PROMPTS, constrained(so, temperature=1.5, seed=2)):
        assert out.finish_reason == "stop" and re.fullmatch(r"[a-z ]{1,30}\.", out.text)
        assert max(out.token_ids) == EOS
