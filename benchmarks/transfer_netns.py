"""``pdserve bench transfer --across-netns``: the transfer benchmark's pulls between two network namespaces.

A two-node simulated cluster (``pdserve.cluster.simnet``, network only: no Ray). Node ``n1`` runs the
holder (``python -m pdserve.benchmarks.transfer --serve --host <n1's address>``: transfer server, bare
gRPC server and raw TCP listener all on that address), node ``n2`` the puller (``... --pull-from <the
holder's READY JSON>``, which prints one ``ROWS`` line of JSON). Both are started by ``SimCluster.run``
(``ip netns exec``) with their node's environment, ``PDSERVE_HOST_ID`` included, so the two are separate
hosts to the same-host (shared-memory) transport as they are to the network; the puller keeps shared
memory on, as a worker does, and must still pull by gRPC. Both run with ``UCX_ENV`` (NIXL's UCX over
TCP on ``eth0`` only): UCX would otherwise reach the other namespace's process by its same-host
transports (cma), and the NIXL pulls would not cross the link (the ``eth0`` check below fails). One
holder and one puller per layer count.
Around each puller the bench reads n2's ``eth0`` receive counter and fails unless at least the pulled
bytes crossed it, and sums the CPU seconds of the nodes' delay daemons (the NFQUEUE backend, where the
kernel lacks netem, handles every packet in user space; on a small machine it competes with both ends).

Nothing binds outside the two namespaces (the holder's shared-memory offer is a Unix socket file the
puller never connects to, its host identity differing). The cluster, with every process in its
namespaces, its veths and its bridge, is torn down on every path (normal exit, exception, SIGTERM).

Run: ``pdserve bench transfer --across-netns [--link-profile fast] [--json]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from pdserve.benchmarks.common import emit
from pdserve.benchmarks.transfer import (
    ROOT,
    ROWS,
    _cpu,
    _nixl_text,
    holder_argv,
    process_usage,
    read_ready,
    stop_holder,
)
from pdserve.kvtransfer.config import MiB

if TYPE_CHECKING:
    from pdserve.cluster.simnet import SimCluster

HOLDER, PULLER = "n1", "n2"
# Both ends' NIXL (UCX) over TCP on eth0: on one machine UCX would otherwise reach the other namespace's
# process by its same-host transports (cma, shared memory), whose bytes never cross the link.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}
PULL_TIMEOUT_S = 1800.0  # one puller: every chunk size of one layout, all rounds


def puller_argv(info: dict, num_layers: int, chunks: list[int], repeats: int) -> list[str]:
    """The puller's command line (``transfer.pull_main``) for the holder whose READY line is ``info``."""
    return [sys.executable, "-m", "pdserve.benchmarks.transfer", "--pull-from", json.dumps(info),
            "--num-layers", str(num_layers), "--chunk-bytes", ",".join(map(str, chunks)),
            "--repeats", str(repeats)]  # fmt: skip


def parse_rows(stdout: str) -> dict[str, Any]:
    """The puller's ``ROWS`` JSON from its stdout; RuntimeError if it printed none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(ROWS):
            return json.loads(line[len(ROWS) :])
    raise RuntimeError(f"the puller printed no result: {stdout[-2000:]!r}")


def _daemons_cpu_s(sim: SimCluster) -> float:
    """CPU seconds the nodes' delay daemons have spent so far (0 without daemons: the netem backend)."""
    usages = [process_usage(node.delayd) for node in sim.nodes.values() if node.delayd]
    return sum(u[0] for u in usages if u is not None)


