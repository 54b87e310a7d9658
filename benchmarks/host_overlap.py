"""Whether a CPU worker would gain from running its host work beside the model's forward.

Async scheduling (vLLM's) schedules step N+1 and handles step N's outputs while step N's forward runs
on the GPU, so the host work leaves the step's critical path. On the CPU the forward runs on the same
cores and in the same process as that host work. This measures what the overlap would cost there.

The engine decodes ``bench steps``' workload (``--prompts`` prompts sharing a 221-token prefix,
``--max-tokens`` greedy tokens each), round after round. In every other round a helper runs a fixed
amount of pure-Python work each time a forward starts. The amount is calibrated, alone, to take ``W``
ms: the engine's own host work per decode step (scheduling, input build, sampling, outputs: the step
less its forward and LM head), measured in the first (plain) round. ``--work-ms`` sets ``W`` instead.
The helper is a thread of the engine's process (``--helper thread``, the default): it holds the GIL
as a scheduler's code would. Or it is a process of its own (``--helper process``, as vLLM's engine
core and front end are): it takes only CPU time from the forward.

Reported: the median decode step without and with the helper (medians over each side's rounds), how
long the helper's work took beside the forward, and what the overlap saves per step: ``W`` (what the
same work adds run in turn) less how much longer the step got. Negative: it costs.

Run: ``python -m pdserve.benchmarks.host_overlap [--model DIR|FILE.gguf] [--dtype bfloat16]
[--helper thread|process] [--json]``.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.benchmarks.common import emit
from pdserve.benchmarks.peers import workload
from pdserve.benchmarks.steps import prefill_all, smollm2
from pdserve.engine.sampling_params import SamplingParams


def spin(iterations: int) -> None:
    """Pure-Python work: bytecode that holds the GIL throughout, as a scheduler's loops do."""
    x = 0
    for i in range(iterations):
        x += i


def calibrate(ms: float) -> int:
    """Iterations of :func:`spin` that take ``ms`` milliseconds on this thread alone (median of 5)."""
    n = 100_000
    t0 = time.perf_counter()
    spin(n)
    per = (time.perf_counter() - t0) / n
    n = max(1, round(ms / 1e3 / per))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        spin(n)
        times.append(time.perf_counter() - t0)
    return max(1, round(n * ms / 1e3 / statistics.median(times)))


class ThreadHelper:
    """A thread of this process that runs :func:`spin` for the iterations :meth:`set_work` calibrated,
    once per :meth:`kick` (kicks that come while it runs are taken by one run after it); ``took`` holds
    each run's time, in seconds. :meth:`close` ends it."""

    def __init__(self) -> None:
        self.iterations = 0
        self.took: list[float] = []
        self._go = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="host-overlap-helper", daemon=True)
        self._thread.start()

    def set_work(self, ms: float) -> None:
        self.iterations = calibrate(ms)

    def kick(self) -> None:
        self._go.set()

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._closed:
                return
            t0 = time.perf_counter()
            spin(self.iterations)
            self.took.append(time.perf_counter() - t0)

    def close(self) -> None:
        self._closed = True
        self._go.set()
        self._thread.join()


class ProcessHelper:
    """The same work in a process of its own: it takes no GIL from the forward, only CPU time. The
    interface of :class:`ThreadHelper`; ``took`` is filled by :meth:`close`."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no copy of this process's OpenMP and Ray threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), name="host-overlap-helper", daemon=True)
        self._proc.start()
        self.took: list[float] = []

    def set_work(self, ms: float) -> None:
        self._conn.send(("work", ms))
        self._conn.recv()  # calibrated

    def kick(self) -> None:
        self._conn.send(("kick", None))

    def close(self) -> None:
        self._conn.send(("close", None))
        self.took = self._conn.recv()
        self._proc.join()


def _serve(conn: Any) -> None:
    """:class:`ProcessHelper`'s process: calibrates on ``work``, runs on ``kick`` (the kicks waiting
    taken by one run, as the thread does), answers ``close`` with the runs' times."""
    iterations, took = 0, []
    while True:
        kind, arg = conn.recv()
        while kind == "kick" and conn.poll():
            kind, arg = conn.recv()
        if kind == "work":
            iterations = calibrate(arg)
            conn.send(iterations)
        elif kind == "kick":
            t0 = time.perf_counter()
            spin(iterations)
            took.append(time.perf_counter() - t0)
        else:
            conn.send(took)
            return


Helper = ThreadHelper | ProcessHelper


def hook(engine: Any, helper: Helper, on: list[bool], device_ms: list[float]) -> None:
    """Wrap this engine's forward (kicks the helper while ``on[0]``) and both model calls (their wall
    times go to ``device_ms``: what is not host work)."""
    model = engine.runner.model

    def wrap(fn: Callable[..., Any], kicks: bool) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if kicks and on[0]:
                helper.kick()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                device_ms.append((time.perf_counter() - t0) * 1e3)

        return wrapper

    model.forward = wrap(model.forward, True)
    model.compute_logits = wrap(model.compute_logits, False)


