"""KV-cache core benchmark: block hashing vs raw xxh3_128, and BlockPool operations per second.

Run: ``python -m benchmarks.kvcache`` or ``pdserve bench kvcache [--json]``.
"""

from __future__ import annotations

import argparse
import random

import cbor2
import xxhash

from pdserve.benchmarks.common import emit, median_time
from pdserve.engine.kvcache import KVCacheManager
from pdserve.engine.kvcache.hashing import BlockHasher
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def bench_hashing(num_blocks: int, block_size: int, repeats: int) -> dict[str, float]:
    tokens = [random.Random(0).randrange(32000) for _ in range(num_blocks * block_size)]

    def ours() -> None:
        BlockHasher(block_size).extend(tokens)

    # The reference hashes pre-encoded CBOR bytes of the same (parent, tokens, None) tuples.
    payloads = []
    h = BlockHasher(block_size)
    h.extend(tokens)
    parents = [xxhash.xxh3_128_digest(cbor2.dumps("0", canonical=True)), *h.hashes[:-1]]
    for i, parent in enumerate(parents):
        payloads.append(cbor2.dumps((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None), canonical=True))

    def raw() -> None:
        for p in payloads:
            xxhash.xxh3_128_digest(p)

    objs = [cbor2.loads(p) for p in payloads]

    def encode_and_hash() -> None:
        for o in objs:
            xxhash.xxh3_128_digest(cbor2.dumps(o, canonical=True))

    t_ours, t_raw, t_enc = median_time(ours, repeats), median_time(raw, repeats), median_time(encode_and_hash, repeats)
    return {
        "blocks": num_blocks,
        "ours_blocks_per_s": num_blocks / t_ours,
        "raw_xxh3_blocks_per_s": num_blocks / t_raw,
        "cbor_plus_xxh3_blocks_per_s": num_blocks / t_enc,
        "ours_over_raw_time": t_ours / t_raw,
        "ours_over_cbor_plus_xxh3_time": t_ours / t_enc,
    }


def bench_pool(num_blocks: int, block_size: int, repeats: int) -> dict[str, float]:
    """Allocate every block to requests of 8 blocks, cache them, free them, then re-admit with hits."""
    per_req = 8
    n_req = num_blocks // per_req
    reqs = [
        Request(f"r{i}", list(range(i * 1000, i * 1000 + per_req * block_size)), SamplingParams(), block_size)
        for i in range(n_req)
    ]

    def cycle() -> int:
        m = KVCacheManager(num_blocks, block_size)
        ops = 0
        for r in reqs:
            r.num_computed_tokens = 0
            m.allocate_slots(r, r.num_tokens)
            ops += per_req
        for r in reqs:
            m.free(r)
            ops += per_req
        for r in reqs:  # all prefix hits: touch (remove from the middle of the free queue)
            r.num_computed_tokens = 0
            hit, n = m.get_computed_blocks(r)
            m.allocate_slots(r, r.num_tokens - n, n, hit)
            ops += per_req
        for r in reqs:
            m.free(r)
            ops += per_req
        return ops

    ops = cycle()
    t = median_time(cycle, repeats)
    return {"blocks": num_blocks, "block_ops": ops, "block_ops_per_s": ops / t}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench kvcache", description=__doc__)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    h = bench_hashing(min(args.blocks, 50_000), args.block_size, args.repeats)
    p = bench_pool(args.blocks, args.block_size, args.repeats)
    emit(
        {"hashing": h, "pool": p},
        args.json,
        [
            ("block hashing (ours)", f"{h['ours_blocks_per_s']:,.0f} blocks/s"),
            ("raw xxh3_128 over CBOR", f"{h['raw_xxh3_blocks_per_s']:,.0f} blocks/s"),
            ("cbor2.dumps + xxh3_128", f"{h['cbor_plus_xxh3_blocks_per_s']:,.0f} blocks/s"),
            ("time ratio ours / raw xxh3", f"{h['ours_over_raw_time']:.1f}x (ours also CBOR-encodes)"),
            ("time ratio ours / cbor2+xxh3", f"{h['ours_over_cbor_plus_xxh3_time']:.2f}x"),
            (f"pool ops, {p['blocks']:,} blocks", f"{p['block_ops_per_s']:,.0f} block-ops/s"),
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