def pull_layout(sim: SimCluster, num_layers: int, chunks: list[int], total_bytes: int, repeats: int) -> dict[str, Any]:
    """One layout across the link: a holder on ``HOLDER`` bound to its address, a puller on ``PULLER``.

    Returns the puller's ``rows`` and ``malloc_tuned``, the bytes it pulled (``pulled_bytes``), what
    ``PULLER``'s ``eth0`` received meanwhile (``rx_bytes``) and the delay daemons' CPU seconds.
    RuntimeError when fewer bytes than were pulled crossed the link; SimnetError when the puller fails
    (with its stderr). The holder is stopped on every path."""
    argv = holder_argv(num_layers, total_bytes, chunks, host=sim.address(HOLDER))
    holder = sim.run(HOLDER, argv, UCX_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        info = read_ready(holder)
        rx0, cpu0 = sim.link_bytes(PULLER).rx, _daemons_cpu_s(sim)
        argv = puller_argv(info, num_layers, chunks, repeats)
        out = sim.check_output(PULLER, argv, UCX_ENV, timeout=PULL_TIMEOUT_S)
        rx, cpu = sim.link_bytes(PULLER).rx - rx0, _daemons_cpu_s(sim) - cpu0
    finally:
        stop_holder(holder)
    result = parse_rows(out)
    pulled = sum(r["pulled_bytes"] for r in result["rows"])
    if rx < pulled:
        raise RuntimeError(f"{PULLER}'s eth0 received {rx} bytes while {pulled} were pulled: not over the link")
    return {**result, "pulled_bytes": pulled, "rx_bytes": rx, "delay_daemon_cpu_s": cpu}


def bench_across_netns(layer_counts: list[int], chunks: list[int], total_bytes: int, repeats: int,
                       profile: str) -> dict[str, Any]:  # fmt: skip
    """Every layout's rows across a fresh two-node cluster with link ``profile`` on both nodes; the
    result has the loopback bench's ``results`` rows (raw TCP, gRPC, bare gRPC; with NIXL also NIXL and
    bare NIXL) plus ``across``,
    ``link_profile`` and ``link`` (``run``: the cluster's name prefix). The cluster is gone when this
    returns or raises."""
    from pdserve.cluster.simnet import NodeSpec, SimCluster

    with SimCluster([NodeSpec(HOLDER), NodeSpec(PULLER)], profile, ray=False) as sim:
        layouts = [pull_layout(sim, n, chunks, total_bytes, repeats) for n in layer_counts]
        link = sim.node(PULLER).profile
        return {
            "benchmark": "transfer", "across": "netns", "link_profile": link.name, "repeats": repeats,
            "malloc_tuned": all(lay["malloc_tuned"] for lay in layouts),
            "link": {"run": sim.prefix, "rate_bps": link.rate_bps, "delay_ms": link.delay_ms,
                     "delay_backend": sim.backend,
                     "holder": {"node": HOLDER, "address": sim.address(HOLDER)},
                     "puller": {"node": PULLER, "address": sim.address(PULLER)},
                     "pulled_bytes": sum(lay["pulled_bytes"] for lay in layouts),
                     "puller_rx_bytes": sum(lay["rx_bytes"] for lay in layouts),
                     "delay_daemon_cpu_s": sum(lay["delay_daemon_cpu_s"] for lay in layouts)},
            "results": [r for lay in layouts for r in lay["rows"]],
        }  # fmt: skip


def report_lines(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The text table: a line for the link, then one per row in the loopback table's style."""
    link = result["link"]
    head = (f"{link['holder']['node']} {link['holder']['address']} -> {link['puller']['node']} "
            f"{link['puller']['address']}, link {result['link_profile']} ({link['rate_bps'] / 1e9:g} Gbit/s, "
            f"{link['delay_ms']:g} ms per node; delay by {link['delay_backend']}); {link['puller_rx_bytes'] / 1e9:.2f}"
            f" GB received for {link['pulled_bytes'] / 1e9:.2f} GB pulled; delay daemons"
            f" {link['delay_daemon_cpu_s']:.1f} CPU s")  # fmt: skip
    return [("across netns", head)] + [
        (
            f"block {r['block_nbytes'] // 1024} KiB, chunk {r['chunk_bytes'] / MiB:g} MiB,"
            f" {r['total_bytes'] / MiB:.0f} MiB",
            f"gRPC {r['grpc']['gbps']:.2f} GB/s | raw TCP {r['raw_tcp']['gbps']:.2f} | bare gRPC"
            f" {r['bare_grpc']['gbps']:.2f} | ours/raw {r['grpc_over_raw']:.2f} bare/raw {r['bare_grpc_over_raw']:.2f}"
            f" ours/bare {r['grpc_over_bare']:.2f} | CPU s/GB holder/puller: ours {_cpu(r['grpc'])}"
            f" raw {_cpu(r['raw_tcp'])} bare {_cpu(r['bare_grpc'])}" + _nixl_text(r),
        )
        for r in result["results"]
    ]


def netns_main(layer_counts: list[int], chunks: list[int], total_bytes: int, repeats: int, profile: str,
               as_json: bool) -> int:  # fmt: skip
    """``--across-netns``: the table or JSON; exit 0 with the reason (and ``{"skipped": reason}`` in
    JSON) where this machine cannot build a simulated cluster, 2 for an unknown link profile."""
    from pdserve.cluster.simnet import PROFILES, simnet_available

    if profile not in PROFILES:
        print(f"pdserve bench transfer: --link-profile: one of {', '.join(PROFILES)}, not {profile!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    if reason := simnet_available():
        print(f"pdserve bench transfer --across-netns: cannot run here: {reason}", file=sys.stderr)
        if as_json:
            print(json.dumps({"skipped": reason}))
        return 0
    result = bench_across_netns(layer_counts, chunks, total_bytes, repeats, profile)
    emit(result, as_json, report_lines(result))
    return 0
