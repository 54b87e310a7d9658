"""Offload-tier benchmark: shared prefixes four times the KV pool, with and without the tier.

Workload: ``--prefixes`` shared prefixes of ``--prefix-tokens`` tokens whose blocks together are
4x the pool; requests are ``prefix + 16 fresh tokens`` with one output token, the prefixes in a
shuffled order each round, one request at a time. Without a tier, LRU eviction cycles the pool
and a prefix is gone by the time it returns; with the tier (big enough for every prefix) it is
restored by a memory copy. Reported: the prefix hit rate (cached tokens / prompt tokens, a ratio
of sums) and TTFT (median, p90) of the rounds after the first, each configuration on its own
engine, run one after the other. Then the TTFT of one prefix restored from the tier against the
same prompt recomputed (alternating, medians).

Run: ``pdserve bench offload [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from typing import Any

from pdserve.benchmarks.common import emit
from pdserve.benchmarks.engine import MODEL_KWARGS, build_model
from pdserve.benchmarks.prefix import ttft
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model.tiny import NUM_BYTES

SUFFIX = 16


def log(msg: str) -> None:
    print(f"[bench offload] {msg}", file=sys.stderr, flush=True)


def p90(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]


def make_engine(model_dir: str, num_blocks: int, offload_gb: float, block_size: int) -> LLMEngine:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_offload_gb=offload_gb)
    return LLMEngine(EngineConfig(model_dir, dtype="float32", device="cpu", cache=cache,
                                  scheduler=SchedulerConfig(max_num_batched_tokens=4096)))  # fmt: skip


def run_workload(engine: LLMEngine, prefixes: list[list[int]], rounds: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    times: list[float] = []
    prompt_tokens = cached_tokens = 0
    for r in range(rounds):
        order = list(range(len(prefixes)))
        rng.shuffle(order)
        for i in order:
            prompt = prefixes[i] + [rng.randrange(NUM_BYTES) for _ in range(SUFFIX)]
            t, cached = ttft(engine, prompt, None)
            if r > 0:  # the first round fills the caches
                times.append(t)
                prompt_tokens += len(prompt)
                cached_tokens += cached
        log(f"round {r + 1}/{rounds}: {cached_tokens} of {prompt_tokens} prompt tokens cached so far")
    return {"hit_rate": cached_tokens / prompt_tokens, "ttft_median_s": statistics.median(times),
            "ttft_p90_s": p90(times), "requests": len(times)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench offload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="restore/recompute pairs")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="256-token prefixes, 3 rounds, 3 pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.rounds, args.repeats = 256, 3, 3
    bs = args.block_size
    prefix_blocks = args.prefix_tokens // bs
    pool_blocks = args.prefixes * prefix_blocks // 4  # the prefixes are 4x the pool
    if pool_blocks < prefix_blocks + (SUFFIX + 1) // bs + 2:
        raise ValueError("the pool must hold at least one whole prompt: more prefixes or shorter ones")
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(NUM_BYTES) for _ in range(prefix_blocks * bs)] for _ in range(args.prefixes)]
    result: dict[str, Any] = {"model": dict(MODEL_KWARGS), "block_size": bs, "pool_blocks": pool_blocks,
                              "prefixes": args.prefixes, "prefix_tokens": prefix_blocks * bs}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-offload-") as tmp:
        model_dir = str(build_model(tmp))
        probe = make_engine(model_dir, 1, 0.0, bs)
        tier_gb = 2 * args.prefixes * prefix_blocks * probe.layout.block_nbytes / 1024**3  # every prefix, twice over
        result["tier_gb"] = tier_gb
        for name, gb in (("without tier", 0.0), ("with tier", tier_gb)):
            log(f"{name}: {args.prefixes} prefixes of {prefix_blocks} blocks, pool {pool_blocks} blocks")
            engine = make_engine(model_dir, pool_blocks, gb, bs)
            ttft(engine, prefixes[0] + [1] * SUFFIX, "warmup")
            result[name] = run_workload(engine, prefixes, args.rounds, args.seed)
        # Restore vs recompute of one prefix, alternating on one engine with a tier.
        engine = make_engine(model_dir, pool_blocks, tier_gb, bs)
        restore: list[float] = []
        recompute: list[float] = []
        target, others = prefixes[0], prefixes[1:]
        for i in range(args.repeats):
            suffix = [rng.randrange(NUM_BYTES) for _ in range(SUFFIX)]
            t, cached = ttft(engine, target + suffix, f"cold-{i}")  # a salt: nothing to reuse
            recompute.append(t)
            ttft(engine, target + suffix, None)  # cache it (salt-free) ...
            for other in others[:4]:  # ... and push it out of the pool into the tier
                ttft(engine, other + suffix, None)
            t, cached = ttft(engine, target + suffix, None)
            restore.append(t)
            log(f"pair {i + 1}/{args.repeats}: recompute {recompute[-1] * 1000:.1f} ms, restore "
                f"{restore[-1] * 1000:.1f} ms ({cached} tokens from the tier)")
        result["restore_ttft_median_s"] = statistics.median(restore)
        result["recompute_ttft_median_s"] = statistics.median(recompute)
    without, with_ = result["without tier"], result["with tier"]
    rows = [
        ("model", f"llama {MODEL_KWARGS['num_layers']}L h{MODEL_KWARGS['hidden_size']}, fp32 CPU, block {bs}"),
        ("workload", f"{args.prefixes} prefixes x {prefix_blocks * bs} tokens = 4x a {pool_blocks}-block pool, "
                     f"+{SUFFIX} new tokens, {args.rounds - 1} measured rounds"),
        ("without tier", f"hit rate {without['hit_rate']:.1%}, TTFT median {without['ttft_median_s'] * 1000:.1f} ms, "
                         f"p90 {without['ttft_p90_s'] * 1000:.1f} ms"),
        ("with tier", f"hit rate {with_['hit_rate']:.1%}, TTFT median {with_['ttft_median_s'] * 1000:.1f} ms, "
                      f"p90 {with_['ttft_p90_s'] * 1000:.1f} ms ({tier_gb * 1024:.0f} MiB tier)"),
        ("TTFT with / without", f"{with_['ttft_median_s'] / without['ttft_median_s']:.3f}"),
        ("restore from tier vs recompute", f"{result['restore_ttft_median_s'] * 1000:.1f} ms vs "
                                           f"{result['recompute_ttft_median_s'] * 1000:.1f} ms "
                                           f"({result['restore_ttft_median_s'] / result['recompute_ttft_median_s']:.3f})"),
    ]  # fmt: skip
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
