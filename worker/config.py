"""WorkerConfig: one prefill or decode worker, composed of the engine, index and transfer configs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig
from pdserve.kvindex.config import IndexConfig
from pdserve.kvtransfer.config import TransferConfig

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    """``engine`` must name a model and ``index`` a Redis URL. The KV-transfer server binds
    ``bind_host`` on a free port and is advertised as ``advertise_host`` (None: this node's IP
    as Ray or the OS reports it; loopback when bound to loopback)."""

    worker_id: str
    role: str  # "prefill" | "decode"
    engine: EngineConfig
    index: IndexConfig
    transfer: TransferConfig = field(default_factory=TransferConfig)
    bind_host: str = "0.0.0.0"
    advertise_host: str | None = None
    heartbeat_s: float = 2.0
    # Lend the CPUs this worker leaves idle to the host's other CPU workers, and borrow theirs
    # (worker/core_share.py). Applies to a CPU engine of tensor-parallel size 1.
    share_idle_cpus: bool = False
    # With sharing: how long the first step after an idle period waits for a peer's step on this
    # worker's cores to end (worker/core_share.py RECLAIM_WAIT_S).
    core_reclaim_wait_s: float = 0.25

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if not isinstance(self.share_idle_cpus, bool):
            raise ValueError(f"share_idle_cpus must be true or false, got {self.share_idle_cpus!r}")
        if not 0 <= self.core_reclaim_wait_s <= 10:
            raise ValueError(f"core_reclaim_wait_s must be in [0, 10] seconds, got {self.core_reclaim_wait_s}")
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.engine.model is None:
            raise ValueError("engine.model: a worker needs a model")
        if self.index.url is None:
            raise ValueError("index.url: a worker needs a Redis URL")
        if not self.transfer.cluster_secret:
            raise ValueError("transfer.cluster_secret: a worker's KV-transfer plane always authenticates its callers")
        if not (isinstance(self.heartbeat_s, (int, float)) and math.isfinite(self.heartbeat_s) and self.heartbeat_s > 0):
            raise ValueError(f"heartbeat_s must be a finite number > 0, got {self.heartbeat_s!r}")
