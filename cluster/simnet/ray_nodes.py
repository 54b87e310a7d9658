"""Ray on the nodes: ``ray start --head`` in node 0, ``ray start --address`` in the others, each with its
own temp dir, CPUs and custom resources, all with the run's ``RAY_AUTH_TOKEN`` (``RAY_AUTH_MODE=token``);
and killing a node's Ray by pid (``ray stop`` would stop every Ray process on the machine)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.cluster.simnet.errors import RayStartError, SimnetError
from pdserve.cluster.simnet.nodes import SimNode
from pdserve.cluster.simnet.procs import empty_netns, wait_for

if TYPE_CHECKING:
    from pdserve.cluster.simnet.cluster import SimCluster

RAY_READY = "Ray runtime started."  # what `ray start` prints once its node runs (also with --block)
# Inherited settings that would point a node or a driver at another cluster or another token.
RAY_ENV_DROP = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# The `ray start` flags the cluster sets on every node (or on the head, or on the others).
OWN_FLAGS = frozenset({
    "--block", "--node-ip-address", "--num-cpus", "--num-gpus", "--resources", "--temp-dir", "--object-store-memory",
    "--disable-usage-stats", "--log-style", "--log-color", "--head", "--port", "--include-dashboard", "--address",
})  # fmt: skip


def inherited_env() -> dict[str, str]:
    """This process's environment without ``RAY_ENV_DROP``: what a node's process starts from."""
    return {k: v for k, v in os.environ.items() if k not in RAY_ENV_DROP}


def _ray_bin() -> str:
    """The ``ray`` command of this interpreter's environment (else the one on PATH)."""
    here = Path(sys.executable).parent / "ray"
    found = str(here) if here.exists() else shutil.which("ray")
    if not found:
        raise SimnetError("the `ray` command is not installed")
    return found


def check_ray_args(args: Sequence[str]) -> tuple[str, ...]:
    """``args`` as extra ``ray start`` flags: each ``--name=value`` and none of ``OWN_FLAGS``, which
    the cluster sets itself (a second value would make the node differ from what it records);
    SimnetError otherwise."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if not arg.startswith("--") or "=" not in arg or name in OWN_FLAGS:
            raise SimnetError(f"ray_args: {arg!r}: give --name=value, not one of {', '.join(sorted(OWN_FLAGS))}")
    return tuple(args)


def _ray_argv(sim: SimCluster, node: SimNode) -> list[str]:
    spec = node.spec
    argv = [
        _ray_bin(), "start", "--block", f"--node-ip-address={node.address}", f"--num-cpus={spec.cpus}",
        "--num-gpus=0", f"--resources={json.dumps(dict(spec.resources))}", f"--temp-dir={node.temp_dir}",
        f"--object-store-memory={sim.object_store_bytes}", "--disable-usage-stats", "--log-style=record",
        "--log-color=false", *sim.ray_args,
    ]  # fmt: skip
    if node.index == 0:
        return argv + ["--head", f"--port={sim.ray_port}", "--include-dashboard=false"]
    return argv + [f"--address={sim.ray_address}"]


def launch_ray(sim: SimCluster, node: SimNode) -> int:
    """Start ``ray start --block`` on the node (``sim.run``: tracked, in its namespace); returns where its
    output starts in the node's Ray log (the log is appended to across restarts)."""
    env = inherited_env() | sim.ray_env
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=sim.token, RAY_USAGE_STATS_ENABLED="0")
    with open(node.ray_log, "ab") as log:
        offset = log.tell()
        node.ray = sim.run(node.name, _ray_argv(sim, node), env, stdout=log, stderr=subprocess.STDOUT)
    return offset


def wait_ray(node: SimNode, offset: int, timeout: float) -> None:
    """Wait until ``ray start`` on the node says it runs (in its log after ``offset``); RayStartError with
    the log's tail if it exits first."""
    proc = node.ray
    assert proc is not None

    def ready() -> bool:
        with open(node.ray_log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        if proc.poll() is not None:
            raise RayStartError(f"ray start on {node.name} exited {proc.returncode}:\n{text[-3000:]}")
        return RAY_READY in text

    wait_for(ready, timeout, f"Ray on {node.name} ({node.ray_log})", interval=0.1)


def start_ray(sim: SimCluster) -> None:
    """Ray on every node: the head first, then the others at once; waits until each says it runs."""
    head, *others = sim.nodes.values()
    wait_ray(head, launch_ray(sim, head), sim.start_timeout)
    offsets = [launch_ray(sim, node) for node in others]
    for node, offset in zip(others, offsets, strict=True):
        wait_ray(node, offset, sim.start_timeout)


def kill_ray(node: SimNode, keep: Callable[[], set[int]]) -> set[int]:
    """SIGKILL every process in the node's namespace but those ``keep()`` names (re-read on each pass),
    as a crash would, and reap its ``ray start``; returns the pids killed."""
    killed = empty_netns(node.netns, keep=keep, grace=0.0)
    if node.ray is not None:
        node.ray.wait()
        node.ray = None
    return killed
