"""The engine under each float32 projection choice (``cpu_fp32_gemm``, ``engine/model/gemm_paths.py``):
``kernel`` (the panel kernel at every row count), ``auto`` (the faster of it and torch's product per
weight shape and row count, timed at load) and ``torch`` (torch's products only).

One engine per mode, all loaded first. Each round, every mode in turn prefills ``--prompts`` new
prompts of ``--prompt-tokens`` random tokens (fresh each round: no prefix-cache hits; one output
token), then decodes ``--decode-seqs`` short prompts for ``--decode-tokens`` greedy tokens. Medians
over ``--rounds``, and each mode's time against ``kernel``'s. The greedy tokens of every mode are
compared with ``kernel``'s (the paths differ in float32 summation order only; informational).
``auto``'s choice, as its engine logged it, is printed too.

Run: ``python -m pdserve.benchmarks.fp32_paths [--model DIR|FILE.gguf] [--rounds 4] [--json]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from pdserve.benchmarks.common import emit
from pdserve.engine.config import CPU_FP32_GEMM_CHOICES

MODES = ("kernel", "auto", "torch")


def _choice(llm: Any) -> str:
    """What the engine's layers run at each row count (the first layer's and the LM head's choice)."""
    from pdserve.engine.model.linear import Linear

    model = llm.engine.model
    layer = next((m for m in model.modules() if isinstance(m, Linear) and m.paths is not None), None)
    head = getattr(model, "_head_paths", None)
    if layer is None or head is None:
        return "not timed"
    return f"layers: {layer.paths.describe()}; LM head: {head.describe()}"


def run(model: str, modes: list[str], rounds: int, prompts: int, prompt_tokens: int, decode_seqs: int,
        decode_tokens: int, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    from pdserve import LLM, SamplingParams
    from pdserve.engine.model import ModelConfig

    vocab = ModelConfig.from_path(model).vocab_size
    blocks = (prompts * prompt_tokens + decode_seqs * (decode_tokens + 16)) // 16 + 64
    llms = {m: LLM(model, dtype="float32", cpu_fp32_gemm=m, num_blocks=blocks) for m in modes}
    rng = random.Random(seed)
    prefill: dict[str, list[float]] = {m: [] for m in modes}
    decode: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for r in range(rounds):
            new = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(prompts)]
            short = [[rng.randrange(vocab) for _ in range(8)] for _ in range(decode_seqs)]
            for m, llm in llms.items():
                t0 = time.perf_counter()
                llm.generate(new, SamplingParams(max_tokens=1))
                prefill[m].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = llm.generate(short, SamplingParams(max_tokens=decode_tokens, ignore_eos=True))
                decode[m].append(time.perf_counter() - t0)
                if r == 0:
                    tokens[m] = [o.token_ids for o in out]
        choice = _choice(llms["auto"]) if "auto" in llms else None
    finally:
        for llm in llms.values():
            llm.close()
    base = modes[0]
    result: dict[str, Any] = {"model": model, "rounds": rounds, "baseline": base, "modes": {}, "auto_choice": choice}
    for m in modes:
        p, d = statistics.median(prefill[m]), statistics.median(decode[m])
        same = sum(a == b for a, b in zip(tokens[m], tokens[base]))
        result["modes"][m] = {"prefill_s": p, "decode_s": d, "prefill_speedup": statistics.median(prefill[base]) / p,
                              "decode_speedup": statistics.median(decode[base]) / d,
                              "same_tokens_as_" + base: f"{same}/{len(tokens[base])}"}  # fmt: skip
    return result


def report_rows(result: dict[str, Any], args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = [("model", str(result["model"])),
            ("workload", f"prefill {args.prompts} x {args.prompt_tokens} new tokens; decode {args.decode_seqs} "
                         f"sequences x {args.decode_tokens} tokens; medians of {result['rounds']} rounds")]  # fmt: skip
    for m, v in result["modes"].items():
        same = next(val for key, val in v.items() if key.startswith("same_tokens"))
        rows.append((m, f"prefill {v['prefill_s']:.3f} s ({v['prefill_speedup']:.2f}x), decode {v['decode_s']:.3f} s "
                        f"({v['decode_speedup']:.2f}x); greedy tokens as the first mode's: {same}"))  # fmt: skip
    if result["auto_choice"]:
        rows.append(("auto chose", result["auto_choice"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    from pdserve.benchmarks.steps import smollm2

    ap = argparse.ArgumentParser(prog="pdserve bench fp32-paths", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, the first is the baseline")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-seqs", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in CPU_FP32_GEMM_CHOICES]
    if not modes or bad or len(set(modes)) != len(modes):
        ap.error(f"--modes: distinct names among {', '.join(CPU_FP32_GEMM_CHOICES)}, got {args.modes!r}")
    for name in ("rounds", "prompts", "prompt_tokens", "decode_seqs", "decode_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    result = run(args.model or smollm2(), modes, args.rounds, args.prompts, args.prompt_tokens, args.decode_seqs,
                 args.decode_tokens)  # fmt: skip
    emit(result, args.json, report_rows(result, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
