"""A decode step's elementwise kernels (``engine/kernels/cpu_ops.c``) against the torch expressions they
replace, at a model's widths: RMSNorm with the residual add before it, SwiGLU's activation, the rotary
embedding, and greedy sampling's argmax over the logits (the kernel on the head's own dtype, against the
sampler's old way: the logits widened to float32, then ``max``).

Each operation is first checked against its torch expression (the run exits 1 on a mismatch: argmax,
rotary and bfloat16 exactly, float32 within its rounding); then the two are timed in alternation,
``--repeats`` rounds of ``--calls`` calls each, and the median of the rounds is reported per call. The
loop keeps its operands in cache: inside a decode step, where the weights stream through the caches
between these calls, each takes longer on both paths. Without a C compiler (or with
``PDSERVE_CPU_KERNELS=0``) the kernels are not built and the run says so and exits 0.

Run: ``python -m pdserve.benchmarks.elementwise [--rows 1,32] [--dtypes float32,bfloat16] [--json]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.benchmarks.common import emit
from pdserve.engine.kernels import cpu_ops
from pdserve.engine.model.rope import apply_rotary

Op = tuple[Callable[[], Any], Callable[[], Any]]  # (kernel, torch expression)


def operations(rows: int, dtype: torch.dtype, hidden: int, inter: int, heads: int, head_dim: int,
               vocab: int) -> dict[str, Op]:  # fmt: skip
    """The kernels and their torch expressions on random operands of one step's shapes."""
    gen = torch.Generator().manual_seed(rows)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    h, delta, weight = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    gate_up, logits = rand(rows, 2 * inter) * 4, rand(rows, vocab) * 3
    qk, half = rand(rows, heads * head_dim), head_dim // 2
    cos, sin = rand(rows, 1, half), rand(rows, 1, half)

    def norm_torch() -> tuple[torch.Tensor, torch.Tensor]:
        s = h + delta
        return s, weight * F.rms_norm(s.float(), (hidden,), eps=1e-5).to(dtype)

    return {
        "add + rms_norm": (lambda: cpu_ops.add_rms_norm(h, delta, weight, 1e-5), norm_torch),
        "silu(gate) * up": (lambda: cpu_ops.silu_mul(gate_up, inter),
                            lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:]),
        "rotary": (lambda: _rotated(qk, heads, head_dim, cos, sin),
                   lambda: apply_rotary(qk.view(rows, heads, head_dim), cos, sin).view(rows, -1)),
        "greedy argmax": (lambda: cpu_ops.argmax_rows(logits), lambda: logits.float().max(dim=-1).indices),
    }  # fmt: skip


def _rotated(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    y = x.clone()  # rotary_ works in place; the torch expression returns a new tensor, so both copy once
    cpu_ops.rotary_(y, heads, head_dim, cos, sin)
    return y


def check(name: str, kernel: Callable[[], Any], reference: Callable[[], Any], dtype: torch.dtype) -> None:
    """Exit 1 unless the kernel gives the torch expression's result (float32 within its rounding)."""
    got, want = kernel(), reference()
    pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
    for g, w in pairs:
        exact = dtype != torch.float32 or g.dtype == torch.int64
        ok = torch.equal(g, w) if exact else torch.allclose(g, w, rtol=1e-5, atol=1e-6)
        if not ok:
            raise SystemExit(f"elementwise: {name} ({dtype}) differs from its torch expression")


def time_pair(kernel: Callable[[], Any], reference: Callable[[], Any], calls: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each, timed in alternation, and the median of the rounds' ratios."""
    rounds: dict[str, list[float]] = {"kernel": [], "torch": []}
    for fn in (kernel, reference):
        fn()  # warm: the library built, the operands touched
    for _ in range(repeats):
        for name, fn in (("torch", reference), ("kernel", kernel)):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            rounds[name].append((time.perf_counter() - t0) / calls)
    return {"kernel_us": statistics.median(rounds["kernel"]) * 1e6,
            "torch_us": statistics.median(rounds["torch"]) * 1e6,
            "speedup": statistics.median(t / k for t, k in zip(rounds["torch"], rounds["kernel"]))}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench elementwise", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rows", default="1,32", help="rows per call (a decode step's sequences)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--widths", default="576,1536,9,64,49152",
                    help="hidden, intermediate, query heads, head size, vocabulary (SmolLM2-135M's)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    hidden, inter, heads, head_dim, vocab = (int(x) for x in args.widths.split(","))
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    if not all(cpu_ops.supports(torch.zeros(1, dtype=d)) for d in dtypes):
        print("elementwise: the kernels are not built here (no C compiler, or PDSERVE_CPU_KERNELS=0)", file=sys.stderr)
        return 0
    results = []
    for dtype in dtypes:
        for rows in (int(r) for r in args.rows.split(",")):
            for name, (kernel, reference) in operations(rows, dtype, hidden, inter, heads, head_dim, vocab).items():
                check(name, kernel, reference, dtype)
                timed = time_pair(kernel, reference, args.calls, args.repeats)
                results.append({"op": name, "dtype": str(dtype).removeprefix("torch."), "rows": rows, **timed})
    result = {"threads": torch.get_num_threads(), "results": results}
    rows_out = [(f"{r['dtype']} {r['rows']} rows: {r['op']}",
                 f"kernel {r['kernel_us']:.1f} us, torch {r['torch_us']:.1f} us: {r['speedup']:.2f}x")
                for r in results]  # fmt: skip
    emit(result, args.json, [("threads", str(result["threads"])), *rows_out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
