"""A cascade's shared-prefix attention in bfloat16, per step and per layer: the AMX tiles
(``engine/kernels/cpu_amx_prefix.c``) against ATen's flash operator, the path float32 and CPUs without
AMX keep.

The problem is a decode step's: ``--batch`` sequences (``--heads``: query heads, KV heads, head size;
SmolLM2-135M's by default) sharing a ``--prefix``-token prefix in shuffled blocks of a block-major
``--layers``-layer cache. Per step, each path first takes every layer's prefix out of the paged cache
(the flash path gathers it, the tile path packs it in the tiles' layouts); per layer, it runs the
prefix part over one layer. Both are checked against a float64 softmax first (exit 1 past the
tolerance), then timed in alternation, ``--repeats`` rounds of ``--calls`` calls each: medians per
call and the ratio. Without AMX (or its kernel built) the run says so and exits 0.

Run: ``pdserve bench prefix-cpu [--batch 32] [--prefix 208] [--heads 9,3,64] [--layers 30] [--json]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.benchmarks.common import emit
from pdserve.engine.kernels import cpu_amx_prefix
from pdserve.engine.kernels.cascade import attention_lse

BLOCK_SIZE = 16
ATOL = 3e-3  # tests/engine/test_amx_prefix.py's bound, plus 1% of each value


def timed(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each function, in rounds that alternate between them."""
    rounds: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            rounds[name].append((time.perf_counter() - t0) / calls)
    return {name: statistics.median(t) for name, t in rounds.items()}


def run(batch: int, prefix: int, heads: int, kv_heads: int, d: int, layers: int, calls: int,
        repeats: int) -> dict[str, Any]:  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    blocks = -(-prefix // BLOCK_SIZE)
    cache = torch.randn(4 * blocks, layers, 2, BLOCK_SIZE, kv_heads, d, generator=gen).to(torch.bfloat16)
    ids = torch.randperm(4 * blocks, generator=gen)[:blocks]
    q = torch.randn(kv_heads, batch * (heads // kv_heads), d, generator=gen).to(torch.bfloat16)
    scale = d**-0.5

    def gathered() -> torch.Tensor:  # the flash path's per-step gather: [layers, 2, keys, H, D]
        blocks_first = cache.permute(1, 2, 0, 3, 4, 5)
        return torch.index_select(blocks_first, 2, ids).flatten(2, 3)

    kv = gathered()
    packed = cpu_amx_prefix.pack(cache, slice(None), ids)
    k, v = kv[0, 0].transpose(0, 1)[None], kv[0, 1].transpose(0, 1)[None]  # layer 0, [1, H, keys, D]
    s = q.double() @ kv[0, 0].double().permute(1, 2, 0) * scale
    want = torch.softmax(s, -1) @ kv[0, 1].double().transpose(0, 1)
    outs = {"tiles": packed.attention(q, 0, scale)[0], "flash": attention_lse(q[None], k, v, scale)[0][0]}
    for name, out in outs.items():
        err = (out.double() - want).abs()
        if not (err <= ATOL + 0.01 * want.abs()).all():
            raise SystemExit(f"prefix-cpu: the {name} path differs from float64 by {err.max().item():.2e}")
    per_step = timed({"flash": gathered, "tiles": lambda: cpu_amx_prefix.pack(cache, slice(None), ids)},
                     max(1, calls // 10), repeats)  # fmt: skip
    per_layer = timed({"flash": lambda: attention_lse(q[None], k, v, scale),
                       "tiles": lambda: packed.attention(q, 0, scale)}, calls, repeats)  # fmt: skip
    step_ms = {p: (per_step[p] + layers * per_layer[p]) * 1e3 for p in per_layer}
    return {"take_prefix_ms": {p: round(t * 1e3, 3) for p, t in per_step.items()},
            "layer_us": {p: round(t * 1e6, 1) for p, t in per_layer.items()},
            "step_ms": {p: round(t, 3) for p, t in step_ms.items()},
            "layer_speedup": round(per_layer["flash"] / per_layer["tiles"], 2),
            "step_speedup": round(step_ms["flash"] / step_ms["tiles"], 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench prefix-cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--batch", type=int, default=32, help="decode sequences sharing the prefix")
    ap.add_argument("--prefix", type=int, default=208, help="prefix tokens (rounded up to whole blocks of 16)")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size (SmolLM2-135M's)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    heads, kv_heads, d = (int(x) for x in args.heads.split(","))
    if min(args.batch, args.prefix, args.layers, args.calls, args.repeats, heads, kv_heads) < 1 or heads % kv_heads:
        print("prefix-cpu: --batch, --prefix, --layers, --calls and --repeats must be positive, and the query heads "
              "a multiple of the KV heads", file=sys.stderr)  # fmt: skip
        return 2
    if d % 32 or not cpu_amx_prefix.available(torch.bfloat16, d):
        print(f"prefix-cpu: the AMX prefix kernel does not run here for head size {d} (no AMX-BF16, no C compiler, "
              "PDSERVE_CPU_KERNELS=0, or a head size that is not a multiple of 32)", file=sys.stderr)  # fmt: skip
        return 0
    prefix = -(-args.prefix // BLOCK_SIZE) * BLOCK_SIZE
    with torch.inference_mode():
        r = run(args.batch, prefix, heads, kv_heads, d, args.layers, args.calls, args.repeats)
    result = {"threads": torch.get_num_threads(), "batch": args.batch, "prefix": prefix,
              "heads": [heads, kv_heads, d], "layers": args.layers, **r}  # fmt: skip
    rows = [("problem", f"{args.batch} sequences x {heads // kv_heads} query heads a KV head, {kv_heads} KV heads of "
                        f"{d}, a {prefix}-token prefix, {args.layers} layers, {result['threads']} threads"),
            ("per step: take every layer's prefix", f"flash path (gather) {r['take_prefix_ms']['flash']} ms, tiles "
                                                    f"(pack) {r['take_prefix_ms']['tiles']} ms"),
            ("per layer: the prefix part", f"flash operator {r['layer_us']['flash']} us, tiles "
                                           f"{r['layer_us']['tiles']} us: {r['layer_speedup']}x"),
            ("a step's prefix work", f"flash path {r['step_ms']['flash']} ms, tiles {r['step_ms']['tiles']} ms: "
                                     f"{r['step_speedup']}x")]  # fmt: skip
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
