"""``pdserve stats``: prefix hit rates (ratios of sums) per cluster, worker and tenant, from Redis
alone: lifetime totals, and rates over recent windows next to them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import redis

from pdserve.cli.state import index_config
from pdserve.kvindex.config import IndexConfig, now_ms, tenant_digest
from pdserve.kvindex.stats import hit_rate, read_stats, read_window

DEFAULT_WINDOWS = (60, 300)


def tenant_names(pairs: list[str], files: list[str]) -> dict[str, str]:
    """Salt digest -> name, from ``NAME=SALT`` pairs (flags, or lines of files; blank lines and
    ``#`` comments skipped). Errors say where, never what: a line may hold a salt."""
    lines = [(f"--tenant #{i + 1}", p) for i, p in enumerate(pairs)]
    for f in files:
        try:
            text = Path(f).read_text()
        except OSError as e:
            raise ValueError(f"cannot read tenant file {f}: {e}") from e
        lines += [(f"{f} line {i + 1}", ln.strip()) for i, ln in enumerate(text.splitlines())
                  if ln.strip() and not ln.strip().startswith("#")]  # fmt: skip
    names: dict[str, str] = {}
    for where, line in lines:
        name, sep, salt = line.partition("=")
        if not sep or not name or not salt:
            raise ValueError(f"{where}: a tenant is NAME=SALT")
        names[tenant_digest(salt)] = name
    return names


def _line(name: str, c: dict) -> str:
    prompt = c.get("prompt_tokens", 0)
    return (
        f"{name:<24} requests={c.get('requests', 0):<6} prompt_tokens={prompt:<8} "
        f"prefix_hit_tokens={c.get('prefix_hit_tokens', 0):<8} hit_rate={hit_rate(c):.1%} "
        f"transferred={c.get('transferred_tokens', 0)} recomputed={c.get('recomputed_tokens', 0)}"
    )


def _rate_line(window: dict, c: dict) -> str:
    secs = window["seconds"]
    return (
        f"{'':<4}last {window['window']}s: {c.get('requests', 0) / secs:.2f} req/s, "
        f"{c.get('prompt_tokens', 0) / secs:.1f} prompt tok/s, hit_rate={hit_rate(c):.1%}, "
        f"{c.get('transferred_tokens', 0) / secs:.1f} transferred tok/s"
    )


def read_registry(client: redis.Redis, cfg: IndexConfig) -> dict[str, dict]:
    """Worker id -> role, node (the host of its KV-transfer address: which machine it runs on),
    address and heartbeat age in seconds, from the worker registry; malformed entries skipped."""
    out: dict[str, dict] = {}
    now = now_ms()
    for wid, raw in client.hgetall(cfg.workers_key).items():
        try:
            info = json.loads(raw)
            address = str(info["grpc_address"])
            age_s = round((now - int(info["heartbeat_ms"])) / 1000, 1)
        except (ValueError, TypeError, KeyError):
            continue
        wid = wid.decode() if isinstance(wid, bytes) else wid
        out[wid] = {"role": info.get("role"), "node": address.rsplit(":", 1)[0], "address": address,
                    "heartbeat_age_s": age_s}  # fmt: skip
    return out


def _worker_label(wid: str, registry: dict[str, dict]) -> str:
    r = registry.get(wid)
    return f"worker {wid}" if r is None else f"worker {wid} ({r['role']} on {r['node']})"


def format_stats(stats: dict, tenant_names: dict[str, str] | None = None) -> str:
    """Human-readable lines; ``tenant_names`` maps salt digests to names the caller knows. Each
    row's lifetime totals are followed by its rates over each window in ``stats["windows"]``."""
    names = tenant_names or {}
    windows = stats.get("windows", {})

    def rows(label: str, lifetime: dict, pick) -> list[str]:  # noqa: ANN001
        out = [_line(label, lifetime)]
        for w in windows.values():
            out.append(_rate_line(w, pick(w) or {}))
        return out

    registry = stats.get("registry", {})
    lines = rows("cluster", stats["cluster"], lambda w: w["cluster"])
    for wid, c in sorted(stats["workers"].items()):
        lines += rows(_worker_label(wid, registry), c, lambda w, wid=wid: w["workers"].get(wid))
    for t, c in sorted(stats["tenants"].items(), key=lambda kv: (kv[0] not in names, names.get(kv[0], kv[0]))):
        lines += rows(f"tenant {names.get(t, t)}", c, lambda w, t=t: w["tenants"].get(t))
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    # Flags override the environment (PDSERVE_REDIS_URL, PDSERVE_REDIS_NAMESPACE), as for `up`;
    # without either, the Redis of the `pdserve up` running on this machine (its state file).
    cfg = index_config(args.redis_url, args.namespace)
    if cfg is None:
        raise ValueError("--redis-url is required (or set PDSERVE_REDIS_URL, or run pdserve up on this machine)")
    names = tenant_names(args.tenant or [], args.tenant_file or [])
    windows = args.window or list(DEFAULT_WINDOWS)
    if any(not 1 <= w <= cfg.stats_retention_s for w in windows):
        raise ValueError(f"--window must be between 1 and {cfg.stats_retention_s} seconds (what Redis keeps)")
    client = cfg.client()
    try:
        stats = read_stats(client, cfg)
        stats["registry"] = read_registry(client, cfg)
        stats["windows"] = {}
        for w in windows:
            stats["windows"][str(w)] = {"window": w, **read_window(client, cfg, w)}
    except redis.RedisError as e:
        raise ValueError(f"cannot read stats from {cfg.redacted_url}: {e}") from e
    if names:
        stats["tenant_names"] = {d: n for d, n in names.items() if d in stats["tenants"]}
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_stats(stats, names))
    return 0
