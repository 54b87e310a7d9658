"""A cascade's shared-prefix attention, per step and per layer: in bfloat16 the AMX tiles
(``engine/kernels/cpu_amx_prefix.c``), in float32 (``--dtype float32``) the float32 kernel
(``engine/kernels/cpu_prefix.c``), against ATen's flash operator, the path CPUs without them keep.

The problem is a decode step's: ``--batch`` sequences (``--heads``: query heads, KV heads, head size;
SmolLM2-135M's by default) sharing a ``--prefix``-token prefix in shuffled blocks of a block-major
``--layers``-layer cache. A step's prefix part, as the engine runs it: the flash path gathers every
layer's prefix once, then runs each layer; the tiles pack each layer's prefix right before its call;
the float32 kernel reads the gathered prefix as the flash path does. Both are checked against a float64
softmax first (exit 1 past the tolerance), then timed in alternation, ``--repeats`` rounds: per step,
and one layer's call alone (``--calls`` calls a round, the prefix already taken); medians and the
ratios. Without the kernel for the dtype (AMX, AVX-512, a C compiler) the run says so and exits 0.

Run: ``pdserve bench prefix-cpu [--dtype bfloat16|float32] [--batch 32] [--prefix 208] [--heads 9,3,64]
[--layers 30] [--json]``.
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
from pdserve.engine.kernels import cpu_amx_prefix, cpu_prefix
from pdserve.engine.kernels.cascade import attention_lse

BLOCK_SIZE = 16
ATOL = {torch.bfloat16: 3e-3, torch.float32: 1e-5}  # the tests' bounds (bfloat16: plus 1% of each value)


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


def run(dtype: torch.dtype, batch: int, prefix: int, heads: int, kv_heads: int, d: int, layers: int, calls: int,
        repeats: int) -> dict[str, Any]:  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    blocks = -(-prefix // BLOCK_SIZE)
    cache = torch.randn(4 * blocks, layers, 2, BLOCK_SIZE, kv_heads, d, generator=gen).to(dtype)
    ids = torch.randperm(4 * blocks, generator=gen)[:blocks]
    q = torch.randn(batch, heads, d, generator=gen).to(dtype)
    scale = d**-0.5

    def gathered() -> torch.Tensor:  # the flash path's per-step gather: [layers, 2, keys, H, D]
        blocks_first = cache.permute(1, 2, 0, 3, 4, 5)
        return torch.index_select(blocks_first, 2, ids).flatten(2, 3)

    def flash_queries() -> torch.Tensor:  # [1, Hkv, B * G, D]: every sequence's query heads of a KV head
        return q.view(batch, kv_heads, heads // kv_heads, d).transpose(0, 1).reshape(1, kv_heads, -1, d)

    def flash() -> tuple[torch.Tensor, torch.Tensor]:  # as the flash path runs it, the queries' copy included
        return attention_lse(flash_queries(), k, v, scale)

    kv = gathered()
    tiles = cpu_amx_prefix.tiles(cache, slice(None), ids) if dtype == torch.bfloat16 else None

    def kernel(layer: int, kv: torch.Tensor = kv) -> tuple[torch.Tensor, torch.Tensor]:  # the dtype's kernel
        if tiles is not None:
            return tiles.attention(q, layer, scale)
        return cpu_prefix.attention(q, *kv[layer].unbind(0), scale)

    k, v = kv[0, 0].transpose(0, 1)[None], kv[0, 1].transpose(0, 1)[None]  # layer 0, [1, H, keys, D]
    s = flash_queries()[0].double() @ kv[0, 0].double().permute(1, 2, 0) * scale
    want = torch.softmax(s, -1) @ kv[0, 1].double().transpose(0, 1)  # [H, B * G, D]
    ours = kernel(0)[0].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)  # [B, H, G, D] -> as want
    relative = 0.01 if dtype == torch.bfloat16 else 0.0
    for name, out in (("kernel", ours), ("flash", flash()[0][0])):
        err = (out.double() - want).abs()
        if not (err <= ATOL[dtype] + relative * want.abs()).all():
            raise SystemExit(f"prefix-cpu: the {name} path differs from float64 by {err.max().item():.2e}")
    def flash_step() -> None:  # the float path's step: one gather, then each layer's call
        kv = gathered()
        for layer in range(layers):
            attention_lse(flash_queries(), kv[layer, 0].transpose(0, 1)[None], kv[layer, 1].transpose(0, 1)[None],
                          scale)  # fmt: skip

    def kernel_step() -> None:  # the tiles' step: each layer packed, then its call; float32: a gather, then each
        if dtype == torch.bfloat16:
            step = cpu_amx_prefix.tiles(cache, slice(None), ids)
            for layer in range(layers):
                step.attention(q, layer, scale)
            return
        kv = gathered()
        for layer in range(layers):
            kernel(layer, kv)

    per_step = timed({"flash": flash_step, "kernel": kernel_step}, max(1, calls // layers), repeats)
    # One layer's call alone, its prefix already taken (the tiles' layer 0 packed above): the kernels' own speed.
    per_layer = timed({"flash": flash, "kernel": lambda: kernel(0)}, calls, repeats)
    return {"step_ms": {p: round(t * 1e3, 3) for p, t in per_step.items()},
            "layer_us": {p: round(t * 1e6, 1) for p, t in per_layer.items()},
            "step_speedup": round(per_step["flash"] / per_step["kernel"], 2),
            "layer_speedup": round(per_layer["flash"] / per_layer["kernel"], 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench prefix-cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
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
    dtype = getattr(torch, args.dtype)
    if not (cpu_amx_prefix if dtype == torch.bfloat16 else cpu_prefix).available(dtype, d):
        print(f"prefix-cpu: no {args.dtype} prefix kernel runs here for head size {d} (bfloat16: no AMX-BF16 or a head "
              "size that is not a multiple of 32; float32: no AVX-512; no C compiler; PDSERVE_CPU_KERNELS=0)",
              file=sys.stderr)  # fmt: skip
        return 0
    prefix = -(-args.prefix // BLOCK_SIZE) * BLOCK_SIZE
    with torch.inference_mode():
        r = run(dtype, args.batch, prefix, heads, kv_heads, d, args.layers, args.calls, args.repeats)
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(), "batch": args.batch, "prefix": prefix,
              "heads": [heads, kv_heads, d], "layers": args.layers, **r}  # fmt: skip
    rows = [("problem", f"{args.batch} sequences x {heads // kv_heads} query heads a KV head, {kv_heads} KV heads of "
                        f"{d}, a {prefix}-token prefix, {args.layers} layers, {result['threads']} threads"),
            ("a step's prefix part, every layer", f"flash path (a gather, then each layer) {r['step_ms']['flash']} ms, "
                                                  f"{args.dtype} kernel {r['step_ms']['kernel']} ms: "
                                                  f"{r['step_speedup']}x"),
            ("one layer's call alone", f"flash operator {r['layer_us']['flash']} us, kernel {r['layer_us']['kernel']} "
                                       f"us: {r['layer_speedup']}x")]  # fmt: skip
    emit(result, args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
