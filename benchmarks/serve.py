"""Serving benchmark: open-loop load on the whole service, 1 prefill + 1 decode vs monolithic.

Workload (seeded, identical for every side): ``--num-requests`` requests arrive as a Poisson
process at ``--rate`` requests/s (open loop: each request is sent at its scheduled time,
whether or not earlier ones have answered). ``--tenants`` tenants each have a long shared
system prompt (200..400 tokens) and a ``cache_salt`` of their own; every request is its
tenant's system prompt plus a fresh question (30..80 tokens), greedy, ``max_tokens`` new
tokens with ``ignore_eos``. Prompts are byte token ids, sent as ``token_ids``.

Per request the client timestamps every streamed message: TTFT is send -> first message
with tokens, the inter-token latencies (ITL) are the gaps between successive messages
(a message carrying k tokens counts as k tokens of gap/k each), end-to-end is send -> last
message. Reported: TTFT / ITL / end-to-end p50 and p99, output tokens/s over the run's
wall time (first scheduled send -> last response), errors, the prefix hit rate from Redis
(the delta of the cluster counters over the measured run: prefix_hit_tokens / prompt_tokens)
and the same ratio from the responses' usage (cached_tokens / prompt_tokens).

Without ``--router`` the benchmark starts the service itself (local Ray, embedded Redis) on
a tiny but real Llama (``MODEL_KWARGS``: 4 layers, hidden 256, fp32 on CPU) twice, one
after the other, with the same workload:

- ``1P+1D``: one prefill and one decode worker, 1 CPU each; prompts whose uncached part is
  above ``--local-prefill-threshold`` (default 16) are prefilled by the prefill worker and
  their KV pulled by the decode worker.
- ``monolithic``: the same two actors with 2 CPUs each and a local-prefill threshold of
  10**9, so the decode worker prefills and decodes every request itself (the router's
  local-prefill path; the prefill worker stays idle). Checked: every response's usage
  must show ``transferred_tokens == 0`` and the prefill worker's Redis counters must show
  no request.

Each side: start, warm up with 2 requests (a salt of their own, so tenants start cold),
measure, read worker pool states (leak check), stop. Torch's thread count inside each
worker (Ray sets ``OMP_NUM_THREADS`` to the actor's ``num_cpus``) is probed and reported.

With ``--http`` the comparison is between the two edges instead: one ``1P+1D`` service, the
workload sent through the OpenAI-compatible HTTP API (streamed ``/v1/completions`` of the same
token ids, with vLLM's ``continuous_usage_stats`` so every chunk says how many tokens it carries)
and then through gRPC, each edge with tenants of its own so that both start cold.

With ``--router HOST:PORT [--redis-url URL]`` the same load runs once against a running
service (no comparison; the Redis hit rate is the delta over the run); add ``--http`` when
HOST:PORT is the service's HTTP API. Without ``--redis-url`` its Redis is found as ``pdserve
stats`` finds it: ``PDSERVE_REDIS_URL``, else the state file of the ``pdserve up`` on this
machine, if that ``up`` serves HOST:PORT.

Every run's tenant salts start with a fresh run id (``<run id>/tenant-<t>``, printed and in
the JSON), so a second run against the same service starts cold like the first; ``--run-id
ID`` fixes it (the same id twice: the second run is warm on purpose; ``--run-id ''``: bare
``tenant-<t>``).

``--api-key KEY`` (default ``PDSERVE_API_KEY``, as ``pdserve up`` and ``pdserve generate`` read it)
is sent with every request: ``Authorization: Bearer KEY`` over HTTP, the metadata ``authorization:
Bearer KEY`` over gRPC. A self-started service requires that key (the flag's, else the
environment's); with ``--router`` it is the running service's key.

Run: ``python -m benchmarks.serve [--quick] [--json]`` or ``pdserve bench serve``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

import grpc

from pdserve.benchmarks.serve_load import (
    BenchRequest,
    WorkloadConfig,
    log,
    make_workload,
    run_load,
    summarize,
    warm_up,
)
from pdserve.engine.sampling_params import SamplingParams

# The served model: small enough that a 2-core CPU box serves a few requests/s, real enough
# (4 Llama layers, GQA, fp32) that compute, not Python, is most of a step.
MODEL_KWARGS: dict[str, int] = {
    "seed": 0,
    "hidden_size": 256,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 704,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}
KV_CACHE_BYTES = 64 * 1024**2
DISAGG, MONO = "1P+1D", "monolithic"
HTTP, GRPC = "HTTP", "gRPC"



# ---------------------------------------------------------------------------------------
# Redis counters
# ---------------------------------------------------------------------------------------
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}


def _same_endpoint(a: str, b: str) -> bool:
    """Whether two HOST:PORT strings name the same endpoint (local host names are one host)."""
    (ha, _, pa), (hb, _, pb) = a.rpartition(":"), b.rpartition(":")
    ha, hb = ha.strip("[]"), hb.strip("[]")
    return pa == pb and (ha == hb or (ha in _LOCAL_HOSTS and hb in _LOCAL_HOSTS))


def router_redis(router: str, redis_url: str | None, namespace: str | None, http: bool = False,
                 state: dict | None = None) -> tuple[str | None, str]:  # fmt: skip
    """(Redis URL, namespace) of the service at ``router``, for the hit rate; URL None: unknown.

    ``--redis-url``/``--namespace``, else ``PDSERVE_REDIS_URL``, else the state file of the
    ``pdserve up`` on this machine (``state``; default: read it), which ``pdserve stats`` reads
    too, but only when that ``up`` serves ``router`` (its gRPC address, or its HTTP one with
    ``http``): another service's Redis would report another service's counters.
    """
    from pdserve.cli.state import index_config, read_state

    explicit = index_config(redis_url, namespace, state={})  # flags and environment only
    if explicit is not None:
        return explicit.url, explicit.namespace
    state = read_state() if state is None else state
    serves = (state or {}).get("http" if http else "router")
    if not serves:
        log("no --redis-url and no pdserve up on this machine: no Redis hit rate")
        return None, namespace or "pdserve"
    if not _same_endpoint(serves, router):
        log(f"the pdserve up on this machine serves {serves}, not {router}: no Redis hit rate (pass --redis-url)")
        return None, namespace or "pdserve"
    cfg = index_config(None, namespace, state=state)
    assert cfg is not None
    log(f"Redis from the state file of pdserve up (pid {state.get('pid')}): {cfg.redacted_url}")
    return cfg.url, cfg.namespace


def _read_stats(redis_url: str, namespace: str) -> dict | None:
    from pdserve.kvindex.config import IndexConfig
    from pdserve.kvindex.stats import read_stats

    cfg = IndexConfig(redis_url, namespace=namespace)
    client = cfg.client()
    try:
        return read_stats(client, cfg)
    finally:
        client.close()


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def redis_delta(redis_url: str, namespace: str, before: dict, expect_requests: int, wait_s: float = 10.0) -> dict:
    """Cluster (and per-worker) counter deltas since ``before``, once the stats writers caught up.

    The router records each request's counters from a background thread, so this polls
    until the cluster ``requests`` delta reaches ``expect_requests`` (or ``wait_s`` passes).
    """
    deadline = time.monotonic() + wait_s
    while True:
        after = _read_stats(redis_url, namespace)
        assert after is not None
        cluster = _delta(after["cluster"], before["cluster"])
        if cluster.get("requests", 0) >= expect_requests or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    workers = {w: _delta(c, before["workers"].get(w, {})) for w, c in after["workers"].items()}
    prompt = cluster.get("prompt_tokens", 0)
    return {
        "cluster": cluster,
        "workers": workers,
        "hit_rate": cluster.get("prefix_hit_tokens", 0) / prompt if prompt else 0.0,
        "caught_up": cluster.get("requests", 0) >= expect_requests,
    }


# ---------------------------------------------------------------------------------------
# One measured run against a router
# ---------------------------------------------------------------------------------------
def measure(
    label: str, address: str, redis_url: str | None, namespace: str, workload: list[BenchRequest],
    params: SamplingParams, timeout_s: float, warmup: int, http: bool = False, salt_prefix: str = "",
    api_key: str | None = None,
) -> dict[str, Any]:
    """Warm up (under the salt ``<salt_prefix>bench-warmup-<label>``), snapshot Redis, run the load
    (gRPC, or the HTTP API at ``address``; every request with ``api_key`` when given), summarize,
    Redis delta."""
    if warmup:
        log(f"{label}: warm-up ({warmup} requests)")
        failed = warm_up(address, params, 64, warmup, f"{salt_prefix}bench-warmup-{label}", timeout_s, http,
                         api_key)  # fmt: skip
        if failed:
            log(f"{label}: warning: {failed} warm-up request(s) failed")
    before = None
    if redis_url:
        time.sleep(0.5)  # let the warm-up's counters land before the snapshot
        before = _read_stats(redis_url, namespace)
    load = os.getloadavg()[0]
    log(f"{label}: {len(workload)} requests over ~{workload[-1].arrival_s:.1f}s (1-min load avg {load:.2f})")
    records, wall = run_load(address, workload, params, timeout_s, label, http, api_key)
    result = summarize(records, wall)
    result["load_average_1min_before"] = load
    if redis_url and before is not None:
        result["redis"] = redis_delta(redis_url, namespace, before, result["completed"])
        result["redis_hit_rate"] = result["redis"]["hit_rate"]
    else:
        result["redis_hit_rate"] = None
    log(f"{label}: done in {wall:.1f}s: {result['completed']} ok, {result['errors']} errors, "
        f"TTFT p50 {_fmt(result['ttft_ms_p50'])} ms, ITL p50 {_fmt(result['itl_ms_p50'])} ms")
    return result


# ---------------------------------------------------------------------------------------
# Self-started services
# ---------------------------------------------------------------------------------------
def _probe_worker(worker: Any) -> dict[str, Any]:
    """Runs inside a worker actor (``__ray_call__``): its thread settings."""
    import os as _os

    import torch as _torch

    return {
        "pid": _os.getpid(),
        "OMP_NUM_THREADS": _os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": _torch.get_num_threads(),
        "torch_interop_threads": _torch.get_num_interop_threads(),
        "cpu_affinity": len(_os.sched_getaffinity(0)),
    }


def _worker_checks(service: Any) -> dict[str, Any]:
    """Thread probe and pool state of every worker of a self-started service."""
    import ray

    out: dict[str, Any] = {}
    for wid, h in {**service.prefill, **service.decode}.items():
        entry: dict[str, Any] = {}
        try:
            entry["threads"] = ray.get(h.__ray_call__.remote(_probe_worker), timeout=30)
        except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
            entry["threads"] = {"error": repr(e)}
        try:
            entry["pool"] = ray.get(h.pool_state.remote(), timeout=30)
        except Exception as e:  # noqa: BLE001
            entry["pool"] = {"error": repr(e)}
        out[wid] = entry
    return out


def _pool_states(service: Any, settle_s: float = 2.0) -> dict[str, Any]:
    """Pool states after the run; waits up to ``settle_s`` for requests and leases to drain."""
    import ray

    deadline = time.monotonic() + settle_s
    while True:
        states = {}
        for wid, h in {**service.prefill, **service.decode}.items():
            try:
                states[wid] = ray.get(h.pool_state.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001
                states[wid] = {"error": repr(e)}
        busy = any(s.get("requests", 0) or s.get("leases", 0) for s in states.values())
        if not busy or time.monotonic() > deadline:
            return states
        time.sleep(0.25)


def _child_processes() -> list[str]:
    """Descendant processes of this one, as ``name(pid)``."""
    try:
        import psutil
    except ImportError:
        return []
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            out.append(f"{p.name()}({p.pid})")
        except psutil.Error:
            pass
    return out


def run_service(
    label: str, model_dir: str, cpus_per_worker: float, threshold: int, workload: list[BenchRequest],
    params: SamplingParams, timeout_s: float, warmup: int, edges: bool = False, salt_prefix: str = "",
    api_key: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Start a 1 prefill + 1 decode service (requiring ``api_key`` when given, which every request
    then carries), measure it, check its workers, stop it. Returns ``{label: result}``; with
    ``edges``, ``{"HTTP": ..., "gRPC": ...}``: the workload through each edge of the same service,
    one after the other, each with tenants (cache salts) of its own so that both start cold."""
    from pdserve.cluster.config import ServiceConfig
    from pdserve.cluster.launcher import Service
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.kvindex.config import IndexConfig
    from pdserve.router.config import RouterConfig

    config = ServiceConfig(
        prefill=1, decode=1, cpus_per_worker=cpus_per_worker, port=0, http_port=0,
        engine=EngineConfig(model=model_dir, cache=CacheConfig(kv_cache_memory_bytes=KV_CACHE_BYTES)),
        index=IndexConfig(url=None), router=RouterConfig(local_prefill_threshold=threshold, api_key=api_key),
    )
    before_children = set(_child_processes())
    service = Service(config, progress=lambda m: log(f"{label}: {m}"))
    t_start = time.perf_counter()
    try:
        address, redis_url = service.start()
        log(f"{label}: router at {address} ({time.perf_counter() - t_start:.1f}s to start)")
        checks = _worker_checks(service)
        results: dict[str, dict[str, Any]] = {}
        sides = [(HTTP, True), (GRPC, False)] if edges else [(label, False)]
        for side, http in sides:
            where = service.http_address if http else address
            assert where is not None
            load = [dataclasses.replace(r, tenant=f"{side}-{r.tenant}") for r in workload] if edges else workload
            results[side] = measure(side, where, redis_url, config.index.namespace, load, params, timeout_s,
                                    warmup, http, salt_prefix, api_key)  # fmt: skip
        pools = _pool_states(service)
        for wid, pool in pools.items():
            checks[wid]["pool_after"] = pool
    finally:
        service.stop()
    time.sleep(1.0)
    left = sorted(set(_child_processes()) - before_children)
    if left:
        log(f"{label}: warning: processes still running after stop: {', '.join(left)}")
    for result in results.values():
        result["workers"] = checks
        result["processes_left_after_stop"] = left
        result["config"] = {"cpus_per_worker": cpus_per_worker, "local_prefill_threshold": threshold,
                            "kv_cache_memory_bytes": KV_CACHE_BYTES}
    return results


