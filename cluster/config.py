"""ServiceConfig: what ``pdserve up`` starts, composed of the components' own configs.

The file form (``--config FILE``) is a JSON object with the same nesting::

    {"prefill": 2, "decode": 2, "host": "0.0.0.0",
     "engine": {"model": "/models/llama", "dtype": "bfloat16", "cache": {"block_size": 16}},
     "index": {"url": "redis://10.0.0.1:6379/0"},
     "transfer": {"lease_ttl_s": 30},
     "router": {"local_prefill_threshold": 32}}

Every field has one definition, in its component's config class (``EngineConfig``,
``IndexConfig``, ``TransferConfig``, ``RouterConfig``); unknown names and wrong JSON types are
errors that name the field's path. Precedence: defaults (environment variables among them,
``pdserve.envs``), then the file, then command-line flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from pdserve.engine.config import EngineConfig
from pdserve.kvindex.config import IndexConfig
from pdserve.kvtransfer.config import TransferConfig
from pdserve.router.config import RouterConfig

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class ServiceConfig:
    """One pdserve deployment: how many workers, where the router listens, and each component's config."""

    prefill: int = 1  # prefill workers
    decode: int = 1  # decode workers
    gpus_per_worker: float = 0.0  # Ray num_gpus of each worker (0 on CPU)
    cpus_per_worker: float = 1.0  # Ray num_cpus of each worker, per tensor-parallel rank
    # Per role (None: cpus_per_worker). Ray sets a worker's OMP_NUM_THREADS, so its torch threads, to
    # its num_cpus: a decode worker given more than its share of a small machine's cores takes the
    # cores its prefill peer leaves idle between prompts.
    prefill_cpus_per_worker: float | None = None
    decode_cpus_per_worker: float | None = None
    # CPU workers of one host lend each other the cores they leave idle: a step runs torch on its
    # worker's own CPUs plus those of the host's idle workers (worker/core_share.py).
    share_idle_cpus: bool = True
    # With sharing: how long a worker that turns busy waits for a peer's step on its cores to end
    # (0: start at once, two thread teams sharing those cores for the rest of that step).
    core_reclaim_wait_s: float = 0.25
    # Tensor parallelism per role (vLLM's tensor_parallel_size, on each side); None: the engine's
    # ``parallel.tensor_parallel_size``. A worker of size N asks Ray for N * ``cpus_per_rank(role)`` CPUs.
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    # Placement: Ray custom resources each prefill / decode worker asks for (a node offers them
    # with `ray start --resources '{"prefill_node": 4}'`); empty: anywhere that has the CPUs/GPUs.
    prefill_resources: dict[str, float] = field(default_factory=dict)
    decode_resources: dict[str, float] = field(default_factory=dict)
    host: str = "127.0.0.1"  # router bind address (0.0.0.0 on a cluster)
    port: int = 50051
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API; None: not served
    # Prometheus /metrics on a port of its own; None: on the HTTP API's port (none without it).
    metrics_port: int | None = None
    ray_address: str | None = None  # None: start a local Ray
    log_level: str = "INFO"  # every process's (the driver, the router and the workers)
    log_json: bool = False  # one JSON object per log line (Ray's JSON encoding, with its context fields)
    # engine.model None: a tiny model written to a temp dir; index.url None: an embedded redis-server.
    engine: EngineConfig = field(default_factory=EngineConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), get_type_hints(type(self))[f.name])
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"need at least 1 prefill and 1 decode worker, got {self.prefill} and {self.decode}")
        for name in ("port", "http_port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        ports = [p for p in (self.port, self.http_port, self.metrics_port) if p]  # 0: any free port
        if len(set(ports)) < len(ports):
            raise ValueError(f"port, http_port and metrics_port must differ, got {self.port}, {self.http_port} "
                             f"and {self.metrics_port}")  # fmt: skip
        if not self.host or any(c.isspace() for c in self.host):
            raise ValueError(f"host must be an address to bind (127.0.0.1, 0.0.0.0, a name), got {self.host!r}")
        name = self.router.served_model_name
        if name is not None and (not name or any(c.isspace() or not c.isprintable() for c in name)):
            raise ValueError(f"router.served_model_name must be a non-empty name without spaces, got {name!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= 64:
                raise ValueError(f"{name} must be in [1, 64], got {value}")
        for name in ("gpus_per_worker", "cpus_per_worker"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 <= self.core_reclaim_wait_s <= 10:
            raise ValueError(f"core_reclaim_wait_s must be in [0, 10] seconds, got {self.core_reclaim_wait_s}")
        for name in ("prefill_cpus_per_worker", "decode_cpus_per_worker"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("prefill_resources", "decode_resources"):
            for res, amount in getattr(self, name).items():
                if not res or res in ("CPU", "GPU", "memory", "object_store_memory") or not amount > 0 \
                        or not math.isfinite(amount):
                    raise ValueError(f"{name}: {res!r}: {amount!r}: a custom resource name (CPUs and GPUs "
                                     "have fields of their own) and an amount > 0")  # fmt: skip

    def tensor_parallel_size(self, role: str) -> int:
        """The tensor-parallel size of a ``role`` ("prefill" or "decode") worker."""
        own = self.prefill_tensor_parallel_size if role == "prefill" else self.decode_tensor_parallel_size
        return own if own is not None else self.engine.parallel.tensor_parallel_size

    def cpus_per_rank(self, role: str) -> float:
        """The Ray ``num_cpus`` of each tensor-parallel rank of a ``role`` worker."""
        own = self.prefill_cpus_per_worker if role == "prefill" else self.decode_cpus_per_worker
        return own if own is not None else self.cpus_per_worker

    @classmethod
    def load(cls, path: str | Path | None = None, **flags: Any) -> ServiceConfig:
        """Defaults, then the file (if any), then the non-None ``flags``, which are dotted paths
        written with ``__`` (``engine__cache__block_size=32``)."""
        data: dict[str, Any] = {}
        if path is not None:
            try:
                data = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read service config {path}: {e}") from e
            if not isinstance(data, dict):
                raise ValueError(f"service config {path} must be a JSON object, got {type(data).__name__}")
        for key, value in flags.items():
            if value is None:
                continue
            node = data
            *parents, leaf = key.split("__")
            for name in parents:
                node = node.setdefault(name, {})
                if not isinstance(node, dict):
                    raise ValueError(f"{name} must be an object")
            node[leaf] = value
        where = f" in {path}" if path is not None else ""
        return from_dict(cls, data, where)


def from_dict(cls: type, data: dict[str, Any], where: str = "", prefix: str = "") -> Any:
    """Build the frozen dataclass ``cls`` from a JSON-like dict, nested configs included.

    ValueError names the field's dotted path for unknown fields, wrong JSON types and what the
    classes' own validation refuses.
    """
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown field(s){where}: {', '.join(prefix + u for u in unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        hint = hints[name]
        nested = _config_class(hint)
        if nested is not None and not (value is None and _optional(hint)):
            if not isinstance(value, dict):
                raise ValueError(f"{prefix}{name} must be an object{where}, got {value!r}")
            kwargs[name] = from_dict(nested, value, where, f"{prefix}{name}.")
        else:
            _check_type(prefix + name, value, hint)
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{prefix}{e}{where}" if prefix else f"{e}{where}") from None


def _config_class(hint: Any) -> type | None:
    """The config class in ``hint`` (``X`` or ``X | None``), if any."""
    for t in getattr(hint, "__args__", (hint,)):
        if dataclasses.is_dataclass(t):
            return t
    return None


def _optional(hint: Any) -> bool:
    return type(None) in getattr(hint, "__args__", ())


_JSON_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_type(name: str, value: Any, hint: Any) -> None:
    """ValueError unless ``value`` fits ``hint`` (a config class, or ``T``/``T | None`` of bool/int/float/str)."""
    nested = _config_class(hint)
    if nested is not None:
        if not (isinstance(value, nested) or (value is None and _optional(hint))):
            raise ValueError(f"{name} must be a {nested.__name__}, got {value!r}")
        return
    if getattr(hint, "__origin__", None) is dict:  # dict[str, float]: a JSON object of numbers
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in value.items()
        ):
            raise ValueError(f"{name} must be an object of numbers, got {value!r}")
        return
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
