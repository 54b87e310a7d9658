"""Network namespaces on a bridge: a run's names, its subnet, building and removing a node's namespace
and veth, reading a node's link counters, and running ``ip`` (or any command) inside a namespace.

Nodes are ``pds-<6 hex>-n<i>``; each one's ``eth0`` is one end of a veth pair whose other end
(``pds-<6 hex>-v<i>``) is a port of the bridge ``pds-<6 hex>-br`` in the root namespace. Addresses exist
only inside the nodes' namespaces: the root namespace has none on the bridge, no route and no NAT.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.cluster.simnet.errors import SimnetError

RUN_PREFIX = "pds-"
RUN_RE = re.compile(r"^pds-[0-9a-f]{6}$")  # a run's prefix: what `down` matches, never anything looser
NETNS_DIR = Path("/var/run/netns")
NODE_IFACE = "eth0"  # the node's side of its veth, named as on a VM


@dataclass(frozen=True)
class LinkBytes:
    """Byte counters of a node's ``eth0``, as the node sees them."""

    rx: int
    tx: int


def cmd(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run an ``ip``/``tc`` command; SimnetError with its stderr when it fails and ``check``."""
    proc = subprocess.run(list(argv), check=False, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SimnetError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``, inside namespace ``ns`` when given (see ``cmd``)."""
    return cmd(["ip", *(["-n", ns] if ns else []), *args], check)


def netns_exec(ns: str, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` inside network namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *argv]


def pick_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no root-namespace address overlaps (namespaces have their own
    routing tables, so overlaps could not leak; avoiding them keeps ``ip`` output unambiguous)."""
    used = []
    out = ip("-j", "-4", "addr", "show", check=False).stdout or "[]"
    for link in json.loads(out):
        for a in link.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    start = secrets.randbelow(256)
    for i in range(256):
        net = ipaddress.ip_network(f"10.213.{(start + i) % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise SimnetError("no free /24 in 10.213.0.0/16")


def add_bridge(bridge: str) -> None:
    """Create the run's bridge, up, without STP, forwarding delay or any address."""
    ip("link", "add", "name", bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
    # No IPv6 link-local address either: the root namespace keeps no address on the bridge.
    ip("link", "set", "dev", bridge, "addrgenmode", "none", check=False)
    ip("link", "set", "dev", bridge, "up")


def add_node(netns: str, veth: str, bridge: str, interface: str) -> None:
    """Create namespace ``netns`` with ``eth0`` at ``interface`` (``ADDR/PREFIXLEN``, IPv4 only), its
    veth peer ``veth`` a port of ``bridge``; everything up, nothing shaped yet."""
    ip("netns", "add", netns)
    # The node's end is created inside its namespace directly: it never appears in the root one.
    ip("link", "add", veth, "type", "veth", "peer", "name", NODE_IFACE, "netns", netns)
    ip("link", "set", "dev", veth, "addrgenmode", "none", check=False)
    ip("link", "set", "dev", veth, "master", bridge)
    ip("link", "set", "dev", veth, "up")
    ip("link", "set", "dev", "lo", "up", ns=netns)
    ip("addr", "add", interface, "dev", NODE_IFACE, ns=netns)
    ip("link", "set", "dev", NODE_IFACE, "addrgenmode", "none", ns=netns, check=False)  # IPv4 only
    ip("link", "set", "dev", NODE_IFACE, "up", ns=netns)


def link_bytes(netns: str) -> LinkBytes:
    """The rx/tx byte counters of ``eth0`` in ``netns`` (``ip -s link``)."""
    out = ip("-j", "-s", "link", "show", "dev", NODE_IFACE, ns=netns).stdout
    stats = json.loads(out)[0]["stats64"]
    return LinkBytes(rx=int(stats["rx"]["bytes"]), tx=int(stats["tx"]["bytes"]))


def remove_network(prefix: str, veths: Iterable[str], bridge: str, namespaces: Iterable[str]) -> list[str]:
    """Delete the veths (both ends go), the bridge and the namespaces; then check none with ``prefix``
    remains. Links first: a deleted namespace is destroyed asynchronously by the kernel, its links with it.
    Returns what remains."""
    for veth in veths:
        ip("link", "del", "dev", veth, check=False)
    ip("link", "del", "dev", bridge, check=False)
    for ns in namespaces:
        ip("netns", "del", ns, check=False)
    problems = [f"link {name} remains" for name in run_links(prefix)]
    problems += [f"namespace {ns} remains" for ns in run_namespaces(prefix)]
    return problems


def _of_run(names: Iterable[str], prefix: str) -> list[str]:
    """The names that belong to run ``prefix`` (``prefix``-...), or to any run for ``RUN_PREFIX``."""
    return [n for n in names if n.startswith(prefix if prefix == RUN_PREFIX else f"{prefix}-")]


def run_namespaces(prefix: str = RUN_PREFIX) -> list[str]:
    """Named network namespaces whose names start with ``prefix``-."""
    lines = ip("netns", "list", check=False).stdout.splitlines()
    return _of_run((line.split()[0] for line in lines if line.strip()), prefix)


def run_links(prefix: str = RUN_PREFIX) -> list[str]:
    """Root-namespace links whose names start with ``prefix``-."""
    out = ip("-j", "link", "show", check=False).stdout or "[]"
    return _of_run((link["ifname"] for link in json.loads(out)), prefix)


def run_of(name: str) -> str | None:
    """The run prefix (``pds-<6 hex>``) a namespace or link name belongs to, or None."""
    m = re.match(r"^(pds-[0-9a-f]{6})-", name)
    return m.group(1) if m else None
