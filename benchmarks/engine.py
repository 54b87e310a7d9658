"""Engine benchmark: offline batch throughput vs transformers, and paged-KV memory utilization.

Part 1 (throughput): a seeded batch of mixed-length prompts, every request generating
the same number of tokens greedily. Ours is ``LLM.generate`` of the whole batch, once
with the default oneDNN projections and once with ``cpu_onednn=False`` (torch's
``F.linear``, the same GEMMs transformers runs), so the share of the speed-up that comes
from the GEMM backend is visible. The reference is transformers' batched ``generate``
(left padding + attention mask, ``do_sample=False``, float32, SDPA attention) over the
same token ids. Runs alternate ours / ours-torch-linear / HF; each side's median wall
time gives output tokens/s. The fraction of greedy outputs identical between ours and
HF is reported (informational, not an assertion).

Part 2 (KV utilization): a mixed-length workload is driven through ``LLMEngine`` step
by step until every request has finished prefill (produced its first token). Then
``valid KV tokens / (blocks held * block_size)`` is compared with what a contiguous
per-request reservation would use (``max_model_len`` per request, or
``prompt_len + max_tokens`` per request).

Run: ``python -m benchmarks.engine [--quick] [--json]`` or ``pdserve bench engine``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.common import emit
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kvcache.manager import cdiv
from pdserve.engine.llm import LLM
from pdserve.engine.model.tiny import NUM_BYTES, make_tiny_model
from pdserve.engine.sampling_params import SamplingParams

# The benchmark model: small enough for CPU, large enough that matmuls (not Python) dominate.
MODEL_KWARGS: dict[str, int] = {
    "seed": 0,
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1408,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
}


def log(msg: str) -> None:
    """Progress line on stderr (stdout stays clean for ``--json``)."""
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def build_model(out_dir: str | Path) -> Path:
    """Write the benchmark's tiny Llama checkpoint into ``out_dir``."""
    return make_tiny_model(out_dir, **MODEL_KWARGS)


