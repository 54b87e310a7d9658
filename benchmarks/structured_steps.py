"""What structured outputs cost a decode step: the same batch free, half constrained and all
constrained, side by side in one run.

A batch of ``--batch`` chat requests on SmolLM2-135M-Instruct (float32 on the CPU by default),
greedy, ``--tokens`` new tokens each. Constrained requests follow the regex ``[a-z ]{400}``: it
cannot end before ``--tokens`` tokens, so every variant runs the same number of steps over the
same batch size, and the only difference is the constraint's work (a matcher step per token and
one bitmask filled and applied per step). Rounds alternate the variants (``--rounds``); reported
per variant is the median over rounds of the median decode step (prefill steps excluded) and its
ratio to the free batch's in the same round.

Run: ``pdserve bench structured [--batch 8] [--tokens 48] [--rounds 3] [--json]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pdserve.benchmarks.common import emit
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import StructuredOutputsParams

REGEX = "[a-z ]{400}"
QUESTIONS = ["Describe the sea.", "Describe a forest.", "Describe a city at night.", "Describe the desert.",
             "Describe a mountain.", "Describe the rain.", "Describe a garden.", "Describe the snow."]  # fmt: skip


def decode_step_ms(llm: Any, prompts: list[list[int]], constrained: list[bool], tokens: int) -> float:
    """The median wall time of the engine's decode steps for this batch (ms)."""
    engine = llm.engine
    so = StructuredOutputsParams(regex=REGEX)
    for ids, c in zip(prompts, constrained):
        engine.enqueue(engine.make_request(ids, SamplingParams(max_tokens=tokens, ignore_eos=not c,
                                                               structured_outputs=so if c else None)))  # fmt: skip
    steps: list[float] = []
    while engine.has_unfinished():
        prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or bool(
            engine.scheduler.waiting)
        t0 = time.perf_counter()
        engine.step()
        if not prefilling:
            steps.append(time.perf_counter() - t0)
    return statistics.median(steps) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench structured", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint directory or GGUF file (default: the demo's SmolLM2)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from pdserve import LLM
    from pdserve.cli.demo import demo_model

    llm = LLM(args.model or demo_model(), dtype=args.dtype, max_model_len=1024)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
               for i in range(args.batch)]  # fmt: skip
    variants = {"free": [False] * args.batch, "half": [i % 2 == 1 for i in range(args.batch)],
                "all": [True] * args.batch}  # fmt: skip
    decode_step_ms(llm, prompts, variants["all"], 4)  # compiles the grammar, warms everything up
    per: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        times = {v: decode_step_ms(llm, prompts, c, args.tokens) for v, c in variants.items()}
        for v, t in times.items():
            per[v].append(t)
            ratios[v].append(t / times["free"])
    result = {v: {"step_ms": round(statistics.median(per[v]), 2), "over_free": round(statistics.median(ratios[v]), 3)}
              for v in variants}  # fmt: skip
    result["config"] = {"batch": args.batch, "tokens": args.tokens, "rounds": args.rounds, "dtype": args.dtype,
                        "regex": REGEX}  # fmt: skip
    rows = [(f"{v} ({sum(variants[v])}/{args.batch} constrained)",
             f"decode step {result[v]['step_ms']} ms, x{result[v]['over_free']} the free batch") for v in variants]
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
