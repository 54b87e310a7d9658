"""A simulated multi-node cluster on one machine: Linux network namespaces on a bridge, shaped links, Ray.

Each node is a network namespace (``pds-<6 hex>-n<i>``) whose ``eth0`` is one end of a veth pair; the other
end (``pds-<6 hex>-v<i>``) is a port of one bridge (``pds-<6 hex>-br``) in the root namespace. The harness
assigns each node an address from a private /24 it picks (``10.213.X.0/24``), inside the node's namespace
only: the root namespace has no address on the bridge, there is no default route and no NAT, so nothing
leaves the machine. Links are shaped on both veth ends, so both directions of a node's link carry its
profile: ``tc`` tbf limits the rate; the delay is netem's (a child of the tbf) where the kernel has
``sch_netem``, else each node's NFQUEUE delay daemon holds the IPv4 packets arriving on its ``eth0``
(kernels built without netem, such as the VMs this project runs on; ``delay_backends()`` says which
work). Ray runs across the nodes: ``ray start --head`` in node 0, ``ray start --address`` in the others,
each with its own temp dir, CPUs and custom resources, all with one per-run ``RAY_AUTH_TOKEN``
(``RAY_AUTH_MODE=token``).

Namespaces share the process table, so ``ray stop`` would stop every Ray process on the machine; the
harness stops only processes it can attribute to the run: those whose network namespace is one of the
run's (``/proc/PID/ns/net``), by process id. Teardown removes everything the run created (processes,
veths, bridge, namespaces, the run directory) on a normal exit, on an exception, at interpreter exit and
on SIGTERM; ``cleanup(prefix)`` (``scripts/simcluster.sh down``) removes what a crashed run left behind.

The modules: ``cluster`` (``SimCluster``), ``nodes`` (``NodeSpec``, ``SimNode``), ``netns`` (namespaces,
veths, bridge, addresses), ``shaping`` (profiles, tc), ``delay`` (delay backends, availability, driving
the daemons), ``delayd`` (the NFQUEUE daemon), ``ray_nodes`` (Ray on the nodes), ``procs`` (processes by
pid), ``state`` (the run's state file), ``leftovers`` (runs by prefix, ``cleanup``), ``exit_hooks``
(teardown at exit and on SIGTERM), ``cli`` (``python -m pdserve.cluster.simnet``).
docs/simulated-cluster.md says how to use it by hand and what it does (not) prove.
"""

from __future__ import annotations

from pdserve.cluster.simnet.cli import main
from pdserve.cluster.simnet.cluster import SimCluster
from pdserve.cluster.simnet.delay import delay_backends, simnet_available
from pdserve.cluster.simnet.delayd import delay_daemon
from pdserve.cluster.simnet.errors import SimnetError
from pdserve.cluster.simnet.leftovers import cleanup, list_runs, run_is_stale
from pdserve.cluster.simnet.netns import NETNS_DIR, NODE_IFACE, RUN_PREFIX, RUN_RE, LinkBytes
from pdserve.cluster.simnet.nodes import NodeSpec, SimNode
from pdserve.cluster.simnet.procs import empty_netns, pids_in_netns, wait_for
from pdserve.cluster.simnet.ray_nodes import RAY_ENV_DROP, RAY_READY
from pdserve.cluster.simnet.shaping import PROFILES, LinkProfile, profile_of
from pdserve.cluster.simnet.state import BASE_DIR, read_state
from pdserve.procstat import proc_start_time, process_alive

__all__ = [
    "BASE_DIR",
    "NETNS_DIR",
    "NODE_IFACE",
    "PROFILES",
    "RAY_ENV_DROP",
    "RAY_READY",
    "RUN_PREFIX",
    "RUN_RE",
    "LinkBytes",
    "LinkProfile",
    "NodeSpec",
    "SimCluster",
    "SimNode",
    "SimnetError",
    "cleanup",
    "delay_backends",
    "delay_daemon",
    "empty_netns",
    "list_runs",
    "main",
    "pids_in_netns",
    "proc_start_time",
    "process_alive",
    "profile_of",
    "read_state",
    "run_is_stale",
    "simnet_available",
    "wait_for",
]
