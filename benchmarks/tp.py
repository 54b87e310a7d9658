"""Tensor parallelism on the CPU: a decode step at TP=N against TP=1, and the share spent in the
ranks' collectives.

For each size (TP=1 first, then each of ``--sizes``) in one sitting, rounds interleaved: the same
prompts are prefilled, then ``--max-tokens`` greedy decode steps are timed. Reported per size: the
median decode step, output tokens per second, the ratio to TP=1, and the share of rank 0's decode
time inside collectives (gloo all-reduces of every attention and MLP output, the all-gather of
the logits; the wait for the slowest rank counts there too). Greedy outputs must be the same at
every size (float32): the run fails otherwise.

KV moved per block: a TP worker keeps one KV cache in shared memory in which each rank reads and
writes its own heads, so a decode worker of any size pulls each block once, the same bytes as at
TP=1; ``kv_bytes_per_block`` and ``kv_bytes_per_rank_slice`` say how much that is and how much of it
each rank's attention reads.

The default model is a synthetic Llama of SmolLM2-135M's widths with 8 heads (SmolLM2's 9 heads
split only 3 ways; ``--model`` takes any checkpoint).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from pdserve.benchmarks.common import emit
from pdserve.engine.sampling_params import SamplingParams


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def synthetic_model(directory: str) -> str:
    from pdserve.engine.model import make_tiny_model

    return str(make_tiny_model(directory, hidden_size=576, num_layers=12, num_heads=8, num_kv_heads=4,
                               intermediate_size=1536, vocab_size=8192, seed=0))  # fmt: skip


def run_once(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], float, list[list[int]]]:
    """Decode step seconds (after every prompt has its first token), rank 0's collective seconds
    over them, and the tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while any(not t for t in tokens.values()):  # prefill
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
    group = engine.ranks.group if engine.ranks is not None else None
    comm0 = group.comm_s if group else 0.0
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t0)
        for o in outs:
            tokens[o.request_id].extend(o.new_token_ids)
    return steps, (group.comm_s - comm0) if group else 0.0, [tokens[i] for i in ids]


def main(argv: list[str] | None = None) -> int:
    from pdserve import LLM
    from pdserve.engine.model import ModelConfig

    ap = argparse.ArgumentParser(prog="pdserve bench tp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: a synthetic 8-head Llama)")
    ap.add_argument("--sizes", default="2", help="TP sizes to compare with 1 (comma-separated)")
    ap.add_argument("--prompts", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per size, interleaved")
    ap.add_argument("--quick", action="store_true", help="1 round, 2 prompts x 6 tokens")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.prompts, args.max_tokens = 1, 2, 6
    sizes = [1, *(int(s) for s in args.sizes.split(",") if int(s) != 1)]
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-tp-") as tmp:
        model = args.model or synthetic_model(tmp)
        config = ModelConfig.from_path(model)
        rng = random.Random(0)
        prompts = [[rng.randrange(10, config.vocab_size) for _ in range(rng.randint(32, 96))]
                   for _ in range(args.prompts)]  # fmt: skip
        llms = {}
        for size in sizes:
            log(f"starting TP={size}")
            llms[size] = LLM(model, dtype="float32", tensor_parallel_size=size, enable_prefix_caching=False,
                             num_blocks=args.prompts * (96 + args.max_tokens) // 16 + args.prompts + 8)  # fmt: skip
        steps: dict[int, list[float]] = {s: [] for s in sizes}
        comm: dict[int, float] = dict.fromkeys(sizes, 0.0)
        outputs: dict[int, list[list[int]]] = {}
        try:
            for r in range(args.repeats):
                for size in sizes:
                    log(f"round {r + 1}/{args.repeats}: TP={size}")
                    s, c, toks = run_once(llms[size], prompts, args.max_tokens)
                    steps[size] += s
                    comm[size] += c
                    outputs[size] = toks
            layout = llms[1].engine.layout
        finally:
            for llm in llms.values():
                llm.close()
    base = statistics.median(steps[1])
    result: dict[str, Any] = {
        "model": model if args.model else "synthetic Llama (hidden 576, 12 layers, 8 heads, 4 KV heads)",
        "prompts": args.prompts, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "kv_bytes_per_block": layout.block_nbytes, "sizes": {},
    }  # fmt: skip
    for size in sizes:
        med = statistics.median(steps[size])
        result["sizes"][str(size)] = {
            "median_decode_step_ms": med * 1e3,
            "output_tok_per_s": args.prompts / med,
            "step_over_tp1": med / base,
            "collective_share": comm[size] / sum(steps[size]) if size > 1 else 0.0,
            "kv_bytes_per_rank_slice": layout.block_nbytes // min(size, layout.num_kv_heads),
            "greedy_equal_tp1": outputs[size] == outputs[1],
        }
    emit(result, args.json, report_rows(result))
    return 0 if all(v["greedy_equal_tp1"] for v in result["sizes"].values()) else 1


def report_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("model", result["model"]), ("batch", f"{result['prompts']} sequences x {result['max_tokens']} tokens, "
                                                 f"{result['repeats']} round(s)")]  # fmt: skip
    for size, v in result["sizes"].items():
        rows.append((f"TP={size}", f"decode step {v['median_decode_step_ms']:.2f} ms ({v['step_over_tp1']:.2f}x TP=1), "
                                   f"{v['output_tok_per_s']:.0f} tok/s, collectives {v['collective_share']:.0%} of "
                                   f"rank 0's step, greedy equal to TP=1: {v['greedy_equal_tp1']}"))  # fmt: skip
    rows.append(("KV per block", f"{result['kv_bytes_per_block']} bytes pulled once at any TP size"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
