"""Links benchmark: pull a prompt's KV or recompute it, on fast and slow links, for three KV policies.

A 3-node simulated cluster (``pdserve.cluster.simnet``, docs/simulated-cluster.md): the head runs an
external ``redis-server`` with a password and, per ``router.kv_policy``, one ``pdserve up --ray-address
... --config FILE`` as an operator would (``pdserve.cluster.simnet.service``): ``pull`` (always prefill on
the prefill worker and pull), ``recompute`` (the decode worker always prefills itself) and ``auto`` (the
router's cost model, router/cost_model.py). n1 offers ``prefill_node``, n2 ``decode_node``: each service's
prefill worker is on n1 and its decode worker on n2, so every pull crosses both links. The three services
run side by side (each its own Redis namespace and router port) and are measured in turn, one request at
a time over all of them, so that the machine's drift falls on all three alike. The link profiles
(``--profiles``, default ``fast``, ``slow``, ``thin``) are set on n1 and n2 in that order; the head keeps
``fast``. After each change the bench waits ``--settle-s`` (default ``SETTLE_S``, see there).

Workload: pairs of requests sharing a prefix of 64 or 768 tokens (alternating; fresh random byte tokens
each pair, the same on every service) plus a unique question of 8..24 tokens, greedy, ``--max-tokens``
new tokens with ``ignore_eos``.

- ``cold``, the first of a pair: the prefix is cached on the prefill worker and not on the decode worker,
  the state a fleet is in when a tenant's request lands on another decode worker than its last one. Made
  by prefilling the prefix on the prefill worker alone first (through Ray, one token, no decode worker)
  and waiting until Redis names it holder. Pulling moves the whole prompt's KV (the prefill worker
  computes only the question); recomputing computes the whole prompt on the decode worker.
- ``warm``, the second: the same prefix and another question. Both workers now hold the prefix (the
  decode worker cached what it pulled or computed); only the question is missing on the decode worker.

Per request the probe (a process in the head's namespace) timestamps the streamed tokens: TTFT is send ->
first token; TT2T (time to the second token) is send -> second token, the time until the decode worker
holds the prompt's KV plus one decode step: what the ``auto`` policy minimises. The path a request took is
read from its usage: ``transferred_tokens > 0`` is a pull. ``--warmup`` pairs per profile come first (their
summary is in the JSON, not in the table) so that ``auto`` has measured both paths on the current link.
Reported per policy x profile x kind: median TTFT and TT2T, mean TT2T, how many requests pulled; and
whether ``auto``'s median TT2T is within ``--tolerance`` of the better fixed policy's.

Needs root, ``ip netns`` and ``tc`` (and a ``redis-server``); without them it prints why and exits 0.

Run: ``pdserve bench links [--quick] [--json]`` (``python -m pdserve.benchmarks.links``).
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

POLICIES = ("pull", "recompute", "auto")
PROFILES = ("fast", "slow", "thin")
PREFIXES = (64, 768)
QUESTION = (8, 24)  # tokens; at most the router's default local_prefill_threshold (32)
BLOCK = 16
HASH_SEED = "links"
# After a link changes, wait out BBR's min-RTT filter (10 s): until then a TCP connection opened on the
# fast link keeps its sub-millisecond min RTT on the slow one, caps its window at a fraction of the
# path's bandwidth-delay product and slows down further with every transfer (seconds for 3 MiB).
SETTLE_S = 11.0
REDIS_PORT = 6380  # the head's 6379 is Ray's GCS
# A small Llama whose KV is heavy for its compute (MHA, small FFN: 4 KiB of float32 KV a token), so
# that a long prompt's pull beats recomputing it on a fast link and loses on a slow one on a CPU.
MODEL = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 256,
         "max_position_embeddings": 2048}  # fmt: skip


def log(msg: str) -> None:
    """Progress on stderr (stdout stays clean for ``--json``)."""
    print(f"[bench links] {msg}", file=sys.stderr, flush=True)


def kv_bytes_per_token() -> int:
    head_dim = MODEL["hidden_size"] // MODEL["num_heads"]
    return MODEL["num_layers"] * 2 * MODEL["num_kv_heads"] * head_dim * 4


def service_config(policy: str, index: int, head: str, model_dir: Path, redis_url: str) -> dict[str, Any]:
    return {
        "prefill": 1, "decode": 1, "host": head, "port": 50051 + index, "http_port": None,
        "prefill_resources": {"prefill_node": 1}, "decode_resources": {"decode_node": 1},
        "engine": {"model": str(model_dir),
                   "cache": {"block_size": BLOCK, "kv_cache_memory_bytes": 64 * 1024**2, "hash_seed": HASH_SEED}},
        "index": {"url": redis_url, "namespace": f"links-{policy}"},
        "router": {"kv_policy": policy, "drain_timeout_s": 5},
    }  # fmt: skip


def one_request(probe: Any, kind: str, prefix: list[int], question: list[int], max_tokens: int) -> dict[str, Any]:
    r = probe.generate(prefix + question, max_tokens)
    times, usage = r["token_times"], r["usage"]
    return {
        "kind": kind, "prefix_tokens": len(prefix), "prompt_tokens": len(prefix) + len(question),
        "completed": r["finish_reason"] == "length" and len(r["token_ids"]) == max_tokens,
        "ttft_ms": times[0] * 1000 if times else None, "t2_ms": times[1] * 1000 if len(times) > 1 else None,
        "e2e_ms": r["seconds"] * 1000, "transferred_tokens": usage.get("transferred_tokens", 0),
        "cached_tokens": usage.get("cached_tokens", 0), "pulled": usage.get("transferred_tokens", 0) > 0,
    }  # fmt: skip


def run_pairs(probes: dict[str, Any], rng: random.Random, pairs: int, max_tokens: int) -> dict[str, list]:
    """``pairs`` (cold, warm) request pairs on every service, interleaved (a pair on each service in
    turn, the order rotating) so that the machine's drift falls on all alike; the same prompts
    everywhere. Prefixes alternate over PREFIXES."""
    out: dict[str, list[dict[str, Any]]] = {p: [] for p in probes}
    order = list(probes)
    for i in range(pairs):
        prefix = [rng.randrange(256) for _ in range(PREFIXES[i % len(PREFIXES)])]
        questions = [[rng.randrange(256) for _ in range(rng.randint(*QUESTION))] for _ in range(2)]
        for policy in order[i % len(order):] + order[: i % len(order)]:
            probe = probes[policy]
            probe.call("prefill_only", worker="prefill-0", prompt=prefix, block_size=BLOCK, hash_seed=HASH_SEED)
            for kind, question in zip(("cold", "warm"), questions):
                out[policy].append(one_request(probe, kind, prefix, question, max_tokens))
    return out


def groups(requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    g: dict[str, list[dict[str, Any]]] = {f"cold_{n}": [] for n in PREFIXES} | {"warm": []}
    for r in requests:
        g["warm" if r["kind"] == "warm" else f"cold_{r['prefix_tokens']}"].append(r)
    return g


def summarise(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind: medians of TTFT and TT2T, the mean TT2T (what the occasional wrong path costs shows
    there), and how many requests pulled."""

    def stat(rs: list[dict[str, Any]], key: str, f: Any = statistics.median) -> float | None:
        xs = [r[key] for r in rs if r[key] is not None]
        return round(f(xs), 2) if xs else None

    return {
        name: {"n": len(rs), "ttft_ms": stat(rs, "ttft_ms"), "t2_ms": stat(rs, "t2_ms"),
               "mean_t2_ms": stat(rs, "t2_ms", statistics.fmean), "pulled": sum(r["pulled"] for r in rs)}  # fmt: skip
        for name, rs in groups(requests).items()
    }


