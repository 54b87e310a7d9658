"""``SimCluster``: a run's nodes, links and Ray, built on entry and torn down on exit (see the package's
docstring for the picture)."""

from __future__ import annotations

import ipaddress
import logging
import secrets
import shutil
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.cluster.simnet import exit_hooks, netns
from pdserve.cluster.simnet.delay import delay_backends, push_delays, simnet_available
from pdserve.cluster.simnet.errors import RayStartError, SimnetError
from pdserve.cluster.simnet.netns import RUN_PREFIX, LinkBytes
from pdserve.cluster.simnet.nodes import NodeSpec, SimNode, plan_nodes
from pdserve.cluster.simnet.procs import RunProcesses, descendants, empty_netns, pids_in_netns
from pdserve.cluster.simnet.ray_nodes import check_ray_args, inherited_env, kill_ray, launch_ray, start_ray, wait_ray
from pdserve.cluster.simnet.shaping import LinkProfile, profile_of, shape
from pdserve.cluster.simnet.state import BASE_DIR, nodes_from_state, read_state, write_state

log = logging.getLogger(__name__)


class SimCluster:
    """Nodes as network namespaces on one bridge, shaped links and (unless ``ray=False``) a Ray cluster.

    ``with SimCluster(nodes=[NodeSpec("head", resources={"node_head": 1}), NodeSpec("n1")]) as sim:``
    builds everything on entry (the first node is Ray's head) and removes it on exit. Node arguments
    are node names. Every method raises SimnetError when a step fails. ``close`` is idempotent and
    also runs at interpreter exit and on SIGTERM. ``ray_port`` is the head's GCS port; ``ray_args``
    are more ``ray start`` flags (``--name=value``) for every node, e.g. fixed ports (each node has
    its own network stack, so every node may take the same one), never one that the cluster sets
    itself (SimnetError).
    """

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        profile: str | LinkProfile = "fast",
        *,
        ray: bool = True,
        ray_port: int = 6379,
        object_store_bytes: int = 80 * 1024 * 1024,
        start_timeout: float = 120.0,
        delay: str | None = None,
        ray_env: Mapping[str, str] | None = None,
        ray_args: Sequence[str] = (),
    ) -> None:
        names = [n.name for n in nodes]
        if not nodes or len(set(names)) != len(names):
            raise SimnetError(f"need at least one node and unique names, got {names}")
        if len(nodes) > 250:
            raise SimnetError("at most 250 nodes fit the /24")
        self.specs = list(nodes)
        if delay not in (None, "netem", "nfqueue"):
            raise SimnetError(f"delay is netem or nfqueue (None: the best this machine has), not {delay!r}")
        # (start fails, saying why, where this machine has no way at all)
        self.backend = delay or next(iter(delay_backends()), "netem")
        self.default_profile = profile_of(profile)
        self.with_ray = ray
        self.ray_port = ray_port
        self.object_store_bytes = object_store_bytes
        self.ray_env = dict(ray_env or {})  # e.g. RAY_health_check_period_ms: Ray's settings for every node
        self.ray_args = check_ray_args(ray_args)  # e.g. --object-manager-port=8076: more `ray start` flags
        self.start_timeout = start_timeout
        self.prefix = f"{RUN_PREFIX}{secrets.token_hex(3)}"
        self.bridge = f"{self.prefix}-br"
        self.run_dir = BASE_DIR / self.prefix
        self.token = secrets.token_hex(32)  # what Ray itself would generate
        self.subnet: ipaddress.IPv4Network | None = None
        self.nodes: dict[str, SimNode] = {}
        self._procs = RunProcesses()  # everything started, each in one of our namespaces, and every pid seen
        self._lock = threading.RLock()
        self._started = False
        self._closed = False
        self._detached = False

    def __enter__(self) -> SimCluster:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        # Teardown must not hide the exception that ended the block; on a clean exit, leftovers fail.
        self.close(strict=exc_type is None)

    def start(self) -> SimCluster:
        """Build the network, shape the links and (unless ``ray=False``) start Ray on every node and wait
        until each says it runs. On failure, removes what it built and raises."""
        if self._started:
            raise SimnetError("a SimCluster starts once")
        if reason := simnet_available():
            raise SimnetError(reason)
        if self.backend not in delay_backends():
            raise SimnetError(f"this kernel cannot delay packets with {self.backend} (it can: {delay_backends()})")
        self._started = True
        exit_hooks.register(self)
        try:
            self._build_network()
            write_state(self, self._detached)
            if self.with_ray:
                self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def _start_ray(self) -> None:
        """Ray on every node (``start_ray``), started once more if a node's ``ray start`` fails: on a
        loaded machine a raylet now and then never registers within Ray's 30 s, and a second start
        comes up. Every node's Ray is killed before the second start (a new head is a new cluster)."""
        try:
            start_ray(self)
        except RayStartError as e:
            log.warning("simnet: %s; starting Ray on every node again", str(e).splitlines()[0])
            for name in self.nodes:
                self.kill_node(name)
            start_ray(self)

    def close(self, strict: bool = False) -> list[str]:
        """Remove everything the run created: its processes (by pid), veths, bridge, namespaces and run
        directory. Idempotent. Returns what it could not remove (raises SimnetError for it if ``strict``)."""
        with self._lock:
            if self._closed or self._detached:
                return []
            self._closed = True
            try:
                problems = self._teardown()
            finally:
                exit_hooks.unregister(self)
        if problems and strict:
            raise SimnetError("teardown left: " + "; ".join(problems))
        return problems

    def detach(self) -> None:
        """Leave everything running after this process exits (``simcluster.sh up``); ``cleanup(prefix)``
        removes it later."""
        with self._lock:
            self._detached = True
            write_state(self, self._detached)
            exit_hooks.unregister(self)

    @classmethod
    def attach(cls, prefix: str) -> SimCluster:
        """A handle on a running (detached) run from its state file, for by-hand changes (profile,
        partition, run). It never tears the run down on its own; ``cleanup(prefix)`` does."""
        state = read_state(prefix)
        if state is None:
            raise SimnetError(f"no state for run {prefix} under {BASE_DIR}")
        nodes = nodes_from_state(state, BASE_DIR / prefix)
        sim = cls([n.spec for n in nodes], ray=state["ray"], ray_port=state["ray_port"])
        sim.prefix, sim.bridge, sim.run_dir, sim.token = prefix, state["bridge"], BASE_DIR / prefix, state["token"]
        sim.subnet = ipaddress.ip_network(state["subnet"])
        sim.nodes = {n.name: n for n in nodes}
        sim.backend = state["backend"]
        sim._started = sim._detached = True
        return sim

    def _teardown(self) -> list[str]:
        problems: list[str] = []
        for node in self.nodes.values():
            try:
                self._procs.record(pids_in_netns(node.netns))
                empty_netns(node.netns, grace=1.0)
            except SimnetError as exc:
                problems.append(str(exc))
        problems += self._procs.reap()  # one may still be in `ip netns exec`, before entering the namespace
        nodes = self.nodes.values()
        problems += netns.remove_network(self.prefix, [n.veth for n in nodes], self.bridge, [n.netns for n in nodes])
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.run_dir.exists():
            problems.append(f"{self.run_dir} remains")
        return problems

    def _build_network(self) -> None:
        self.subnet = netns.pick_subnet()
        self.run_dir.mkdir(mode=0o700, parents=True)
        netns.add_bridge(self.bridge)
        for node in plan_nodes(self.specs, self.prefix, self.subnet, self.run_dir, self.default_profile):
            self.nodes[node.name] = node
            node.temp_dir.mkdir(mode=0o700)
            netns.add_node(node.netns, node.veth, self.bridge, f"{node.address}/{self.subnet.prefixlen}")
            self._shape(node)
        if self.backend == "nfqueue":  # once all nodes exist: each daemon filters by its peers' addresses
            push_delays(self.nodes.values(), self.run_dir, self.run)

    def _shape(self, node: SimNode) -> None:
        shape(node.veth, node.netns, node.profile, node.partitioned, netem=self.backend == "netem")

    def node(self, name: str) -> SimNode:
        """The node called ``name``; SimnetError if there is none."""
        try:
            return self.nodes[name]
        except KeyError:
            raise SimnetError(f"no node {name!r} (nodes: {', '.join(self.nodes)})") from None

    def address(self, name: str) -> str:
        """The node's IPv4 address (on its ``eth0``)."""
        return self.node(name).address

    @property
    def head(self) -> SimNode:
        """Node 0: Ray's head."""
        return next(iter(self.nodes.values()))

    @property
    def ray_address(self) -> str:
        """``HOST:PORT`` of the head's GCS, as ``ray start --address`` and ``ray.init`` take it."""
        return f"{self.head.address}:{self.ray_port}"

    def set_profile(self, name: str, profile: str | LinkProfile) -> None:
        """Reshape the node's link (both directions) now; a partitioned node stays partitioned."""
        node = self.node(name)
        node.profile = profile_of(profile)
        self._shape(node)
        if self.backend == "nfqueue":
            push_delays(self.nodes.values(), self.run_dir, self.run)
        write_state(self, self._detached)

    def partition(self, name: str) -> None:
        """Cut the node off: its link drops every frame in both directions (ARP included; a tbf whose bucket
        no frame fits, the equivalent of netem's ``loss 100%``), so peers see silence, as with a pulled
        cable, not a refused connection; the interfaces stay up. ``heal`` restores it."""
        self._set_partitioned(name, True)

    def heal(self, name: str) -> None:
        """Undo ``partition``: the node's link carries its profile again."""
        self._set_partitioned(name, False)

    def _set_partitioned(self, name: str, partitioned: bool) -> None:
        node = self.node(name)
        node.partitioned = partitioned
        self._shape(node)
        write_state(self, self._detached)

    def link_bytes(self, name: str) -> LinkBytes:
        """The node's ``eth0`` rx/tx byte counters, read inside its namespace (``ip -s link``)."""
        return netns.link_bytes(self.node(name).netns)

    def env(self, name: str) -> dict[str, str]:
        """What a process on node ``name`` needs to join the cluster: ``RAY_ADDRESS``, the token, and
        ``SIMNET_NODE``/``SIMNET_NODE_IP``/``SIMNET_PREFIX``. A driver on a node other than the head
        passes ``_node_ip_address=os.environ["SIMNET_NODE_IP"]`` to ``ray.init`` (Ray finds local
        raylets by scanning the shared process table, so it would otherwise pick the head's)."""
        node = self.node(name)
        return {
            "RAY_ADDRESS": self.ray_address,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "SIMNET_NODE": node.name,
            "SIMNET_NODE_IP": node.address,
            "SIMNET_PREFIX": self.prefix,
            # Each node is its own host to pdserve's same-host KV transport (shared memory), as it is
            # to the network: without it, workers on two nodes of one kernel would skip the link.
            "PDSERVE_HOST_ID": f"{self.prefix}-{node.name}",
        }

    def run(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside node ``name``'s namespace (``ip netns exec``) with this process's
        environment, then ``env(name)``, then ``env``; ``popen`` goes to Popen (stdout, text, ...). The
        process gets its own session and is tracked: teardown stops it by pid."""
        node = self.node(name)
        full_env = inherited_env() | self.env(name) | dict(env or {})
        with self._lock:
            if self._closed or not self._started:
                raise SimnetError("the cluster is not running")
            return self._procs.start(netns.netns_exec(node.netns, argv), full_env, **popen)

    def check_output(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60.0
    ) -> str:
        """Run ``argv`` on node ``name`` to completion and return its stdout (text); SimnetError with its
        stderr when it fails or runs past ``timeout`` seconds (it is killed then)."""
        proc = self.run(name, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise SimnetError(f"{argv[:3]} on {name} ran past {timeout} s; stderr: {err[-2000:]}") from None
        if proc.returncode != 0:
            raise SimnetError(f"{argv[:3]} on {name} exited {proc.returncode}; stderr: {err[-2000:]}")
        return out

    def recorded_pids(self) -> dict[int, int]:
        """pid -> start time of every process of the run seen so far (now included: the namespaces are
        scanned): what teardown must leave dead. ``process_alive(pid, start)`` checks one."""
        with self._lock:
            if not self._closed:
                for node in self.nodes.values():
                    self._procs.record(pids_in_netns(node.netns))
            return dict(self._procs.recorded)

    def kill_node(self, name: str) -> set[int]:
        """Kill the node's Ray processes (``ray start``, raylet, workers, agents; GCS too on the head) by
        pid with SIGKILL, as a crash would; processes started with ``run`` live on. Returns their pids.
        Ray notices through its health checks (seconds)."""
        node = self.node(name)

        def keep() -> set[int]:  # what `run` started (and its children), the delay daemon included
            return descendants(self._procs.running(but=node.ray) + ([node.delayd] if node.delayd else []))

        self._procs.record(pids_in_netns(node.netns) - keep())
        return kill_ray(node, keep)

    def restart_node(self, name: str) -> None:
        """Kill the node's Ray (if running) and start it again, waiting until it runs. A restarted worker
        node joins the same cluster as a new Ray node; a restarted head starts a new, empty cluster
        (no GCS fault tolerance here), so restart the other nodes after it."""
        node = self.node(name)
        if not self.with_ray:
            raise SimnetError("this cluster runs without Ray")
        self.kill_node(name)
        wait_ray(node, launch_ray(self, node), self.start_timeout)
