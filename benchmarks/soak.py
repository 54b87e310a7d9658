"""``pdserve bench soak``: a long closed-loop run against 1P+1D, with clients that leave mid-stream.

It starts a service (local Ray, embedded Redis, the tiny model unless ``--model``), then
``--concurrency`` clients loop for ``--duration`` seconds over gRPC, HTTP (server-sent events)
or both (``--edge both``: every other client on each): each sends a unique prompt of one of four
tenants and reads the stream to its end, except a ``--cancel`` fraction that hang up after 0-10
events (over HTTP a third of those with a TCP reset). It reports requests by outcome (per edge
too), latency percentiles of the completed ones, the resident memory of every process of the
service (router, workers, Ray's GCS and raylet, Redis) at start, middle and end, and what the
pools still hold after the last request (blocks in use, leases, registered requests): the pools are
read until they hold nothing, for up to ``--settle-timeout`` seconds, and the bench reports how long
that took and exits 1 if something is still held then.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from pdserve.benchmarks.soak_clients import grpc_client, http_client
from pdserve.benchmarks.soak_memory import ProcessMemory

KV_CACHE_BYTES = 64 * 1024**2
TENANTS = 4
POLL_S = 0.1  # between two readings of the pools after the last request


def log(msg: str) -> None:
    print(f"[bench soak] {msg}", file=sys.stderr, flush=True)


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    s = sorted(xs)
    pick = lambda q: round(s[min(len(s) - 1, int(q * len(s)))], 1)  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


EDGES = ("grpc", "http", "both")
CLIENTS = {"grpc": grpc_client, "http": http_client}


def client_edges(edge: str, concurrency: int) -> list[str]:
    """The edge of each client: ``edge`` for all of them, or for ``both`` alternately gRPC and HTTP."""
    return [("grpc", "http")[cid % 2] if edge == "both" else edge for cid in range(concurrency)]


async def _run_clients(
    args: argparse.Namespace, where: dict[str, str], model_name: str, memory: ProcessMemory, api_key: str | None = None
) -> tuple[dict[str, Counter[str]], list[float], list[float]]:
    """``where``: the address of each edge. Outcomes by edge, then TTFT and end-to-end ms of the
    completed requests."""
    edges = client_edges(args.edge, args.concurrency)
    outcomes: dict[str, Counter[str]] = {e: Counter() for e in sorted(set(edges))}
    ttfts: list[float] = []
    e2es: list[float] = []
    deadline = time.monotonic() + args.duration
    sampled_middle = asyncio.Event()
    rng = random.Random(args.seed)
    run = f"{rng.getrandbits(32):08x}"  # tenants of this run: a re-run starts cold

    async def client(cid: int) -> None:
        n = 0
        edge = edges[cid]
        one = CLIENTS[edge]
        while time.monotonic() < deadline:
            n += 1
            text = f"{run} client {cid} request {n}: " + "".join(rng.choice("abcdefgh ijklmnop") for _ in range(
                rng.choice((50, 400, 1200))))  # fmt: skip
            leave_after = rng.randrange(0, 11) if rng.random() < args.cancel else None
            rst = leave_after is not None and rng.random() < 1 / 3
            result = await one(where[edge], model_name, text, f"soak-{run}-{n % TENANTS}",
                               rng.randrange(16, args.max_tokens + 1), leave_after, rst, args.timeout,
                               api_key)  # fmt: skip
            outcomes[edge][result.outcome] += 1
            if result.outcome == "completed":
                ttfts.append(result.ttft_ms)
                e2es.append(result.e2e_ms)
            if not sampled_middle.is_set() and time.monotonic() > deadline - args.duration / 2:
                sampled_middle.set()
                memory.sample("middle")

    async def progress() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(min(30.0, args.duration / 4))
            total = sum(outcomes.values(), Counter())
            log(f"{max(0, deadline - time.monotonic()):.0f}s left, {total.total()} requests: {dict(total)}")

    ticker = asyncio.create_task(progress())
    await asyncio.gather(*(client(i) for i in range(args.concurrency)))
    ticker.cancel()
    return outcomes, ttfts, e2es


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pathlib import Path

    from pdserve.cluster.config import ServiceConfig
    from pdserve.cluster.launcher import Service
    from pdserve.engine.model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(Path(tmp) / "tiny", seed=1))
        config = ServiceConfig.load(port=0, http_port=0, engine__model=model,
                                    engine__cache__kv_cache_memory_bytes=KV_CACHE_BYTES)  # fmt: skip
        service = Service(config, progress=lambda m: log(m))
        address, _ = service.start()
        try:
            assert service.http_address is not None
            where = {"grpc": address, "http": service.http_address}
            memory = ProcessMemory()
            memory.sample("start")
            over = {"grpc": "gRPC", "http": "HTTP", "both": "gRPC and HTTP"}[args.edge]
            log(f"{args.duration:.0f}s, {args.concurrency} clients over {over}, {args.cancel:.0%} leave mid-stream")
            t0 = time.perf_counter()
            # The service's router takes PDSERVE_API_KEY when it is set: its clients present that key.
            outcomes, ttfts, e2es = asyncio.run(_run_clients(args, where, Path(model).name, memory,
                                                             config.router.api_key))  # fmt: skip
            elapsed = time.perf_counter() - t0
            held, settled_s = _settle(service, args.settle_timeout)
            memory.sample("end")
        finally:
            service.stop()
    return {
        "duration_s": round(elapsed, 1), "concurrency": args.concurrency, "cancel": args.cancel,
        "edge": args.edge, "requests": dict(sum(outcomes.values(), Counter())),
        "requests_by_edge": {e: dict(c) for e, c in outcomes.items()},
        "ttft_ms": _percentiles(ttfts), "e2e_ms": _percentiles(e2es),
        "rss_mb": memory.table(),
        "held_at_end": held, "settled_s": settled_s,
    }


def _held(service: Any) -> dict[str, dict[str, int]]:
    """What each worker's pool holds now: blocks in use, leases, requests holding blocks, registered requests."""
    import ray

    pools = {wid: ray.get(h.pool_state.remote(), timeout=60) for wid, h in {**service.prefill, **service.decode}.items()}
    return {wid: {"blocks_in_use": p["num_blocks"] - p["free_blocks"], "leases": p["leases"],
                  "requests": p["requests"], "registered": p["registered"]} for wid, p in pools.items()}  # fmt: skip


