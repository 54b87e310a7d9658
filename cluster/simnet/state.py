"""A run's directory and its state file, ``/tmp/pds-simnet/<run>/state.json``: what ``status``,
``down --stale`` and ``SimCluster.attach`` read, and how a crashed run's leftovers (owner gone) are told from a live one's."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cluster.simnet.nodes import NodeSpec, SimNode
from pdserve.cluster.simnet.shaping import LinkProfile
from pdserve.procstat import proc_start_time

if TYPE_CHECKING:
    from pdserve.cluster.simnet.cluster import SimCluster

# Short on purpose: Ray's unix sockets live under <temp dir>/session_<timestamp>_<pid>/sockets/ and a
# socket path must stay under 108 bytes.
BASE_DIR = Path("/tmp/pds-simnet")


def write_state(sim: SimCluster, detached: bool) -> None:
    """Record the run in ``<run dir>/state.json`` (0600: it holds the token), this process as its owner;
    nothing before the run's directory and subnet exist."""
    if not sim.run_dir.exists() or sim.subnet is None:
        return
    me = os.getpid()
    state = {
        "prefix": sim.prefix,
        "subnet": str(sim.subnet),
        "bridge": sim.bridge,
        "ray": sim.with_ray,
        "backend": sim.backend,
        "ray_port": sim.ray_port,
        "ray_address": sim.ray_address,
        "token": sim.token,
        "owner": {"pid": me, "start": proc_start_time(me), "detached": detached},
        "nodes": [
            {
                "name": n.name,
                "index": n.index,
                "netns": n.netns,
                "veth": n.veth,
                "address": n.address,
                "cpus": n.spec.cpus,
                "resources": dict(n.spec.resources),
                "profile": asdict(n.profile),
                "partitioned": n.partitioned,
                "delayd": n.delayd,
                "delay_gen": n.delay_gen,
            }
            for n in sim.nodes.values()
        ],
    }
    path = sim.run_dir / "state.json"
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path.with_suffix(".tmp"), path)


def read_state(prefix: str) -> dict[str, Any] | None:
    """A run's state file, or None when it has none (not ours, or already removed)."""
    try:
        return json.loads((BASE_DIR / prefix / "state.json").read_text())
    except (OSError, ValueError):
        return None


def nodes_from_state(state: Mapping[str, Any], run_dir: Path) -> list[SimNode]:
    """The run's nodes as ``write_state`` recorded them (their specs without a profile of their own)."""
    return [
        SimNode(
            spec=NodeSpec(n["name"], n["cpus"], n["resources"]),
            index=n["index"],
            netns=n["netns"],
            veth=n["veth"],
            address=n["address"],
            temp_dir=run_dir / f"n{n['index']}",
            profile=LinkProfile(**n["profile"]),
            partitioned=n["partitioned"],
            delayd=n["delayd"],
            delay_gen=n["delay_gen"],
        )
        for n in state["nodes"]
    ]
