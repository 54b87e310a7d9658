"""ServiceConfig: what ``pdserve up`` starts (from flags, a JSON/YAML-free config file, or both)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_type_hints

from engine import envs


@dataclass(frozen=True)
class ServiceConfig:
    """One pdserve deployment. File form: a JSON object with these field names."""

    model: str | None = None  # checkpoint dir; None: a tiny model written to a temp dir
    prefill: int = 1  # prefill workers
    decode: int = 1  # decode workers
    gpus_per_worker: float = 0.0  # Ray num_gpus of each worker (0 on CPU)
    cpus_per_worker: float = 1.0
    host: str = "127.0.0.1"  # router bind address (0.0.0.0 on a cluster)
    port: int = 50051
    redis_url: str | None = None  # None: embedded redis-server
    namespace: str = "pdserve"
    ray_address: str | None = None  # None: start a local Ray
    hash_seed: str = "0"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024**2
    dtype: str | None = None
    cpu_onednn: bool = True  # CPU float32 workers: projections of 8+ rows through oneDNN (2 weight copies)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    local_prefill_threshold: int = 32  # uncached prompt tokens at or below this are prefilled on the decode worker
    load_weight: float = 1.0  # routing: score = overlap_tokens - load_weight * queued_tokens
    lease_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), _FIELD_TYPES[f.name])
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"need at least 1 prefill and 1 decode worker, got {self.prefill} and {self.decode}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.gpus_per_worker < 0 or self.cpus_per_worker < 0:
            raise ValueError("gpus_per_worker and cpus_per_worker must be >= 0")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")
        if self.load_weight < 0:
            raise ValueError("load_weight must be >= 0")

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> ServiceConfig:
        """Defaults, then the file (if any), then non-None overrides (command-line flags)."""
        data: dict[str, Any] = {"hash_seed": envs.hash_seed(), "redis_url": envs.redis_url()}
        if path is not None:
            try:
                loaded = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read service config {path}: {e}") from e
            if not isinstance(loaded, dict):
                raise ValueError(f"service config {path} must be a JSON object, got {type(loaded).__name__}")
            known = {f.name for f in fields(cls)}
            unknown = set(loaded) - known
            if unknown:
                raise ValueError(f"unknown field(s) in {path}: {', '.join(sorted(unknown))}")
            data.update(loaded)
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)



_FIELD_TYPES = get_type_hints(ServiceConfig)
_JSON_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_type(name: str, value: Any, hint: Any) -> None:
    """ValueError unless ``value`` fits ``hint`` (``T`` or ``T | None`` of bool/int/float/str)."""
    allowed = getattr(hint, "__args__", (hint,))
    if value is None and type(None) in allowed:
        return
    for t in allowed:
        # bool is an int subclass in Python, but true is not a count and 1 is not a switch.
        if t is bool and isinstance(value, bool):
            return
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if t is str and isinstance(value, str):
            return
    want = " or ".join(_JSON_NAMES.get(t, "null") for t in allowed)
    raise ValueError(f"{name} must be {want}, got {value!r}")
