"""CPU decode attention, one layer: the in-place kernel (``engine/kernels/cpu_decode.c``) against the
torch path that gathers each sequence's K/V out of its blocks and runs SDPA.

Both run through ``paged_attention_torch`` with a plan built the way the engine builds it (``fused``
on or off), on a cache of shuffled blocks inside a two-layer, block-major KV tensor (so a layer's K
and V are strided views, as in the engine), every sequence decoding one token. Each shape is first
checked against the float32 reference (the run exits 1 on a mismatch); then the two are timed in
alternation, ``--repeats`` rounds of ``--calls`` calls each, and the median of the rounds is reported
per call. ``gbps`` counts the K/V bytes each call must read once. Both paths' calls include their Python
(the plan's checks, the output tensors); ``call`` times the kernel's entry point alone in the same rounds (its
arguments made once, the outputs allocated once), which is the kernel's own read speed. With ``--layers N`` the KV tensor
holds N layers and the calls take them in turn, as a step does: for shapes whose N layers outgrow the
caches, each call reads its K/V from memory (one layer, the default, reads it from cache after the
first call). Without a C compiler (or with ``PDSERVE_CPU_KERNELS=0``) the kernel is not built and the
run says so and exits 0.

Run: ``python -m pdserve.benchmarks.attention_cpu [--shapes 32x280,8x2000] [--dtypes float32,bfloat16] [--layers 30]
[--json]``.
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
from pdserve.engine.kernels import cpu_decode, paged_attention_ref
from pdserve.engine.kernels.torch_paged import paged_attention_torch, plan_attention

BLOCK_SIZE = 16


def problem(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            layers: int = 1) -> tuple:  # fmt: skip
    """Arguments of ``paged_attention_torch`` for ``batch`` decodes of ``context`` positions each, K and
    V as lists of ``layers`` layers' views (one layer: the second of two, so that its views are strided
    as in the engine)."""
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    kv = torch.empty(num_blocks, max(layers, 2), 2, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype)  # [block, layer, K|V]
    kv.copy_(torch.randn(kv.shape, generator=gen))
    table = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    taken = [1] if layers == 1 else range(layers)
    return q, [kv[:, i, 0] for i in taken], [kv[:, i, 1] for i in taken], table, lens, qsl, head_dim**-0.5


def raw_calls(args: tuple) -> tuple[list[Callable[[], Any]], torch.Tensor]:
    """The kernel's entry point (``cpu_decode.entry``) over ``problem``'s arguments as one zero-argument
    call per layer, every position of each sequence read, and the output they all write (made once)."""
    q, ks, vs, table, lens, _, scale = args
    fn = cpu_decode.entry(q.dtype)
    assert fn is not None  # main checked cpu_decode.supports
    batch, heads, head_dim = q.shape
    kv_heads = ks[0].shape[2]
    blocks = table.to(torch.int64).contiguous()
    starts, spans = torch.zeros(batch, dtype=torch.int64), lens.to(torch.int64)
    out, lse = torch.empty_like(q), torch.empty(batch, heads, dtype=torch.float32)
    keep = (blocks, starts, spans, out, lse)
    calls = []
    for k, v in zip(ks, vs):
        argv = (q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), *k.stride()[:3], blocks.data_ptr(),
                blocks.shape[1], starts.data_ptr(), spans.data_ptr(), batch, kv_heads, heads // kv_heads, head_dim,
                k.shape[1], scale, None, 0, None, None, None, out.data_ptr(), lse.data_ptr(),
                torch.get_num_threads())  # fmt: skip
        calls.append(lambda argv=argv, keep=keep: fn(*argv))
    return calls, out


def run_shape(args: tuple, calls: int, repeats: int) -> dict[str, Any]:
    q, ks, vs, table, lens, qsl, scale = args
    k, v = ks[0], vs[0]
    plans = {name: plan_attention(table, lens, qsl, BLOCK_SIZE, fused=fused)
             for name, fused in (("torch", False), ("kernel", True))}  # fmt: skip
    ref = paged_attention_ref(q.float(), k.float(), v.float(), table, lens, qsl, scale)
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    for name, plan in plans.items():
        got = paged_attention_torch(q, k, v, table, lens, qsl, scale, plan)
        err = float((got.float() - ref).norm() / ref.norm())
        if not err < tol:
            raise SystemExit(f"attention-cpu: {name} differs from the reference by {err:.2e} (bound {tol:.0e})")
    raw, raw_out = raw_calls(args)
    raw[0]()
    if not torch.equal(raw_out, paged_attention_torch(q, k, v, table, lens, qsl, scale, plans["kernel"])):
        raise SystemExit("attention-cpu: the kernel's call alone differs from its call through the plan")
    rounds: dict[str, list[float]] = {name: [] for name in (*plans, "call")}
    for _ in range(repeats):
        for name, plan in plans.items():  # alternating, so both see the same machine
            t0 = time.perf_counter()
            for i in range(calls):
                paged_attention_torch(q, ks[i % len(ks)], vs[i % len(vs)], table, lens, qsl, scale, plan)
            rounds[name].append((time.perf_counter() - t0) / calls)
        t0 = time.perf_counter()
        for i in range(calls):
            raw[i % len(raw)]()
        rounds["call"].append((time.perf_counter() - t0) / calls)
    kv_bytes = 2 * int(lens.sum()) * k.shape[2] * k.shape[3] * k.element_size()
    out = {name: {"ms": statistics.median(t) * 1e3, "gbps": kv_bytes / statistics.median(t) / 1e9}
           for name, t in rounds.items()}  # fmt: skip
    out["speedup"] = statistics.median(a / b for a, b in zip(rounds["torch"], rounds["kernel"]))
    return out


def _row(r: dict[str, Any]) -> str:
    torch_path, kernel, call = r["torch"], r["kernel"], r["call"]
    return (f"torch path {torch_path['ms']:.3f} ms ({torch_path['gbps']:.1f} GB/s), kernel {kernel['ms']:.3f} ms "
            f"({kernel['gbps']:.1f} GB/s): {r['speedup']:.2f}x; the kernel's call alone {call['ms']:.3f} ms "
            f"({call['gbps']:.1f} GB/s)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench attention-cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--shapes", default="4x280,32x280,8x2000", help="BATCHxCONTEXT,... (decodes, positions each)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size (SmolLM2-135M's)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=1, help="layers' caches taken in turn (module docstring)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if min(args.layers, args.calls, args.repeats) < 1:
        print("attention-cpu: --layers, --calls and --repeats must be positive", file=sys.stderr)
        return 2
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    missing = [d for d in dtypes if not cpu_decode.supports(d, d, heads, kv_heads, head_dim)]
    if missing:
        print(f"attention-cpu: the in-place kernel does not run here for {missing} with heads {args.heads} "
              "(no C compiler, PDSERVE_CPU_KERNELS=0, or a head size it has no instantiation for)", file=sys.stderr)
        return 0
    results = []
    for dtype in dtypes:
        for batch, context in shapes:
            timed = run_shape(problem(batch, context, heads, kv_heads, head_dim, dtype, args.layers), args.calls,
                              args.repeats)  # fmt: skip
            results.append({"dtype": str(dtype).removeprefix("torch."), "batch": batch, "context": context, **timed})
    result = {"threads": torch.get_num_threads(), "heads": [heads, kv_heads, head_dim], "layers": args.layers,
              "results": results}  # fmt: skip
    rows = [(f"{r['dtype']} {r['batch']} x {r['context']}", _row(r)) for r in results]
    emit(result, args.json, [("threads", str(result["threads"])), ("layers", str(args.layers)), *rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
