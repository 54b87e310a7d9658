"""Prefix-cache benchmark: TTFT of a prompt whose long prefix is cached vs the same prompt cold.

Both prompts are ``prefix (2,000 tokens) + suffix (~50 tokens)`` with a fresh random
suffix each run. Cold runs use a unique ``cache_salt``, so the identical prefix hashes
to blocks never seen before and is computed from scratch; warm runs use the salt-free
prefix, which a primer request cached once up front, so only the suffix is computed.
TTFT is the wall time from ``add_request`` to the step that returns the first token
(``max_tokens=1``, so the request also finishes there and frees its blocks). Cold and
warm runs alternate; each side reports its median.

Run: ``python -m benchmarks.prefix [--quick] [--json]`` or ``pdserve bench prefix``.
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
from pdserve.benchmarks.engine import MODEL_KWARGS, build_model
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kvcache.manager import cdiv
from pdserve.engine.model.tiny import NUM_BYTES
from pdserve.engine.sampling_params import SamplingParams


def log(msg: str) -> None:
    """Progress line on stderr (stdout stays clean for ``--json``)."""
    print(f"[bench prefix] {msg}", file=sys.stderr, flush=True)


def ttft(engine: LLMEngine, prompt: list[int], cache_salt: str | None) -> tuple[float, int]:
    """Seconds from ``add_request`` to the first token out of ``step()``, and the cached tokens reported."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    req = engine.add_request(prompt, params, cache_salt=cache_salt)
    while True:
        outs = engine.step()
        mine = [o for o in outs if o.request_id == req.request_id]
        if mine and mine[0].new_token_ids:
            elapsed = time.perf_counter() - t0
            if not mine[0].finished:
                engine.abort(req.request_id)
            return elapsed, mine[0].num_cached_tokens
        if not outs and not engine.has_unfinished():
            raise RuntimeError("request vanished before producing a token")


def bench_prefix(prefix_len: int, suffix_len: int, repeats: int, block_size: int, seed: int) -> dict[str, Any]:
    """Alternate cold / warm TTFT measurements on one engine; medians and their ratio."""
    if prefix_len + suffix_len + 1 > MODEL_KWARGS["max_position_embeddings"]:
        raise ValueError("prefix + suffix exceed the model's max_position_embeddings")
    rng = random.Random(seed)
    prefix = [rng.randrange(NUM_BYTES) for _ in range(prefix_len)]

    def suffix() -> list[int]:
        return [rng.randrange(NUM_BYTES) for _ in range(suffix_len)]

    per_req_blocks = cdiv(prefix_len + suffix_len + 1, block_size)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-prefix-") as tmp:
        model_dir = build_model(tmp)
        config = EngineConfig(
            str(model_dir),
            dtype="float32",
            device="cpu",
            cache=CacheConfig(block_size=block_size, num_blocks=8 * per_req_blocks, enable_prefix_caching=True),
            scheduler=SchedulerConfig(max_num_batched_tokens=max(4096, prefix_len + suffix_len)),
        )
        engine = LLMEngine(config)
        log(f"warm-up and priming the {prefix_len}-token prefix (block {block_size})")
        ttft(engine, prefix + suffix(), "warmup")  # kernels/allocator warm-up, cold path
        ttft(engine, prefix + suffix(), None)  # primer: caches the salt-free prefix
        cold: list[float] = []
        warm: list[float] = []
        warm_cached: list[int] = []
        cold_cached: list[int] = []
        for i in range(repeats):
            t, c = ttft(engine, prefix + suffix(), f"cold-{i}")
            cold.append(t)
            cold_cached.append(c)
            t, c = ttft(engine, prefix + suffix(), None)
            warm.append(t)
            warm_cached.append(c)
            log(f"repeat {i + 1}/{repeats}: cold {cold[-1] * 1000:.1f} ms, warm {warm[-1] * 1000:.1f} ms "
                f"({warm_cached[-1]} cached tokens)")
    med_cold, med_warm = statistics.median(cold), statistics.median(warm)
    return {
        "model": dict(MODEL_KWARGS),
        "block_size": block_size,
        "prefix_tokens": prefix_len,
        "suffix_tokens": suffix_len,
        "repeats": repeats,
        "cold_ttft_s": cold,
        "warm_ttft_s": warm,
        "cold_ttft_median_s": med_cold,
        "warm_ttft_median_s": med_warm,
        "warm_over_cold": med_warm / med_cold,
        "warm_cached_tokens": warm_cached,
        "cold_cached_tokens": cold_cached,
    }


def main(argv: list[str] | None = None) -> int:
    """``pdserve bench prefix``: print a table (or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(prog="pdserve bench prefix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter prefix and fewer repeats (a smoke run)")
    ap.add_argument("--prefix-tokens", type=int, default=None, help="cached prefix length (default 2000)")
    ap.add_argument("--suffix-tokens", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=None, help="cold/warm pairs (default 5; 2 with --quick)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    prefix_len = args.prefix_tokens or (500 if args.quick else 2000)
    repeats = args.repeats or (2 if args.quick else 5)
    r = bench_prefix(prefix_len, args.suffix_tokens, repeats, args.block_size, args.seed)
    cached = sorted(set(r["warm_cached_tokens"]))
    emit(
        r,
        args.json,
        [
            ("model", f"llama {MODEL_KWARGS['num_layers']}L h{MODEL_KWARGS['hidden_size']}, fp32 CPU, "
                      f"block {r['block_size']}"),
            ("prompt", f"{r['prefix_tokens']} prefix + {r['suffix_tokens']} new tokens, median of {r['repeats']}"),
            ("TTFT cold (prefix not cached)", f"{r['cold_ttft_median_s'] * 1000:.1f} ms"),
            ("TTFT warm (prefix cached)", f"{r['warm_ttft_median_s'] * 1000:.1f} ms"),
            ("ratio warm / cold", f"{r['warm_over_cold']:.3f} (target <= 0.15)"),
            ("cached tokens (warm)", ", ".join(map(str, cached)) + f" of {r['prefix_tokens'] + r['suffix_tokens']}"),
            ("cached tokens (cold)", ", ".join(map(str, sorted(set(r["cold_cached_tokens"]))))),
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
