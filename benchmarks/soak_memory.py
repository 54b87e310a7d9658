"""Resident memory of a running service's processes, sampled by label (``start``, ``end``...)."""

from __future__ import annotations

import os

import psutil

_ACTORS = {"Router": "router", "PrefillWorker": "prefill", "DecodeWorker": "decode"}


class ProcessMemory:
    """Every process of a local service started by this driver: its Ray actors (router, workers,
    by their process titles), Ray's GCS and raylet, the embedded redis-server, and the driver.
    Found once, at the first sample."""

    def __init__(self) -> None:
        self._procs: dict[str, psutil.Process] | None = None
        self._samples: dict[str, dict[str, float]] = {}

    def _find(self) -> dict[str, psutil.Process]:
        procs: dict[str, psutil.Process] = {"driver": psutil.Process(os.getpid())}
        for child in sorted(psutil.Process().children(recursive=True), key=lambda p: p.pid):
            try:
                exe, title = child.name(), " ".join(child.cmdline())
            except psutil.Error:
                continue
            if title.startswith("ray::"):  # Ray titles an actor's process "ray::Class[.method]"
                cls = title.removeprefix("ray::").split(".")[0].split()[0]
                label = _ACTORS.get(cls)
                if label is not None:
                    n = sum(k.startswith(label) for k in procs)
                    procs[f"{label}-{n}" if label != "router" else label] = child
                continue
            for label in ("gcs_server", "raylet", "redis-server"):
                if exe.startswith(label) and label not in procs:
                    procs[label] = child
        return procs

    def sample(self, label: str) -> None:
        if self._procs is None:
            self._procs = self._find()
        for name, proc in self._procs.items():
            try:
                self._samples.setdefault(name, {})[label] = round(proc.memory_info().rss / 2**20, 1)
            except psutil.Error:
                pass  # it ended (a restarted process is a new one)

    def table(self) -> dict[str, dict[str, float]]:
        """process -> {label: RSS in MiB}."""
        return self._samples