def check_assumptions(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Findings about the comparison's assumptions (empty: all held)."""
    notes = []
    mono = runs.get(MONO)
    if mono is not None:
        if mono["transferred_tokens"] or mono["requests_with_transfer"]:
            notes.append(f"monolithic: {mono['requests_with_transfer']} request(s) transferred KV "
                         f"({mono['transferred_tokens']} tokens): not all prefilled locally")
        pre = mono.get("redis", {}).get("workers", {}).get("prefill-0", {})
        if pre.get("requests", 0):
            notes.append(f"monolithic: the prefill worker served {pre['requests']} request(s)")
    dis = runs.get(DISAGG)
    if dis is not None and dis["completed"] and dis["requests_with_transfer"] < dis["completed"]:
        notes.append(f"{DISAGG}: only {dis['requests_with_transfer']} of {dis['completed']} requests "
                     "transferred KV (the rest were prefilled on the decode worker)")
    for label, run in runs.items():
        for wid, w in run.get("workers", {}).items():
            th = w.get("threads", {})
            want = run["config"]["cpus_per_worker"]
            if "torch_threads" in th and th["torch_threads"] != int(want):
                notes.append(f"{label}: {wid} runs {th['torch_threads']} torch threads "
                             f"(OMP_NUM_THREADS={th['OMP_NUM_THREADS']}), expected {int(want)} = num_cpus")
            pool = w.get("pool_after", {})
            if pool.get("requests") or pool.get("leases"):
                notes.append(f"{label}: {wid} still holds {pool.get('requests')} request(s) and "
                             f"{pool.get('leases')} lease(s) after the run")
        if run["errors"]:
            notes.append(f"{label}: {run['errors']} request(s) failed: {run['error_messages']}")
        red = run.get("redis")
        if red is not None and not red["caught_up"]:
            notes.append(f"{label}: Redis counted {red['cluster'].get('requests', 0)} requests, "
                         f"{run['completed']} completed")
        if run.get("processes_left_after_stop"):
            notes.append(f"{label}: processes left after stop: {run['processes_left_after_stop']}")
    return notes


# ---------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


TABLE: list[tuple[str, str, str]] = [
    # (label, key, format)
    ("TTFT p50 (ms)", "ttft_ms_p50", ".1f"),
    ("TTFT p99 (ms)", "ttft_ms_p99", ".1f"),
    ("ITL p50 (ms)", "itl_ms_p50", ".1f"),
    ("ITL p99 (ms)", "itl_ms_p99", ".1f"),
    ("end-to-end p50 (ms)", "e2e_ms_p50", ".0f"),
    ("end-to-end p99 (ms)", "e2e_ms_p99", ".0f"),
    ("output tokens/s", "output_tok_per_s", ".1f"),
    ("wall time (s)", "wall_s", ".1f"),
    ("completed", "completed", "d"),
    ("errors", "errors", "d"),
    ("prefix hit rate (Redis)", "redis_hit_rate", ".1%"),
    ("prefix hit rate (usage)", "usage_hit_rate", ".1%"),
    ("transferred tokens", "transferred_tokens", "d"),
    ("max in flight", "max_in_flight", "d"),
    ("max send lag (ms)", "max_send_lag_ms", ".1f"),
]


def format_table(runs: dict[str, dict[str, Any]]) -> str:
    """Rows: metrics; columns: each run, then the ratio of the first to the second."""
    labels = list(runs)
    header = ["metric", *labels] + ([f"ratio {labels[0]}/{labels[1]}"] if len(labels) == 2 else [])
    rows = [header]
    for name, key, spec in TABLE:
        vals = [runs[lab].get(key) for lab in labels]
        row = [name, *[_fmt(v, spec) for v in vals]]
        if len(labels) == 2:
            a, b = vals
            row.append(f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``pdserve bench serve``: run the load (twice, compared, unless ``--router``); table or JSON."""
    ap = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (12 requests)")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per run (default 40; 12 with --quick)")
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrival rate, requests/s (default 2)")
    ap.add_argument("--tenants", type=int, default=4, help="tenants, each a cache_salt and system prompt (default 4)")
    ap.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests before each measured run")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request deadline in seconds")
    ap.add_argument("--local-prefill-threshold", type=int, default=16,
                    help="the 1P+1D side's threshold (uncached prompt tokens prefilled on the decode worker)")
    ap.add_argument("--only", choices=["disagg", "mono"], default=None, help="run one side only")
    ap.add_argument("--http", action="store_true",
                    help="compare the edges instead: one 1P+1D service, the workload through the OpenAI-compatible "
                         "HTTP API and through gRPC; with --router, HOST:PORT is a running service's HTTP API")
    ap.add_argument("--router", default=None, help="HOST:PORT of a running service (no comparison)")
    ap.add_argument("--redis-url", default=None,
                    help="its Redis (for the hit rate; with --router; default $PDSERVE_REDIS_URL, else the state "
                         "file of the pdserve up on this machine when it serves --router)")
    ap.add_argument("--namespace", default=None,
                    help="its Redis namespace (with --router; default $PDSERVE_REDIS_NAMESPACE, the state file's, "
                         "or 'pdserve')")
    ap.add_argument("--run-id", default=None, metavar="ID",
                    help="prefix of the tenant salts (ID/tenant-N; default: a fresh id per run, so every run starts "
                         "cold; the same ID again reruns warm; '' for bare tenant-N)")
    ap.add_argument("--api-key", default=None, metavar="KEY",
                    help="sent with every request (HTTP 'Authorization: Bearer KEY', gRPC metadata 'authorization: "
                         "Bearer KEY'); a self-started service requires it (default $PDSERVE_API_KEY)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from pdserve import envs
    from pdserve.router.config import check_api_key

    api_key = args.api_key if args.api_key is not None else envs.api_key()
    try:
        check_api_key(api_key)
    except ValueError as e:
        ap.error(f"--api-key: {e}")
    if args.redis_url and not args.router:
        ap.error("--redis-url goes with --router (a self-started service has its own Redis)")

    wcfg = WorkloadConfig(
        num_requests=args.num_requests or (12 if args.quick else 40), rate=args.rate, tenants=args.tenants,
        system_len=(200, 400), question_len=(30, 80), max_tokens=args.max_tokens, seed=args.seed,
        **({} if args.run_id is None else {"run_id": args.run_id}),
    )
    salt_prefix = f"{wcfg.run_id}/" if wcfg.run_id else ""
    workload = make_workload(wcfg)
    params = SamplingParams(max_tokens=wcfg.max_tokens, temperature=0.0, ignore_eos=True)
    prompt_lens = [len(r.prompt) for r in workload]
    result: dict[str, Any] = {
        "workload": {**asdict(wcfg), "prompt_tokens": sum(prompt_lens),
                     "prompt_len_range": [min(prompt_lens), max(prompt_lens)],
                     "last_arrival_s": workload[-1].arrival_s},
        "quick": args.quick,
    }
    log(f"workload: {wcfg.num_requests} requests at {wcfg.rate} req/s (Poisson, seed {wcfg.seed}), "
        f"{wcfg.tenants} tenants, prompts {min(prompt_lens)}..{max(prompt_lens)} tokens, "
        f"{wcfg.max_tokens} new tokens each, run id {wcfg.run_id or '-'} (tenant salts {salt_prefix}tenant-N)")

    runs: dict[str, dict[str, Any]] = {}
    try:
        if args.router:
            result["router"] = args.router
            redis_url, namespace = router_redis(args.router, args.redis_url, args.namespace, args.http)
            runs[args.router] = measure(args.router, args.router, redis_url, namespace, workload,
                                        params, args.timeout, args.warmup, args.http, salt_prefix, api_key)
        else:
            from pdserve.engine.model import make_tiny_model

            result["model"] = dict(MODEL_KWARGS)
            with tempfile.TemporaryDirectory(prefix="pdserve-bench-serve-") as tmp:
                model_dir = str(make_tiny_model(tmp, **MODEL_KWARGS))
                sides = [(DISAGG, 1.0, args.local_prefill_threshold), (MONO, 2.0, 10**9)]
                if args.only or args.http:
                    sides = [s for s in sides if (s[0] == DISAGG) == (args.only != "mono")]
                for label, cpus, threshold in sides:
                    runs.update(run_service(label, model_dir, cpus, threshold, workload, params, args.timeout,
                                            args.warmup, edges=args.http, salt_prefix=salt_prefix, api_key=api_key))
    except (grpc.RpcError, RuntimeError) as e:
        print(f"pdserve bench serve: error: {e}", file=sys.stderr)
        return 1
    result["runs"] = runs
    result["findings"] = check_assumptions(runs)

    if args.json:
        import json

        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        if not args.router:
            m = MODEL_KWARGS
            print(f"model: llama {m['num_layers']}L h{m['hidden_size']} {m['num_heads']}q/{m['num_kv_heads']}kv "
                  f"heads ffn{m['intermediate_size']} vocab{m['vocab_size']}, fp32 CPU")
            if args.http:
                print(f"one {DISAGG} service (1 CPU per worker, local-prefill threshold "
                      f"{args.local_prefill_threshold}): the same workload through its {HTTP} API "
                      f"(streamed /v1/completions) and through {GRPC}, tenants renamed per edge so both start cold")
            else:
                print(f"{DISAGG}: 1 prefill + 1 decode worker, 1 CPU each, local-prefill threshold "
                      f"{args.local_prefill_threshold}; {MONO}: the decode worker prefills everything, 2 CPUs")
        w = result["workload"]
        print(f"workload: {w['num_requests']} requests, Poisson {w['rate']} req/s, {w['tenants']} tenants, "
              f"prompts {w['prompt_len_range'][0]}..{w['prompt_len_range'][1]} tokens, "
              f"{w['max_tokens']} new tokens, seed {w['seed']}, run id {w['run_id'] or '-'}")
        print()
        print(format_table(runs))
        for label, run in runs.items():
            for wid, wk in run.get("workers", {}).items():
                th = wk.get("threads", {})
                print(f"{label} {wid}: OMP_NUM_THREADS={th.get('OMP_NUM_THREADS')} "
                      f"torch threads={th.get('torch_threads')}")
        if result["findings"]:
            print("\nfindings:")
            for note in result["findings"]:
                print(f"  - {note}")
    return 0 if all(r["errors"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
