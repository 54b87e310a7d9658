"""A node: what to build (``NodeSpec``), what was built (``SimNode``), and its names and address."""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster.simnet.shaping import LinkProfile, profile_of


@dataclass(frozen=True)
class NodeSpec:
    """A node to build: its name (unique in the cluster), Ray's ``--num-cpus`` and ``--resources``, and
    its link profile (None: the cluster's)."""

    name: str
    cpus: int = 1
    resources: Mapping[str, float] = field(default_factory=dict)
    profile: str | LinkProfile | None = None


@dataclass
class SimNode:
    """A built node: its namespace, interface names, address, Ray temp dir and current link state."""

    spec: NodeSpec
    index: int
    netns: str
    veth: str  # the root-namespace end, a port of the bridge
    address: str
    temp_dir: Path
    profile: LinkProfile
    partitioned: bool = False
    ray: subprocess.Popen[bytes] | None = None  # `ray start --block`, while it runs
    delayd: int | None = None  # the delay daemon's pid (backend "nfqueue")
    delay_gen: int = 0  # the last delay setting handed to the daemon

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ray_log(self) -> Path:
        return self.temp_dir.with_name(f"{self.temp_dir.name}-ray.log")


def plan_nodes(
    specs: Sequence[NodeSpec], prefix: str, subnet: ipaddress.IPv4Network, run_dir: Path, profile: LinkProfile
) -> list[SimNode]:
    """Node i of run ``prefix``: namespace ``<prefix>-n<i>``, veth ``<prefix>-v<i>``, the subnet's i-th host
    address, Ray temp dir ``<run dir>/n<i>``, its spec's profile or else ``profile``."""
    hosts = list(subnet.hosts())
    return [
        SimNode(
            spec=spec,
            index=i,
            netns=f"{prefix}-n{i}",
            veth=f"{prefix}-v{i}",
            address=str(hosts[i]),
            temp_dir=run_dir / f"n{i}",
            profile=profile_of(spec.profile) if spec.profile is not None else profile,
        )
        for i, spec in enumerate(specs)
    ]
