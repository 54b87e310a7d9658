"""``pdserve stats``: prefix hit rates (ratios of sums) per cluster, worker and tenant, from Redis alone."""

from __future__ import annotations

import argparse
import json

import redis

from pdserve.cli.state import read_state
from pdserve.kvindex.config import IndexConfig
from pdserve.kvindex.stats import read_stats


def format_stats(stats: dict, tenant_names: dict[str, str] | None = None) -> str:
    """Human-readable lines; ``tenant_names`` maps salt digests to names the caller knows."""
    def line(name: str, c: dict) -> str:
        prompt = c.get("prompt_tokens", 0)
        rate = c.get("prefix_hit_tokens", 0) / prompt if prompt else 0.0
        return (
            f"{name:<24} requests={c.get('requests', 0):<6} prompt_tokens={prompt:<8} "
            f"prefix_hit_tokens={c.get('prefix_hit_tokens', 0):<8} hit_rate={rate:.1%} "
            f"transferred={c.get('transferred_tokens', 0)} recomputed={c.get('recomputed_tokens', 0)}"
        )

    rows = [line("cluster", stats["cluster"])]
    rows += [line(f"worker {w}", c) for w, c in sorted(stats["workers"].items())]
    names = tenant_names or {}
    rows += [line(f"tenant {names.get(t, t)}", c) for t, c in sorted(stats["tenants"].items())]
    return "\n".join(rows)


def run_stats(args: argparse.Namespace) -> int:
    # Flags override the environment (PDSERVE_REDIS_URL, PDSERVE_REDIS_NAMESPACE), as for `up`;
    # without either, the Redis of the `pdserve up` running on this machine (its state file).
    cfg = IndexConfig(**{k: v for k, v in (("url", args.redis_url), ("namespace", args.namespace)) if v is not None})
    if cfg.url is None:
        state = read_state()
        if state is None:
            raise ValueError("--redis-url is required (or set PDSERVE_REDIS_URL, or run pdserve up on this machine)")
        cfg = IndexConfig(state["redis_url"], namespace=args.namespace or state["namespace"])
    client = cfg.client()
    try:
        stats = read_stats(client, cfg)
    except redis.RedisError as e:
        raise ValueError(f"cannot read stats from {cfg.redacted_url}: {e}") from e
    print(json.dumps(stats, indent=2, sort_keys=True) if args.json else format_stats(stats))
    return 0
