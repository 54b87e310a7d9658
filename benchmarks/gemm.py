"""GEMM benchmark: the CPU's matrix units at a model's projection shapes, and the engine in float32
against bfloat16.

1. Projections (``x @ W.T`` for the model's qkv, o, gate_up, down and LM-head shapes; SmolLM2-135M's
   by default: hidden 576, 9 q / 3 kv heads of 64, intermediate 1536, vocab 49152) at several row
   counts (1: one decode; 8, 32: decode batches; 256: a prefill chunk), four ways: torch's
   ``F.linear`` and the engine's own path (``engine/model/linear.py``: a ``Linear``, packed where
   oneDNN has kernels for the dtype, which picks its product per call as the engine does: float32
   through the panel kernel ``engine/kernels/cpu_gemm.c`` where it is built), each in
   float32 and bfloat16 (on a CPU without bfloat16 kernels the engine's bfloat16 path is unpacked). The
   four run interleaved, round after round; TFLOP/s from the median round (2 x rows x in x out
   flops per call). ``large`` is a 2048^3 GEMM (1024^3 with ``--quick``) through the engine's path:
   what the cores reach.
2. The engine: ``LLM.generate`` of ``--prompts`` prompts (16..128 random tokens, new ones each
   round, the same for both dtypes) x ``--max-tokens`` tokens, greedy, ignoring EOS, one engine
   per dtype, alternating, ``--repeats`` rounds: output tokens/s (median round) and the median
   step (the decode steps: a handful of steps prefill, the rest decode the whole batch). Then one
   more round per dtype under ``torch.profiler``: the share of operator time in the projections
   (oneDNN's linear ops, their conversions, ``aten::mm``/``addmm``), and from it the projections'
   TFLOP/s inside the engine. ``compute floor``: a decode step's products alone (every layer's
   projections and the LM head at the step's row count through the engine's path, one weight per
   shape, hot in cache as in part 1), timed beside every engine round (so that the machine's speed
   that hour falls on both); ``limit`` (floor / step) says how far the engine is from the matmul
   limit. ``weight reads``: every weight once at the memory speed measured after each round (a plain
   sum of a buffer far larger than the caches); ``K/V reads``: the bytes of K/V a decode step halfway
   through the run reads (every sequence's prompt and half its tokens, every layer, once) at that
   speed. A step reads at least both, so ``ceiling`` (floor / (weight reads + K/V reads)) is the
   highest ``limit`` any step of this workload can reach where its weights outgrow the caches, before
   any norm, sampling or host work (above 1: the memory does not bound it).

Run: ``python -m pdserve.benchmarks.gemm [--quick] [--json] [--model DIR|FILE.gguf] [--no-engine]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.benchmarks.common import emit, median_time
from pdserve.engine.cpu_features import cpu_bf16_units
from pdserve.engine.kernels import cpu_amx, cpu_gemm, labels
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.linear import Linear, onednn_supported
from pdserve.engine.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROWS = (1, 8, 32, 256)
FLOOR_CALLS = 7  # the step's products timed after each engine round, per dtype
LABELS = {"float32_f_linear": "fp32 F.linear", "float32_engine": "fp32 engine", "bfloat16_f_linear": "bf16 F.linear",
          "bfloat16_engine": "bf16 engine"}  # fmt: skip
# Operators that are the projections (self time): oneDNN's linear and its conversions, BLAS's mm.
PROJECTION_OPS = frozenset({"aten::mm", "aten::addmm", "aten::mkldnn_linear", "aten::to_mkldnn", "aten::to_dense",
                            "mkldnn::_linear_pointwise", cpu_gemm.PROFILER_LABEL,
                            cpu_amx.PROFILER_LABEL})  # fmt: skip


def log(msg: str) -> None:
    print(f"[bench gemm] {msg}", file=sys.stderr, flush=True)


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``name -> (in, out)`` of one layer's projections and the LM head (fused as the engine fuses them)."""
    h = config.hidden_size
    return {"qkv": (h, config.q_size + 2 * config.kv_size), "o": (config.q_size, h),
            "gate_up": (h, 2 * config.intermediate_size), "down": (config.intermediate_size, h),
            "lm_head": (h, config.vocab_size)}  # fmt: skip


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, round_s: float) -> dict[str, float]:
    """Median seconds per call of each function, timed in rounds that alternate between them (so load
    from elsewhere on a shared machine falls on all of them alike); each round of each runs about
    ``round_s`` seconds."""
    calls: dict[str, int] = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, int(round_s / max(time.perf_counter() - t0, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            times[name].append((time.perf_counter() - t0) / calls[name])
    return {name: statistics.median(ts) for name, ts in times.items()}


def packed_layer(weight: torch.Tensor) -> Linear:
    """A ``Linear`` over ``weight`` as the engine would build it: packed for oneDNN where oneDNN serves
    this dtype on this CPU (bfloat16 needs AVX512 kernels), else plain (``F.linear`` and its variants)."""
    layer = Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.requires_grad_(False)
    layer.weight.data = weight
    if onednn_supported(weight.dtype, weight.device):
        layer.pack()
    return layer


def gemm_table(shapes: dict[str, tuple[int, int]], rows: tuple[int, ...], repeats: int, round_s: float,
               large: int = 2048) -> list[dict[str, Any]]:  # fmt: skip
    """Part 1: TFLOP/s of each shape and row count, F.linear and the engine's path, in both dtypes;
    then a ``large``^3 GEMM, the engine's path only."""
    g = torch.Generator().manual_seed(0)
    out: list[dict[str, Any]] = []
    cases = [(name, k, n, r) for name, (k, n) in shapes.items() for r in rows] + [("large", large, large, large)]
    for name, k, n, r in cases:
        w32 = torch.randn(n, k, generator=g) * k**-0.5
        x32 = torch.randn(r, k, generator=g)
        fns: dict[str, Callable[[], object]] = {}
        with torch.no_grad():
            for dname, dtype in DTYPES.items():
                w, x = w32.to(dtype), x32.to(dtype)
                layer = packed_layer(w)
                fns[f"{dname}_f_linear"] = lambda x=x, w=w: F.linear(x, w)
                fns[f"{dname}_engine"] = lambda x=x, layer=layer: layer(x)
            if name == "large":  # the ceiling: the engine's path only
                fns = {key: fn for key, fn in fns.items() if key.endswith("_engine")}
            secs = interleaved_medians(fns, repeats, round_s)
        flops = 2 * r * k * n
        out.append({"shape": name, "in": k, "out": n, "rows": r,
                    "tflops": {key: float(f"{flops / s / 1e12:.4g}") for key, s in secs.items()}})  # fmt: skip
        log(f"{name} {k}x{n} rows {r}: " + ", ".join(f"{key} {v:.3f}" for key, v in out[-1]["tflops"].items()))
    return out


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low = min(1000, vocab // 2)  # clear of the special tokens at the start of most vocabularies
    return [[rng.randrange(low, vocab) for _ in range(rng.randint(16, 128))] for _ in range(n)]


def timed_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float]]:
    """Wall seconds of generating ``max_tokens`` for every prompt, and each engine step's seconds."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    steps: list[float] = []
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return time.perf_counter() - start, steps


def decode_profile(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """The share of operator self time in the projections over decode steps only (profiled once
    every prompt has its first token, for half of the remaining steps)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    started: set[str] = set()
    for p in prompts:
        engine.add_request(p, params)
    while len(started) < len(prompts):  # the prefill steps
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    n = max(1, (max_tokens - 1) // 2)
    with labels.labelled(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in PROJECTION_OPS)
    return matmul / total if total else 0.0


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes per second the cores read from memory: the median of summing a ``nbytes`` buffer (far
    larger than a core's caches, as a model's weights are)."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def step_products(config: ModelConfig, rows: int, dtype: torch.dtype) -> Callable[[], None]:
    """A decode step's products alone: each layer's projections ``num_hidden_layers`` times and the LM
    head once, ``rows`` rows, through the engine's path, one weight per shape."""
    g = torch.Generator().manual_seed(0)
    calls = []
    for name, (k, n) in projection_shapes(config).items():
        layer = packed_layer((torch.randn(n, k, generator=g) * k**-0.5).to(dtype))
        x = torch.randn(rows, k, generator=g).to(dtype)
        calls.append((layer, x, 1 if name == "lm_head" else config.num_hidden_layers))

    @torch.no_grad()
    def run() -> None:
        for layer, x, times in calls:
            for _ in range(times):
                layer(x)

    return run


def ms(seconds: float) -> float:
    """Milliseconds to 4 significant figures (a tiny model's floors are fractions of one)."""
    return float(f"{seconds * 1e3:.4g}")


def kv_read_bytes(llm: Any, prompts: list[list[int]], max_tokens: int) -> int:
    """Bytes of K/V a decode step halfway through ``max_tokens`` reads: each sequence's positions so far
    (its prompt and half its tokens) in every layer, once, at the engine's KV layout."""
    layout = llm.engine.kv_tensor.layout
    per_token = layout.block_nbytes // layout.block_size
    return per_token * sum(len(p) + max_tokens // 2 for p in prompts)


def engine_part(model: str, config: ModelConfig, num_prompts: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    """Part 2: one engine per dtype, alternating rounds; tokens/s, step times, the projections' share
    of a decode step, the floors a decode step's projections cannot go below, and the K/V it reads."""
    from pdserve.engine.llm import LLM

    llms = {d: LLM(model, dtype=d, max_model_len=1024, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
            for d in DTYPES}  # fmt: skip
    for llm in llms.values():  # warm-up: oneDNN compiles its kernels for the shapes seen
        timed_generate(llm, make_prompts(num_prompts, config.vocab_size, seed=99), 4)
    products = {d: step_products(config, num_prompts, dtype) for d, dtype in DTYPES.items()}
    floors: dict[str, list[float]] = {d: [] for d in DTYPES}
    bandwidths: list[float] = []
    walls: dict[str, list[float]] = {d: [] for d in DTYPES}
    firsts: dict[str, list[float]] = {d: [] for d in DTYPES}
    steps: dict[str, list[float]] = {d: [] for d in DTYPES}
    rounds = [make_prompts(num_prompts, config.vocab_size, seed=r) for r in range(repeats)]
    for r, prompts in enumerate(rounds):
        for d, llm in llms.items():
            wall, st = timed_generate(llm, prompts, max_tokens)
            walls[d].append(wall)
            firsts[d].append(st[0])
            steps[d].extend(st)
            products[d]()  # untimed: the weights back in cache after the engine's round
            floors[d].append(median_time(products[d], FLOOR_CALLS))
            tok_s = num_prompts * max_tokens / wall
            log(f"{d}: round {r + 1}/{repeats}: {tok_s:.1f} output tok/s, products alone {floors[d][-1] * 1e3:.2f} ms")
        bandwidths.append(read_bandwidth())
    bandwidth = statistics.median(bandwidths)
    shapes = projection_shapes(config)
    weights = config.num_hidden_layers * sum(k * n for name, (k, n) in shapes.items() if name != "lm_head")
    weights += config.hidden_size * config.vocab_size  # the LM head
    step_flops = 2 * num_prompts * weights
    out: dict[str, Any] = {"prompts": num_prompts, "max_tokens": max_tokens, "repeats": repeats,
                           "prefill_tokens": sum(len(p) for p in make_prompts(num_prompts, config.vocab_size, 0)),
                           "decode_step_gflop": round(step_flops / 1e9, 3),
                           "read_gb_per_s": round(bandwidth / 1e9, 2)}  # fmt: skip
    for d, llm in llms.items():
        share = decode_profile(llm, make_prompts(num_prompts, config.vocab_size, seed=1000), max_tokens)
        step_s = statistics.median(steps[d])
        projection_s = share * step_s
        compute = statistics.median(floors[d])
        streaming = weights * DTYPES[d].itemsize / bandwidth  # every weight read once per decode step
        kv_bytes = round(statistics.mean(kv_read_bytes(llm, p, max_tokens) for p in rounds))
        kv_s = kv_bytes / bandwidth
        out[d] = {
            "output_tok_per_s": round(num_prompts * max_tokens / statistics.median(walls[d]), 1),
            "first_step_ms": round(statistics.median(firsts[d]) * 1e3, 1),
            "median_step_ms": ms(step_s),
            "projection_share": round(share, 3),
            "projection_ms": round(projection_s * 1e3, 2),
            "projection_tflops_in_engine": float(f"{step_flops / projection_s / 1e12:.4g}") if share else None,
            "compute_floor_ms": ms(compute),
            "weight_read_floor_ms": ms(streaming),
            "kv_read_bytes": kv_bytes,
            "kv_read_floor_ms": ms(kv_s),
            "limit": round(compute / step_s, 3),
            "ceiling": round(compute / (streaming + kv_s), 3),
            "onednn": llm.engine.onednn,
        }
    fp32, bf16 = out["float32"], out["bfloat16"]
    out["bf16_over_fp32"] = {"output_tok_per_s": round(bf16["output_tok_per_s"] / fp32["output_tok_per_s"], 2),
                             "first_step": round(fp32["first_step_ms"] / bf16["first_step_ms"], 2),
                             "median_step": round(fp32["median_step_ms"] / bf16["median_step_ms"], 2)}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts of part 1 (comma-separated)")
    ap.add_argument("--repeats", type=int, default=7, help="rounds of part 1 (part 2: --engine-repeats)")
    ap.add_argument("--engine-repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-engine", action="store_true", help="part 1 only")
    ap.add_argument("--quick", action="store_true", help="3 rounds, rows 1 and 32, large 1024, 4 prompts x 8 tokens")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from pdserve.cli.demo import demo_model

        args.model = demo_model()
    rows = (1, 32) if args.quick else tuple(int(r) for r in args.rows.split(","))
    repeats, round_s = (3, 0.005) if args.quick else (args.repeats, 0.05)
    config = ModelConfig.from_path(args.model)
    units = cpu_bf16_units()
    result: dict[str, Any] = {"model": args.model, "threads": torch.get_num_threads(), "cpu_bf16_units": list(units),
                              "gemm": gemm_table(projection_shapes(config), rows, repeats, round_s,
                                                 1024 if args.quick else 2048)}  # fmt: skip
    if not args.no_engine:
        prompts, max_tokens, engine_repeats = (4, 8, 1) if args.quick else (args.prompts, args.max_tokens,
                                                                            args.engine_repeats)  # fmt: skip
        result["engine"] = engine_part(args.model, config, prompts, max_tokens, engine_repeats)
    emit(result, args.json, report_rows(result))
    return 0


def report_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("cpu", f"{result['threads']} threads, bf16 units: {', '.join(result['cpu_bf16_units']) or 'none'}")]
    for t in result["gemm"]:
        v = t["tflops"]
        text = " | ".join(f"{LABELS[key]} {x:.3g}" for key, x in v.items())
        ratio = v["bfloat16_engine"] / v["float32_engine"]
        rows.append((f"{t['shape']} {t['in']}x{t['out']}, {t['rows']} rows",
                     f"{text} TFLOP/s (bf16/fp32 engine {ratio:.2g}x)"))
    eng = result.get("engine")
    if eng:
        rows.append(("engine workload", f"{eng['prompts']} prompts ({eng['prefill_tokens']} tokens) x "
                                        f"{eng['max_tokens']} tokens; a decode step's projections: "
                                        f"{eng['decode_step_gflop']} GFLOP; memory read {eng['read_gb_per_s']} GB/s"))
        for d in DTYPES:
            e = eng[d]
            rows.append((f"engine {d}", f"{e['output_tok_per_s']} output tok/s, first step {e['first_step_ms']} ms, "
                                       f"decode step {e['median_step_ms']} ms: projections "
                                       f"{e['projection_share']:.0%} = {e['projection_ms']} ms "
                                       f"({e['projection_tflops_in_engine']} TFLOP/s); floors: compute "
                                       f"{e['compute_floor_ms']} ms, weight reads {e['weight_read_floor_ms']} ms, "
                                       f"K/V reads {e['kv_read_floor_ms']} ms"))
            against = f"{e['limit']} (floor / step); ceiling {e['ceiling']} (floor / (weight + K/V reads))"
            rows.append((f"engine {d} vs matmul limit", against))
        r = eng["bf16_over_fp32"]
        rows.append(("engine bf16 / fp32", f"{r['output_tok_per_s']}x output tok/s, {r['first_step']}x first step, "
                                           f"{r['median_step']}x decode step"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
