"""WorkerRegistry: the ``{ns}:workers`` hash of docs/redis.md, kept fresh by heartbeats.

Each field is a worker id; its value is a JSON object with (by convention) ``role``
(``"prefill"``/``"decode"``), ``grpc_address``, ``model_fingerprint``, ``block_size``,
``num_blocks``, ``free_blocks``, plus ``heartbeat_ms`` (unix ms), which the registry always
sets itself. Readers judge liveness by ``heartbeat_ms`` age (``workers(max_age_s=...)``);
a crashed worker's entry stays until someone ``unregister``s it, but ages out of that view.

Like the rest of the index, the registry tolerates Redis outages: writes return False and
reads return ``{}`` (logged once per outage), heartbeats keep trying.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping

from pdserve.kvindex.config import REDIS_ERRORS, IndexConfig, now_ms
from pdserve.kvindex.outage import OutageTracker

log = logging.getLogger(__name__)

WORKER_INFO_FIELDS: tuple[str, ...] = (
    "role",
    "grpc_address",
    "model_fingerprint",
    "block_size",
    "num_blocks",
    "free_blocks",
    "heartbeat_ms",
)

InfoFn = Callable[[], Mapping[str, object]]


class WorkerRegistry:
    """Register workers, refresh them with heartbeat threads, list the live ones."""

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        self._client = config.client()
        self._outage = OutageTracker("worker-registry")
        self._heartbeats: dict[str, tuple[threading.Thread, threading.Event]] = {}
        self._lock = threading.Lock()

    @property
    def outages(self) -> int:
        return self._outage.outages

    def register(self, worker_id: str, info: Mapping[str, object]) -> bool:
        """Write ``info`` plus ``heartbeat_ms = now`` under ``worker_id``; False if Redis is down.

        ``info`` must be JSON-serializable (a TypeError/ValueError otherwise: a caller bug).
        """
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        payload = json.dumps({**info, "heartbeat_ms": now_ms()}, sort_keys=True)
        try:
            self._client.hset(self.config.workers_key, worker_id, payload)
        except REDIS_ERRORS as exc:
            self._outage.failed(exc)
            return False
        self._outage.ok()
        return True

    def unregister(self, worker_id: str) -> bool:
        """Stop the worker's heartbeat (if any) and remove its entry; False if Redis is down."""
        self.stop_heartbeat(worker_id)
        try:
            self._client.hdel(self.config.workers_key, worker_id)
        except REDIS_ERRORS as exc:
            self._outage.failed(exc)
            return False
        self._outage.ok()
        return True

    def workers(self, max_age_s: float | None = None) -> dict[str, dict]:
        """Worker id -> info; with ``max_age_s``, only those whose heartbeat is at most that old.

        Malformed entries are skipped (logged). ``{}`` when Redis is down.
        """
        try:
            raw = self._client.hgetall(self.config.workers_key)
        except REDIS_ERRORS as exc:
            self._outage.failed(exc)
            return {}
        self._outage.ok()
        now = now_ms()
        out: dict[str, dict] = {}
        for worker_id, value in raw.items():
            try:
                info = json.loads(value)
                age_ms = now - int(info["heartbeat_ms"])
            except (ValueError, TypeError, KeyError):
                log.warning("worker-registry: malformed entry for %r skipped", worker_id)
                continue
            if max_age_s is None or age_ms <= max_age_s * 1000:
                out[worker_id] = info
        return out

    # -- heartbeats ---------------------------------------------------------------------
    def start_heartbeat(self, worker_id: str, info_fn: InfoFn, interval_s: float = 2.0) -> None:
        """Register now and then every ``interval_s`` with a fresh ``info_fn()`` (a daemon thread).

        ``info_fn`` errors are logged and that beat is skipped; Redis outages are tolerated.
        Replaces an earlier heartbeat of the same worker.
        """
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.stop_heartbeat(worker_id)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._beat, args=(worker_id, info_fn, interval_s, stop), name=f"heartbeat[{worker_id}]", daemon=True
        )
        with self._lock:
            self._heartbeats[worker_id] = (thread, stop)
        thread.start()

    def _beat(self, worker_id: str, info_fn: InfoFn, interval_s: float, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.register(worker_id, info_fn())
            except Exception:  # noqa: BLE001 - a bad beat (info_fn error, unserializable info) must not end it
                log.exception("worker-registry: heartbeat of %r failed; beat skipped", worker_id)
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))

    def stop_heartbeat(self, worker_id: str, timeout: float = 5.0) -> None:
        """Stop the worker's heartbeat thread (its entry stays until ``unregister``)."""
        with self._lock:
            entry = self._heartbeats.pop(worker_id, None)
        if entry is not None:
            thread, stop = entry
            stop.set()
            thread.join(timeout)

    def close(self) -> None:
        """Stop every heartbeat and close the client (entries stay in Redis)."""
        with self._lock:
            ids = list(self._heartbeats)
        for worker_id in ids:
            self.stop_heartbeat(worker_id)
        self._client.close()

    def __enter__(self) -> WorkerRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