def make_prompts(n: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """``n`` seeded prompts of byte token ids (no special tokens), lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    return [[rng.randrange(NUM_BYTES) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


# ---------------------------------------------------------------------------------------
# Part 1: throughput vs transformers
# ---------------------------------------------------------------------------------------
@dataclass
class ThroughputConfig:
    """Sizes of the throughput comparison."""

    num_prompts: int
    min_len: int
    max_len: int
    max_tokens: int
    repeats: int
    max_num_batched_tokens: int
    seed: int = 0


class OursRunner:
    """Our engine on CPU, float32; a fresh cache salt per run so no run hits another's prefix."""

    def __init__(self, model_dir: Path, cfg: ThroughputConfig, cpu_onednn: bool = True) -> None:
        self.llm = LLM(
            str(model_dir),
            block_size=16,
            max_num_seqs=max(64, cfg.num_prompts),
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            dtype="float32",
            device="cpu",
            cpu_onednn=cpu_onednn,
        )
        self.params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
        self._runs = 0

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy output token ids per prompt (fails on any prefix-cache hit)."""
        self._runs += 1
        outs = self.llm.generate(prompts, self.params, cache_salt=f"bench-run-{self._runs}")
        cached = sum(o.num_cached_tokens for o in outs)
        if cached:
            raise RuntimeError(f"unexpected prefix-cache hits ({cached} tokens) in a throughput run")
        return [o.token_ids for o in outs]


class HFRunner:
    """transformers ``generate``: batched, left-padded, greedy, float32, SDPA attention."""

    def __init__(self, model_dir: Path, max_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
        )
        self.model.eval()
        self.max_tokens = max_tokens
        # Our requests use ignore_eos: an EOS may be emitted and generation goes on. HF's
        # equivalent is no EOS at all. min_new_tokens alone would not do: it *suppresses* EOS
        # (forcing the runner-up token, so greedy outputs diverge wherever EOS is the argmax).
        # The model's own generation_config is cleared too, or generate() merges its EOS back
        # in; with no EOS, min_new_tokens is inert and every row runs to max_new_tokens.
        self.model.generation_config.eos_token_id = None
        self.gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            eos_token_id=None,
            pad_token_id=0,
            bos_token_id=NUM_BYTES,
        )

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy output token ids per prompt, exactly ``max_tokens`` each."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.int64)
        mask = torch.zeros((len(prompts), width), dtype=torch.int64)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.int64)
            mask[i, width - len(p) :] = 1
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self.gen_config)
        new = out[:, width:].tolist()
        if any(len(row) != self.max_tokens for row in new):
            raise RuntimeError(f"HF generated {[len(r) for r in new]} tokens, expected {self.max_tokens} each")
        return new


def bench_throughput(model_dir: Path, cfg: ThroughputConfig) -> dict[str, Any]:
    """Alternate ours / HF over ``cfg.repeats`` runs of the same batch; medians, ratio and agreement."""
    prompts = make_prompts(cfg.num_prompts, cfg.min_len, cfg.max_len, cfg.seed)
    out_tokens = cfg.num_prompts * cfg.max_tokens
    log(f"load average before: {os.getloadavg()[0]:.2f} (timings are noisy if other processes compete)")
    log(f"throughput: {cfg.num_prompts} prompts ({sum(map(len, prompts))} prompt tokens), "
        f"{cfg.max_tokens} new tokens each, {torch.get_num_threads()} torch threads")
    ours = OursRunner(model_dir, cfg)
    ours_torch = OursRunner(model_dir, cfg, cpu_onednn=False)
    hf = HFRunner(model_dir, cfg.max_tokens)

    log("warm-up (ours, ours with torch linear, HF)")
    warm = prompts[: min(4, len(prompts))]
    ours.generate(warm)
    ours_torch.generate(warm)
    hf.generate(warm)

    t_ours: list[float] = []
    t_torch: list[float] = []
    t_hf: list[float] = []
    ours_out: list[list[int]] = []
    torch_out: list[list[int]] = []
    hf_out: list[list[int]] = []
    for i in range(cfg.repeats):
        t0 = time.perf_counter()
        ours_out = ours.generate(prompts)
        t_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch_out = ours_torch.generate(prompts)
        t_torch.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf_out = hf.generate(prompts)
        t_hf.append(time.perf_counter() - t0)
        log(f"repeat {i + 1}/{cfg.repeats}: ours {out_tokens / t_ours[-1]:.0f} tok/s, ours with torch linear "
            f"{out_tokens / t_torch[-1]:.0f} tok/s, HF {out_tokens / t_hf[-1]:.0f} tok/s")

    for name, outs in (("ours", ours_out), ("ours with torch linear", torch_out)):
        if any(len(o) != cfg.max_tokens for o in outs):
            raise RuntimeError(f"{name} generated {[len(o) for o in outs]} tokens, expected {cfg.max_tokens} each")
    identical = sum(a == b for a, b in zip(ours_out, hf_out))
    common_prefix = []
    for a, b in zip(ours_out, hf_out):
        n = 0
        while n < len(a) and a[n] == b[n]:
            n += 1
        common_prefix.append(n)
    med_ours, med_torch, med_hf = statistics.median(t_ours), statistics.median(t_torch), statistics.median(t_hf)
    return {
        "load_average_1min_after": os.getloadavg()[0],
        "num_prompts": cfg.num_prompts,
        "prompt_len_range": [cfg.min_len, cfg.max_len],
        "prompt_tokens": sum(map(len, prompts)),
        "max_tokens": cfg.max_tokens,
        "output_tokens": out_tokens,
        "repeats": cfg.repeats,
        "torch_threads": torch.get_num_threads(),
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "ours_times_s": t_ours,
        "ours_torch_linear_times_s": t_torch,
        "hf_times_s": t_hf,
        "ours_tok_per_s": out_tokens / med_ours,
        "ours_torch_linear_tok_per_s": out_tokens / med_torch,
        "hf_tok_per_s": out_tokens / med_hf,
        "speedup": med_hf / med_ours,
        "speedup_torch_linear": med_hf / med_torch,
        "torch_linear_identical_fraction": sum(a == b for a, b in zip(torch_out, hf_out)) / cfg.num_prompts,
        "greedy_identical_fraction": identical / cfg.num_prompts,
        "greedy_mean_common_prefix_fraction": statistics.mean(common_prefix) / cfg.max_tokens,
    }


# ---------------------------------------------------------------------------------------
# Part 2: KV memory utilization at the end of prefill
# ---------------------------------------------------------------------------------------
def kv_utilization(
    model_dir: Path, prompts: list[list[int]], block_size: int, max_tokens: int, max_model_len: int
) -> dict[str, Any]:
    """Drive an engine until every request has its first token; measure slot utilization."""
    total_prompt = sum(map(len, prompts))
    # Room for every request's full reservation: nothing is preempted, nothing waits on blocks.
    num_blocks = sum(cdiv(len(p) + max_tokens, block_size) for p in prompts) + 16
    config = EngineConfig(
        str(model_dir),
        dtype="float32",
        device="cpu",
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=total_prompt, max_num_seqs=len(prompts), max_model_len=max_model_len
        ),
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while not all(r.output_token_ids for r in reqs):
        engine.step()
        steps += 1
        if steps > 10 * len(reqs):
            raise RuntimeError("prefill did not complete")
    valid = sum(r.num_computed_tokens for r in reqs)
    held_ids = {b for r in reqs for b in engine.kv_manager.get_block_ids(r.request_id)}
    held = len(held_ids)
    # The fewest blocks that can hold each request's computed tokens: any excess is over-allocation.
    ideal = sum(cdiv(r.num_computed_tokens, block_size) for r in reqs)
    allocated_slots = held * block_size
    for r in reqs:
        engine.abort(r.request_id)
    return {
        "block_size": block_size,
        "num_requests": len(prompts),
        "steps": steps,
        "valid_tokens": valid,
        "blocks_held": held,
        "blocks_minimum": ideal,
        "allocated_slots": allocated_slots,
        "utilization": valid / allocated_slots,
        "contiguous_max_len_slots": len(prompts) * max_model_len,
        "contiguous_max_len_utilization": valid / (len(prompts) * max_model_len),
        "contiguous_prompt_plus_max_tokens_slots": total_prompt + len(prompts) * max_tokens,
        "contiguous_prompt_plus_max_tokens_utilization": valid / (total_prompt + len(prompts) * max_tokens),
    }


def bench_utilization(
    model_dir: Path, num_prompts: int, min_len: int, max_len: int, max_tokens: int,
    max_model_len: int, block_sizes: list[int], seed: int,
) -> dict[str, Any]:
    """KV utilization of one seeded workload at each block size."""
    prompts = make_prompts(num_prompts, min_len, max_len, seed + 1)
    rows = []
    for bs in block_sizes:
        log(f"KV utilization: block_size {bs}, {num_prompts} prompts ({sum(map(len, prompts))} tokens)")
        rows.append(kv_utilization(model_dir, prompts, bs, max_tokens, max_model_len))
    return {
        "num_prompts": num_prompts,
        "prompt_len_range": [min_len, max_len],
        "max_tokens": max_tokens,
        "max_model_len": max_model_len,
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``pdserve bench engine``: run both parts, print a table (or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per side (default 3; 1 with --quick)")
    ap.add_argument("--num-prompts", type=int, default=None, help="throughput batch size (default 32)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 64)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="our engine's per-step token budget (engine default 2048)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="contiguous-reservation baseline length")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-utilization", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    if args.quick:
        tp = ThroughputConfig(args.num_prompts or 8, 16, 64, args.max_tokens or 16, args.repeats or 1,
                              args.max_num_batched_tokens, args.seed)
        util_n, util_min, util_max = 16, 10, 200
    else:
        tp = ThroughputConfig(args.num_prompts or 32, 16, 256, args.max_tokens or 64, args.repeats or 3,
                              args.max_num_batched_tokens, args.seed)
        util_n, util_min, util_max = 64, 10, 500
    util_max_tokens = 256

    result: dict[str, Any] = {"model": dict(MODEL_KWARGS), "quick": args.quick}
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-engine-") as tmp:
        model_dir = build_model(tmp)
        m = MODEL_KWARGS
        rows.append(("model", f"llama {m['num_layers']}L h{m['hidden_size']} {m['num_heads']}q/{m['num_kv_heads']}kv "
                              f"heads ffn{m['intermediate_size']} vocab{m['vocab_size']}, fp32 CPU"))
        if not args.skip_throughput:
            t = bench_throughput(model_dir, tp)
            result["throughput"] = t
            rows += [
                ("batch", f"{t['num_prompts']} prompts, {t['prompt_len_range'][0]}..{t['prompt_len_range'][1]} tokens "
                          f"({t['prompt_tokens']} total), {t['max_tokens']} new tokens each, "
                          f"{t['torch_threads']} threads, median of {t['repeats']}"),
                ("ours (LLM.generate)", f"{t['ours_tok_per_s']:,.0f} output tok/s"),
                ("ours, cpu_onednn=False", f"{t['ours_torch_linear_tok_per_s']:,.0f} output tok/s"),
                ("HF generate (sdpa, fp32)", f"{t['hf_tok_per_s']:,.0f} output tok/s"),
                ("speedup ours / HF", f"{t['speedup']:.2f}x (target >= 1.5x; "
                                      f"1-min load avg {t['load_average_1min_after']:.1f})"),
                ("speedup ours torch linear / HF", f"{t['speedup_torch_linear']:.2f}x"),
                ("greedy outputs identical", f"{t['greedy_identical_fraction']:.0%} of sequences "
                                             f"(mean common prefix {t['greedy_mean_common_prefix_fraction']:.0%}); "
                                             f"torch linear {t['torch_linear_identical_fraction']:.0%}"),
            ]
        if not args.skip_utilization:
            u = bench_utilization(model_dir, util_n, util_min, util_max, util_max_tokens, args.max_model_len,
                                  [16, 8, 32], args.seed)
            result["kv_utilization"] = u
            rows.append(("KV workload", f"{u['num_prompts']} prompts, {util_min}..{util_max} tokens, "
                                        f"max_tokens {util_max_tokens}, at end of prefill"))
            for r in u["rows"]:
                target = " (target >= 95%)" if r["block_size"] == 16 else ""
                rows.append((f"KV util paged, block {r['block_size']}",
                             f"{r['utilization']:.1%} ({r['valid_tokens']} / {r['allocated_slots']} slots, "
                             f"{r['blocks_held']} blocks, minimum {r['blocks_minimum']}){target}"))
            r0 = u["rows"][0]
            rows += [
                (f"KV util contiguous, max_model_len {args.max_model_len}",
                 f"{r0['contiguous_max_len_utilization']:.1%} "
                 f"({r0['valid_tokens']} / {r0['contiguous_max_len_slots']})"),
                ("KV util contiguous, prompt+max_tokens",
                 f"{r0['contiguous_prompt_plus_max_tokens_utilization']:.1%} "
                 f"({r0['valid_tokens']} / {r0['contiguous_prompt_plus_max_tokens_slots']})"),
            ]
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
