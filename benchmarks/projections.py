"""A model's projections on the CPU, each path: float32 through the panel kernel
(``engine/kernels/cpu_gemm.c``), bfloat16 (``--dtype bfloat16``) through the AMX tile kernel
(``engine/kernels/cpu_amx.c``), against torch's products.

For each row count (a decode batch of that many sequences, or a prefill's tokens), one pass projects the rows through every
layer's weights of the model (qkv, o, gate_up, down; 30 layers of SmolLM2-135M's widths by default),
so that, as in a decode step, the weights stream from memory rather than sit in a cache. Four paths,
each checked against float64 first (the run exits 1 on a mismatch), then timed in alternation for
``--repeats`` rounds, the median pass reported with the weight bytes read per second:

- ``kernel``: :class:`engine.kernels.cpu_gemm.PanelWeights` (float32) or
  :class:`engine.kernels.cpu_amx.AMXWeights` (bfloat16), the engine's path where it is built;
- ``w_xt`` (float32): ``(weight @ x.T).T``, the transposed product (the engine's path for 2-7 rows
  without the kernel);
- ``f_linear``: ``F.linear(x, weight)``;
- ``onednn``: the packed oneDNN copy (the engine's path without the kernel: from 8 rows in float32, every
  row count in bfloat16).

GFLOP/s (2 x rows x in x out per product) say how close many rows come to the FMA units' limit.

``read`` is the memory's read speed on the same threads (a sum over a buffer the size of the weights):
what a pass could reach at best.

Each row count also times SwiGLU's gate/up over the layers' gate_up weights two ways: ``fused``
(:class:`engine.kernels.cpu_amx.AMXGluWeights` in bfloat16, :class:`engine.kernels.cpu_gemm.PanelGluWeights`
in float32, the engine's path: the activation applied from the product's sums in the same pass) and
``unfused`` (the kernel's product, then ``cpu_ops.silu_mul``), checked bit for bit equal first (exit 1
otherwise). Without a C compiler (or with ``PDSERVE_CPU_KERNELS=0``), or for
bfloat16 without AMX-BF16, the kernel does not run here: the run says so and exits 0.

Run: ``python -m pdserve.benchmarks.projections [--rows 1,4,8,16,64,256] [--layers 30] [--dtype bfloat16] [--json]``.
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
from pdserve.engine.kernels import cpu_amx, cpu_gemm, cpu_ops
from pdserve.engine.model.linear import OneDNNWeights

# SmolLM2-135M's projections: (out, in) of qkv, o, gate_up, down.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def paths(weights: list[torch.Tensor], rows: int, seed: int) -> tuple[dict[str, Callable[[], list]], list]:
    """The paths over ``weights`` (of one dtype) for ``rows`` input rows, and the inputs (one per
    input width)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = weights[0].dtype
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {w.shape[1] for w in weights}}
    packed = [OneDNNWeights(w, None) for w in weights]
    kernel = cpu_gemm.PanelWeights if dtype == torch.float32 else cpu_amx.AMXWeights
    panels = [kernel(w, None) for w in weights]
    fns: dict[str, Callable[[], list]] = {"kernel": lambda: [p(xs[w.shape[1]]) for p, w in zip(panels, weights)]}
    if dtype == torch.float32:
        fns["w_xt"] = lambda: [(w @ xs[w.shape[1]].t()).t().contiguous() for w in weights]
    fns["f_linear"] = lambda: [F.linear(xs[w.shape[1]], w) for w in weights]
    fns["onednn"] = lambda: [p(xs[w.shape[1]]) for p, w in zip(packed, weights)]
    return fns, [xs[w.shape[1]] for w in weights]


