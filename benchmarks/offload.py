"""Offload-tier benchmark: shared prefixes four times the KV pool, with and without the tier.

Workload: ``--prefixes`` shared prefixes of ``--prefix-tokens`` tokens whose blocks together are
4x the pool; requests are ``prefix + 16 fresh tokens`` with one output token, the prefixes in a
shuffled order each round, one request at a time. Without a tier, LRU eviction cycles the pool
and a prefix is gone by the time it returns; with the tier (big enough for every prefix) it is
restored by a memory copy; with a disk tier behind a host tier that holds one prefix, most come
back from disk. Reported: the prefix hit rate (cached tokens / prompt tokens, a ratio of sums) and
TTFT (median, p90) of the rounds after the first, each configuration on its own engine, run one
after the other. Then the TTFT of one prefix restored from the host tier, restored from the disk
tier, and recomputed (in turn, medians).

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


def make_engine(model_dir: str, num_blocks: int, offload_gb: float, block_size: int, disk_gb: float = 0.0,
                disk_dir: str | None = None) -> LLMEngine:  # fmt: skip
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_offload_gb=offload_gb,
                        kv_offload_disk_gb=disk_gb, kv_offload_disk_dir=disk_dir)  # fmt: skip
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


def restore_ttft(engine: LLMEngine, target: list[int], others: list[list[int]], suffix: list[int]) -> tuple[float, int]:
    """TTFT of ``target + suffix`` after it was cached and pushed out of the pool by ``others``."""
    ttft(engine, target + suffix, None)
    for other in others:
        ttft(engine, other + suffix, None)
    return ttft(engine, target + suffix, None)


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
        small_gb = prefix_blocks * probe.layout.block_nbytes / 1024**3  # one prefix: the rest spills to disk
        result["tier_gb"], result["small_host_tier_gb"] = tier_gb, small_gb
        configs = {"without tier": (0.0, 0.0), "with tier": (tier_gb, 0.0), "with disk tier": (small_gb, tier_gb)}
        for name, (gb, disk_gb) in configs.items():
            log(f"{name}: {args.prefixes} prefixes of {prefix_blocks} blocks, pool {pool_blocks} blocks")
            engine = make_engine(model_dir, pool_blocks, gb, bs, disk_gb, tmp)
            ttft(engine, prefixes[0] + [1] * SUFFIX, "warmup")
            result[name] = run_workload(engine, prefixes, args.rounds, args.seed)
            if engine.tier is not None and engine.tier.spill is not None:
                result[name]["disk_loaded_blocks"] = engine.tier.spill.stats().loaded
            engine.close()
        # One prefix recomputed, restored from the host tier, restored from the disk tier (a one-block
        # host tier in front of it), in turn.
        host = make_engine(model_dir, pool_blocks, tier_gb, bs)
        disk = make_engine(model_dir, pool_blocks, probe.layout.block_nbytes / 1024**3, bs, tier_gb, tmp)
        times: dict[str, list[float]] = {"recompute": [], "host": [], "disk": []}
        target, others = prefixes[0], prefixes[1:5]
        for i in range(args.repeats):
            suffix = [rng.randrange(NUM_BYTES) for _ in range(SUFFIX)]
            times["recompute"].append(ttft(host, target + suffix, f"cold-{i}")[0])  # a salt: nothing to reuse
            for name, engine in (("host", host), ("disk", disk)):
                t, cached = restore_ttft(engine, target, others, suffix)
                times[name].append(t)
                if cached < len(target):
                    raise RuntimeError(f"restore from the {name} tier found {cached} of {len(target)} tokens")
            log(f"round {i + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1] * 1000:.1f} ms" for k, v in times.items()))
        for name, ts in times.items():
            result[f"{name}_ttft_median_s"] = statistics.median(ts)
        host.close()
        disk.close()
        result["restore_ttft_median_s"] = result.pop("host_ttft_median_s")
        result["disk_restore_ttft_median_s"] = result.pop("disk_ttft_median_s")
    without, with_, disk_ = result["without tier"], result["with tier"], result["with disk tier"]
    small_gb = result["small_host_tier_gb"]
    rows = [
        ("model", f"llama {MODEL_KWARGS['num_layers']}L h{MODEL_KWARGS['hidden_size']}, fp32 CPU, block {bs}"),
        ("workload", f"{args.prefixes} prefixes x {prefix_blocks * bs} tokens = 4x a {pool_blocks}-block pool, "
                     f"+{SUFFIX} new tokens, {args.rounds - 1} measured rounds"),
        ("without tier", f"hit rate {without['hit_rate']:.1%}, TTFT median {without['ttft_median_s'] * 1000:.1f} ms, "
                         f"p90 {without['ttft_p90_s'] * 1000:.1f} ms"),
        ("with tier", f"hit rate {with_['hit_rate']:.1%}, TTFT median {with_['ttft_median_s'] * 1000:.1f} ms, "
                      f"p90 {with_['ttft_p90_s'] * 1000:.1f} ms ({tier_gb * 1024:.0f} MiB tier)"),
        ("with disk tier", f"hit rate {disk_['hit_rate']:.1%}, TTFT median {disk_['ttft_median_s'] * 1000:.1f} ms, "
                           f"p90 {disk_['ttft_p90_s'] * 1000:.1f} ms ({small_gb * 1024:.1f} MiB host tier, "
                           f"{disk_['disk_loaded_blocks']} blocks loaded from disk)"),
        ("TTFT with / without", f"host tier {with_['ttft_median_s'] / without['ttft_median_s']:.3f}, "
                                f"disk tier {disk_['ttft_median_s'] / without['ttft_median_s']:.3f}"),
        ("restore vs recompute", f"host tier {result['restore_ttft_median_s'] * 1000:.1f} ms, disk tier "
                                 f"{result['disk_restore_ttft_median_s'] * 1000:.1f} ms, recompute "
                                 f"{result['recompute_ttft_median_s'] * 1000:.1f} ms "
                                 f"({result['restore_ttft_median_s'] / result['recompute_ttft_median_s']:.3f}, "
                                 f"{result['disk_restore_ttft_median_s'] / result['recompute_ttft_median_s']:.3f})"),
    ]  # fmt: skip
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