def _settle(service: Any, timeout: float) -> tuple[dict[str, dict[str, int]], float | None]:
    """Read the pools until they hold nothing or ``timeout`` seconds pass: the last reading, and the
    seconds it took to hold nothing (None if something was still held at the end)."""
    t0 = time.monotonic()
    while True:
        held = _held(service)
        waited = time.monotonic() - t0
        if not any(any(v for v in h.values()) for h in held.values()):
            return held, round(waited, 2)
        if waited >= timeout:
            return held, None
        time.sleep(POLL_S)


def _print(result: dict[str, Any]) -> None:
    print(f"soak: {result['duration_s']}s, {result['concurrency']} clients over {result['edge']}, "
          f"{result['cancel']:.0%} cancelled mid-stream")  # fmt: skip
    print("requests by outcome:", ", ".join(f"{k} {v}" for k, v in sorted(result["requests"].items())))
    if len(result["requests_by_edge"]) > 1:
        for edge, counts in result["requests_by_edge"].items():
            print(f"  over {edge}:", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for name in ("ttft_ms", "e2e_ms"):
        print(f"{name} (completed):", ", ".join(f"{k} {v}" for k, v in result[name].items()))
    print(f"{'process':<22}{'start MB':>10}{'middle MB':>11}{'end MB':>9}")
    for proc, row in result["rss_mb"].items():
        print(f"{proc:<22}" + "".join(f"{row.get(k, '-')!s:>{w}}" for k, w in (("start", 10), ("middle", 11), ("end", 9))))
    settled = result["settled_s"]
    when = f"{settled} s after the last request" if settled is not None else "still held at the end"
    for wid, held in result["held_at_end"].items():
        print(f"{wid} {when}: {held['blocks_in_use']} blocks in use, {held['leases']} leases, "
              f"{held['requests']} requests holding blocks, {held['registered']} registered")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    ap.add_argument("--concurrency", type=int, default=4, help="clients, each one request at a time (default 4)")
    ap.add_argument("--cancel", type=float, default=0.15, help="fraction of streams left mid-way (default 0.15)")
    ap.add_argument("--edge", choices=EDGES, default="grpc",
                    help="the router's gRPC API, its OpenAI HTTP API, or both (every other client; default grpc)")
    ap.add_argument("--http", dest="edge", action="store_const", const="http", help="the same as --edge http")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request, at most (default 128)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the tiny model, made in a temp dir)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request deadline in seconds")
    ap.add_argument("--settle-timeout", type=float, default=10.0,
                    help="seconds after the last request for the pools to hold nothing (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if (not args.duration > 0 or args.concurrency < 1 or not 0 <= args.cancel <= 1 or args.max_tokens < 16
            or not args.settle_timeout >= 0):  # fmt: skip
        ap.error("--duration > 0, --concurrency >= 1, 0 <= --cancel <= 1, --max-tokens >= 16 and "
                 "--settle-timeout >= 0 are required")  # fmt: skip
    if args.edge == "both" and args.concurrency < 2:
        ap.error("--edge both needs --concurrency 2 or more (a client on each edge)")
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 1 if result["settled_s"] is None else 0