def verdicts(results: dict[str, dict[str, Any]], profiles: list[str], tolerance: float) -> dict[str, dict[str, Any]]:
    """Per profile and kind: auto's median TT2T against the better fixed policy's."""
    out: dict[str, dict[str, Any]] = {}
    for profile in profiles:
        out[profile] = {}
        for kind in results["auto"][profile]["summary"]:
            t2 = {p: results[p][profile]["summary"][kind]["t2_ms"] for p in POLICIES}
            if None in t2.values():
                continue
            best = min(("pull", "recompute"), key=lambda p: t2[p])
            ratio = t2["auto"] / t2[best]
            out[profile][kind] = {"best_fixed": best, "best_fixed_t2_ms": t2[best], "auto_t2_ms": t2["auto"],
                                  "auto_over_best": round(ratio, 3), "auto_as_good": ratio <= 1 + tolerance}
    return out


def bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from pdserve.cluster.simnet import PROFILES as LINKS
    from pdserve.cluster.simnet import NodeSpec, SimCluster
    from pdserve.cluster.simnet.service import HeadRedis, PdserveUp, Probe
    from pdserve.engine.model import make_tiny_model
    from pdserve.kvindex.embedded import find_redis_server

    model_dir = make_tiny_model(tmp / "model", seed=0, **MODEL)
    rng = random.Random(args.seed)
    n = len(POLICIES)  # one worker of each role per service on n1 and n2
    nodes = [NodeSpec("head", cpus=1), NodeSpec("n1", cpus=n, resources={"prefill_node": n}),
             NodeSpec("n2", cpus=n, resources={"decode_node": n})]  # fmt: skip
    results: dict[str, dict[str, Any]] = {p: {} for p in POLICIES}
    ups: dict[str, Any] = {}
    probes: dict[str, Any] = {}
    t0 = time.monotonic()
    with SimCluster(nodes, "fast") as sim:
        redis = HeadRedis(sim, "head", tmp / "redis", find_redis_server(), port=REDIS_PORT)
        try:
            cc = sim.check_output("n2", ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]).strip()
            log(f"starting pdserve up with kv_policy {', '.join(POLICIES)}, side by side")
            for i, policy in enumerate(POLICIES):
                config = service_config(policy, i, sim.address("head"), model_dir, redis.url)
                secret = {"PDSERVE_CLUSTER_SECRET": secrets.token_hex(32)}
                ups[policy] = PdserveUp(sim, "head", config, tmp / f"up-{policy}", secret, wait=False)
            for policy, up in ups.items():
                up.wait_ready()
                probes[policy] = Probe(sim, "head", up.router, redis.url, namespace=f"links-{policy}")
            for profile in args.profiles:
                if sim.node("n1").profile.name != profile:
                    for node in ("n1", "n2"):
                        sim.set_profile(node, profile)
                    time.sleep(args.settle_s)
                log(f"{profile}: {args.warmup} warm-up pairs, then {args.pairs} measured, on each service")
                warmup = run_pairs(probes, rng, args.warmup, args.max_tokens)
                measured = run_pairs(probes, rng, args.pairs, args.max_tokens)
                for policy, requests in measured.items():
                    summary = summarise(requests)
                    results[policy][profile] = {"summary": summary, "requests": requests,
                                                "warmup_summary": summarise(warmup[policy])}  # fmt: skip
                    log(f"{profile} {policy}: " + ", ".join(
                        f"{k} TTFT {s['ttft_ms']} TT2T {s['t2_ms']} ms, pulled {s['pulled']}/{s['n']}"
                        for k, s in summary.items()))  # fmt: skip
            for policy, up in ups.items():
                if not up.alive():
                    raise RuntimeError(f"pdserve up ({policy}) exited: {up.stderr()}")
        finally:
            for probe in probes.values():
                probe.close()
            PdserveUp.stop_all(list(ups.values()))
            redis.stop()
    every = [r for p in results.values() for prof in p.values() for r in prof["requests"]]
    return {
        "model": MODEL | {"kv_bytes_per_token": kv_bytes_per_token(), "dtype": "float32", "device": "cpu"},
        "workload": {"prefix_tokens": list(PREFIXES), "question_tokens": list(QUESTION), "block_size": BLOCK,
                     "max_tokens": args.max_tokens, "warmup_pairs": args.warmup, "pairs": args.pairs,
                     "seed": args.seed},  # fmt: skip
        "links": {p: {"rate_bps": LINKS[p].rate_bps, "delay_ms": LINKS[p].delay_ms} for p in args.profiles},
        "profiles": args.profiles,
        "tcp_congestion_control": cc,
        "results": results,
        "verdict": verdicts(results, args.profiles, args.tolerance),
        "tolerance": args.tolerance,
        "requests": len(every),
        "completed": sum(r["completed"] for r in every),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def table(r: dict[str, Any]) -> str:
    kinds = [f"cold_{n}" for n in PREFIXES] + ["warm"]
    heads = {f"cold_{n}": f"{n}-token prefix, cold" for n in PREFIXES} | {"warm": "warm (prefix on both)"}
    lines = ["| link | policy | " + " | ".join(f"{heads[k]}: TTFT / TT2T ms (pulled)" for k in kinds) + " |",
             "| --- | --- |" + " --- |" * len(kinds)]  # fmt: skip
    for profile in r["profiles"]:
        for policy in POLICIES:
            s = r["results"][policy][profile]["summary"]
            cells = [f"{s[k]['ttft_ms']:.0f} / {s[k]['t2_ms']:.0f} ({s[k]['pulled']}/{s[k]['n']})" for k in kinds]
            lines.append(f"| {profile} | {policy} | " + " | ".join(cells) + " |")
    lines.append("")
    for profile, kinds_v in r["verdict"].items():
        parts = [f"{k}: auto {v['auto_t2_ms']:.0f} ms vs {v['best_fixed']} {v['best_fixed_t2_ms']:.0f} ms "
                 f"({'as good' if v['auto_as_good'] else 'WORSE'})" for k, v in kinds_v.items()]  # fmt: skip
        lines.append(f"{profile}: " + "; ".join(parts))
    lines.append(f"{r['completed']}/{r['requests']} measured requests completed; {r['wall_s']:.0f} s "
                 f"(as good: median TT2T within {r['tolerance']:.0%} of the better fixed policy's)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``pdserve bench links``: a table (or JSON with ``--json``); exit 0 with the reason where it cannot run."""
    ap = argparse.ArgumentParser(prog="pdserve bench links", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="fewer pairs (a smoke run, under ~3 minutes)")
    ap.add_argument("--pairs", type=int, default=None, help="measured (cold, warm) pairs per profile (default 32; 3)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up pairs per profile (default 32; 6)")
    ap.add_argument("--profiles", default=",".join(PROFILES), help="link profiles of n1 and n2, in this order")
    ap.add_argument("--settle-s", type=float, default=SETTLE_S,
                    help=f"seconds to wait after a link change (default {SETTLE_S:g}, see SETTLE_S; 0 in a smoke run)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--tolerance", type=float, default=0.10, help="auto 'as good' within this fraction")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    args.pairs = args.pairs or (3 if args.quick else 32)
    args.warmup = args.warmup if args.warmup is not None else (6 if args.quick else 32)
    args.profiles = [p for p in args.profiles.split(",") if p]
    from pdserve.cluster.simnet import PROFILES as LINKS

    if not args.profiles or set(args.profiles) - set(LINKS):
        ap.error(f"--profiles: a comma-separated list of {', '.join(LINKS)}")
    if args.max_tokens < 2:
        ap.error("--max-tokens must be >= 2 (the second token is measured)")

    from pdserve.cluster.simnet import simnet_available
    from pdserve.kvindex.embedded import find_redis_server

    reason = simnet_available()
    if reason is None:
        try:
            find_redis_server()
        except RuntimeError as exc:
            reason = str(exc)
    if reason is not None:
        print(f"pdserve bench links: cannot run here: {reason}", file=sys.stderr)
        if args.json:
            print(json.dumps({"skipped": reason}))
        return 0
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-links-") as tmp:
        Path(tmp).chmod(0o700)
        result = bench(args, Path(tmp))
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