def swiglu_paths(weights: list[torch.Tensor], rows: int, seed: int) -> dict[str, Callable[[], list]]:
    """SwiGLU over the gate_up ``weights`` for ``rows`` rows: fused, and the kernel's product then
    silu_mul; SystemExit where their results differ in a bit."""
    dtype = weights[0].dtype
    x = torch.randn(rows, weights[0].shape[1], generator=torch.Generator().manual_seed(seed)).to(dtype)
    if dtype == torch.bfloat16:
        fused = [cpu_amx.AMXGluWeights(w) for w in weights]
        products = [cpu_amx.AMXWeights(w, None) for w in weights]
    else:
        fused = [cpu_gemm.PanelGluWeights(w) for w in weights]
        products = [cpu_gemm.PanelWeights(w, None) for w in weights]
    fns: dict[str, Callable[[], list]] = {
        "fused": lambda: [f(x) for f in fused],
        "unfused": lambda: [cpu_ops.silu_mul(p(x), w.shape[0] // 2) for p, w in zip(products, weights)],
    }
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    if not torch.equal(fns["fused"]()[0].view(bits), fns["unfused"]()[0].view(bits)):
        raise SystemExit(f"projections: fused SwiGLU differs from the product then silu_mul at {rows} rows")
    return fns


def check(fns: dict[str, Callable[[], list]], weights: list[torch.Tensor], inputs: list) -> None:
    """Each path's first projections against float64; SystemExit on a mismatch."""
    for name, fn in fns.items():
        outs = fn()
        for out, w, x in list(zip(outs, weights, inputs))[:4]:
            ref = x.double() @ w.double().t()
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            if not err < (1e-5 if w.dtype == torch.float32 else 1e-2):
                raise SystemExit(f"projections: {name} differs from float64 by {err:.2e} at {tuple(w.shape)}")


def timed_rounds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of one call of each, over ``repeats`` rounds run in alternation."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench projections", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rows", default="1,4,8,16,64,256", help="input row counts (comma-separated)")
    ap.add_argument("--layers", type=int, default=30, help="layers of weights per pass (default 30)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",") if r]
    if not rows_list or min(rows_list) < 1 or args.layers < 1 or args.repeats < 1:
        ap.error("--rows >= 1, --layers >= 1 and --repeats >= 1 are required")
    dtype = getattr(torch, args.dtype)
    if dtype == torch.float32 and cpu_gemm.panel() == 0:
        print("projections: the panel kernel is not built here (no C compiler, or PDSERVE_CPU_KERNELS=0)")
        return 0
    if dtype == torch.bfloat16 and not cpu_amx.available(torch.zeros(32, 32, dtype=dtype)):
        print("projections: the AMX kernel does not run here (no AMX-BF16, no C compiler, or PDSERVE_CPU_KERNELS=0)")
        return 0
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * k**-0.5).to(dtype) for _ in range(args.layers) for n, k in SHAPES]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    buf = torch.ones(nbytes // 4)
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "layers": args.layers, "weight_mb": nbytes >> 20,
                              "dtype": args.dtype, "panel": cpu_gemm.panel(), "rows": {}, "swiglu": {}}  # fmt: skip
    with torch.no_grad():
        for rows in rows_list:
            fns, inputs = paths(weights, rows, seed=rows)
            check(fns, weights, inputs)
            secs = timed_rounds({**fns, "read": lambda: buf.sum()}, args.repeats)
            result["rows"][str(rows)] = {
                name: {"ms": round(s * 1e3, 2), "gbps": round(nbytes / s / 1e9, 1)}
                | ({} if name == "read" else {"gflops": round(rows * flops_per_row / s / 1e9, 1)})
                for name, s in secs.items()
            }
            glu = timed_rounds(swiglu_paths(weights[2 :: len(SHAPES)], rows, seed=rows), args.repeats)
            result["swiglu"][str(rows)] = {name: round(s * 1e3, 3) for name, s in glu.items()}
    emit(result, args.json, report_rows(result))
    return 0


def report_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    out = [("weights", f"{result['layers']} layers, {result['weight_mb']} MiB {result.get('dtype', 'float32')}, "
                       f"{result['threads']} threads")]
    for rows, by in result["rows"].items():
        best_torch = min(v["ms"] for k, v in by.items() if k not in ("kernel", "read"))
        text = ", ".join(f"{k} {v['ms']} ms ({v['gbps']} GB/s" + (f", {v['gflops']} GFLOP/s)" if "gflops" in v else ")")
                         for k, v in by.items())
        if "kernel" in by:
            text += f"; kernel vs best torch path {best_torch / by['kernel']['ms']:.2f}x"
        out.append((f"{rows} rows", text))
    for rows, glu in result.get("swiglu", {}).items():
        out.append((f"{rows} rows SwiGLU", f"fused {glu['fused']} ms, product then silu_mul {glu['unfused']} ms "
                                           f"({glu['unfused'] / glu['fused']:.2f}x)"))  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