def decode_round(engine: Any, prompts: list[list[int]], max_tokens: int, device_ms: list[float], on: list[bool],
                 kick: bool) -> list[float]:  # fmt: skip
    """The decode steps' wall times (ms) of one round, the helper kicked at each of their forwards
    where ``kick`` (not at the prefill's); ``device_ms`` is cleared after the prefill, so it then holds
    the decode steps' model calls."""
    prefill_all(engine, prompts, max_tokens)
    device_ms.clear()
    steps = []
    on[0] = kick
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t0) * 1e3)
    finally:
        on[0] = False
    return steps


def run(engine: Any, prompts: list[list[int]], max_tokens: int, rounds: int, work_ms: float | None,
        where: str) -> dict[str, Any]:  # fmt: skip
    """``rounds`` rounds each way, alternating (plain first), with a helper on a ``thread`` or in a
    ``process``, which this call starts and ends."""
    on: list[bool] = [False]
    device_ms: list[float] = []
    helper: Helper = ThreadHelper() if where == "thread" else ProcessHelper()
    plain: list[float] = []
    beside: list[float] = []
    kicks = 0
    try:
        hook(engine, helper, on, device_ms)
        for r in range(2 * rounds):
            helper_round = r % 2 == 1
            steps = decode_round(engine, prompts, max_tokens, device_ms, on, helper_round)
            if r == 0:
                host = (sum(steps) - sum(device_ms)) / len(steps)
                work_ms = host if work_ms is None else work_ms
                helper.set_work(work_ms)
            (beside if helper_round else plain).append(statistics.median(steps))
            kicks += len(steps) if helper_round else 0
    finally:
        helper.close()
    without, with_helper = statistics.median(plain), statistics.median(beside)
    return {"host_work_ms": round(host, 3), "helper_work_ms": round(work_ms, 3),
            "helper_took_ms": round(statistics.median(helper.took) * 1e3, 3) if helper.took else None,
            "helper_runs": len(helper.took), "helper_rounds_steps": kicks,
            "step_ms_without": round(without, 2), "step_ms_with": round(with_helper, 2),
            "step_longer_by_ms": round(with_helper - without, 2),
            "overlap_saves_ms": round(work_ms - (with_helper - without), 2),
            "rounds_ms": {"without": [round(x, 2) for x in plain], "with": [round(x, 2) for x in beside]}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from pdserve import LLM
    from pdserve.engine.model import ModelConfig

    ap = argparse.ArgumentParser(prog="pdserve bench host-overlap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3, help="rounds with the helper (and as many without)")
    ap.add_argument("--work-ms", type=float, default=None,
                    help="the helper's work per step (default: the engine's host work per step, measured)")
    ap.add_argument("--helper", choices=("thread", "process"), default="thread",
                    help="the work on a thread of the engine's process (as a scheduler's) or in a process of its own")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 8 tokens, 1 round each way")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.rounds = 4, 8, 1
    if min(args.prompts, args.rounds) < 1 or args.max_tokens < 2 or (args.work_ms is not None and args.work_ms <= 0):
        print("host-overlap: --prompts and --rounds must be positive, --max-tokens at least 2 (a decode step) and "
              "--work-ms above 0", file=sys.stderr)  # fmt: skip
        return 2
    model = args.model or smollm2()
    prompts = workload(ModelConfig.from_path(model).vocab_size, args.prompts)
    longest = max(len(p) for p in prompts) + args.max_tokens
    llm = LLM(model, dtype=args.dtype, num_blocks=(len(prompts) + 1) * (-(-longest // 16)) + 16)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: kernels, prefix
        result = run(llm.engine, prompts, args.max_tokens, args.rounds, args.work_ms, args.helper)
    finally:
        llm.close()
    result.update({"model": model, "dtype": args.dtype, "batch": args.prompts, "helper": args.helper})
    emit(result, args.json, report_rows(result))
    return 0


def report_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    w, d = result["helper_work_ms"], result["step_longer_by_ms"]
    return [("model", f"{result['model']} ({result['dtype']}, {result['batch']} sequences)"),
            ("host work per decode step (measured)", f"{result['host_work_ms']:.2f} ms"),
            ("decode step, median", f"{result['step_ms_without']:.2f} ms"),
            (f"  with {w:.2f} ms of Python beside each forward ({result['helper']})",
             f"{result['step_ms_with']:.2f} ms (the work took {result['helper_took_ms']} ms beside it)"),
            ("  step longer by", f"{d:+.2f} ms, against {w:.2f} ms for the work in turn"),
            ("overlap saves per step", f"{result['overlap_saves_ms']:+.2f} ms (negative: it costs)")]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
