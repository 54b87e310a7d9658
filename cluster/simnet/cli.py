"""The by-hand commands, ``python -m pdserve.cluster.simnet {up,down,status,exec,profile,partition,heal}``
(``scripts/simcluster.sh``; docs/simulated-cluster.md), and the hidden ``_delayd`` a node's delay daemon
runs as."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from pdserve.cluster.simnet.cluster import SimCluster
from pdserve.cluster.simnet.delay import simnet_available
from pdserve.cluster.simnet.delayd import delayd_main
from pdserve.cluster.simnet.errors import SimnetError
from pdserve.cluster.simnet.leftovers import cleanup, list_runs, run_is_stale
from pdserve.cluster.simnet.netns import netns_exec, run_namespaces
from pdserve.cluster.simnet.nodes import NodeSpec
from pdserve.cluster.simnet.procs import pids_in_netns
from pdserve.cluster.simnet.ray_nodes import inherited_env
from pdserve.cluster.simnet.shaping import PROFILES
from pdserve.cluster.simnet.state import read_state


def _parse_node(text: str) -> NodeSpec:
    """``NAME[:CPUS[:PROFILE]]``; the node gets the custom resource ``node_<NAME>`` = 1."""
    parts = text.split(":")
    name = parts[0]
    cpus = int(parts[1]) if len(parts) > 1 and parts[1] else 1
    profile = parts[2] if len(parts) > 2 and parts[2] else None
    return NodeSpec(name, cpus, {f"node_{name}": 1}, profile)


def _cmd_up(args: argparse.Namespace) -> int:
    nodes = [_parse_node(n) for n in args.node] or [_parse_node("head"), _parse_node("n1")]
    sim = SimCluster(nodes, args.profile, ray=not args.no_ray, ray_port=args.port).start()
    sim.detach()
    print(f"run {sim.prefix}: subnet {sim.subnet}, profile {sim.default_profile.name}")
    for n in sim.nodes.values():
        print(f"  {n.name:10} {n.netns:16} {n.address:15} {n.profile.name}")
    if sim.with_ray:
        print(f"ray at {sim.ray_address} (token in {sim.run_dir / 'state.json'})")
    print(f"a driver: scripts/simcluster.sh exec {sim.prefix} {sim.head.name} -- python my_driver.py")
    print(f"remove:   scripts/simcluster.sh down {sim.prefix}")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    runs = args.prefix or [r for r in list_runs() if args.all or (args.stale and run_is_stale(r))]
    if not runs:
        print("nothing to remove (name a prefix, or --stale / --all)", file=sys.stderr)
    problems = []
    for prefix in runs:
        left = cleanup(prefix)
        problems += left
        print(f"removed {prefix}" + (f" (left: {'; '.join(left)})" if left else ""))
    return 1 if problems else 0


def _cmd_status(args: argparse.Namespace) -> int:
    runs = args.prefix or list_runs()
    report = []
    for prefix in runs:
        state = read_state(prefix) or {}
        entry = {"prefix": prefix, "stale": run_is_stale(prefix), "ray_address": state.get("ray_address"),
                 "subnet": state.get("subnet"), "nodes": []}  # fmt: skip
        for n in state.get("nodes", []):
            entry["nodes"].append({"name": n["name"], "netns": n["netns"], "address": n["address"],
                                   "profile": n["profile"]["name"], "partitioned": n["partitioned"],
                                   "processes": len(pids_in_netns(n["netns"]))})  # fmt: skip
        entry["namespaces"] = run_namespaces(prefix)
        report.append(entry)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    if not report:
        print("no simulated clusters")
    for e in report:
        print(f"{e['prefix']}: subnet {e['subnet']}, ray {e['ray_address']}" + (" (stale)" if e["stale"] else ""))
        for n in e["nodes"]:
            cut = ", partitioned" if n["partitioned"] else ""
            print(f"  {n['name']:10} {n['netns']:16} {n['address']:15} {n['profile']}{cut}, {n['processes']} processes")
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    sim = SimCluster.attach(args.prefix)
    node = sim.node(args.node)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    os.execvpe("ip", netns_exec(node.netns, command), inherited_env() | sim.env(node.name))
    return 127  # not reached


def _cmd_link(args: argparse.Namespace) -> int:
    sim = SimCluster.attach(args.prefix)
    if args.cmd == "profile":
        sim.set_profile(args.node, args.profile)
    else:
        getattr(sim, args.cmd)(args.node)  # partition / heal
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pdserve.cluster.simnet {up,down,status,exec,profile,partition,heal}`` (needs root)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_delayd"]:  # internal: runs inside a node's namespace
        return delayd_main(argv[1:])
    ap = argparse.ArgumentParser(prog="simcluster", description="A simulated multi-node cluster on one machine.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a cluster and leave it running")
    up.add_argument("--node", action="append", default=[], help="NAME[:CPUS[:PROFILE]], repeatable (head first)")
    up.add_argument("--profile", default="fast", choices=sorted(PROFILES))
    up.add_argument("--port", type=int, default=6379, help="the head's GCS port")
    up.add_argument("--no-ray", action="store_true", help="the network only")
    down = sub.add_parser("down", help="remove runs by prefix")
    down.add_argument("prefix", nargs="*")
    down.add_argument("--stale", action="store_true", help="every run whose owner process is gone")
    down.add_argument("--all", action="store_true", help="every pds-* run on this machine, live ones too")
    status = sub.add_parser("status", help="list runs")
    status.add_argument("prefix", nargs="*")
    status.add_argument("--json", action="store_true")
    ex = sub.add_parser("exec", help="run a command on a node, with the cluster's environment")
    ex.add_argument("prefix")
    ex.add_argument("node")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    for name in ("profile", "partition", "heal"):
        p = sub.add_parser(name, help=f"{name} a node's link")
        p.add_argument("prefix")
        p.add_argument("node")
        if name == "profile":
            p.add_argument("profile", choices=sorted(PROFILES))
    args = ap.parse_args(argv)
    # `down` and `status` need root only: they must work where a run could not be built any more.
    reason = simnet_available() if args.cmd not in ("down", "status") else None
    if os.geteuid() != 0 or reason:
        print(f"simcluster: {reason or 'needs root'}", file=sys.stderr)
        return 2
    handlers = {"up": _cmd_up, "down": _cmd_down, "status": _cmd_status, "exec": _cmd_exec}
    try:
        return handlers.get(args.cmd, _cmd_link)(args)
    except SimnetError as exc:
        print(f"simcluster: {exc}", file=sys.stderr)
        return 1
