"""Delaying packets: which ways this machine has (netem, or the NFQUEUE daemon of ``delayd.py``), whether
it can build a simulated cluster at all, and handing the nodes' delay daemons their delays."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from functools import cache
from pathlib import Path
from typing import Any

from pdserve.cluster.simnet.errors import SimnetError
from pdserve.cluster.simnet.netns import RUN_PREFIX, ip, netns_exec
from pdserve.cluster.simnet.nodes import SimNode
from pdserve.cluster.simnet.procs import wait_for
from pdserve.cluster.simnet.shaping import PROFILES, tbf_args, tc
from pdserve.procstat import process_alive


def delayd_argv(*args: str) -> list[str]:
    """The command line of the package's hidden ``_delayd`` command (``delayd.delayd_main``)."""
    return [sys.executable, "-m", "pdserve.cluster.simnet", "_delayd", *args]


@cache
def _probe() -> tuple[str | None, tuple[str, ...]]:
    """(why this machine cannot build a simulated cluster or None, the delay backends that work, best
    first); see ``simnet_available`` and ``delay_backends``. Probes with a throwaway namespace, once per
    process."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux network namespaces (this is {sys.platform})", ()
    if os.geteuid() != 0:
        return f"needs root to create network namespaces (euid {os.geteuid()})", ()
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2), not found on PATH", ()
    probe = f"{RUN_PREFIX}probe-{secrets.token_hex(3)}"
    try:
        ip("netns", "add", probe)
    except SimnetError as exc:
        return f"cannot create a network namespace (`ip netns`): {exc}", ()
    try:
        ip("link", "set", "lo", "up", ns=probe)
        tc("qdisc", "add", "dev", "lo", "root", "handle", "10:", *tbf_args(PROFILES["slow"], False), ns=probe)
        netem = tc("qdisc", "add", "dev", "lo", "parent", "10:1", "handle", "20:", "netem", "delay", "1ms",
                   ns=probe, check=False)  # fmt: skip
        nfq = subprocess.run(netns_exec(probe, delayd_argv("--probe")), check=False, capture_output=True, text=True)
        backends = tuple(name for name, ok in (("netem", netem), ("nfqueue", nfq)) if ok.returncode == 0)
        if not backends:
            return (f"no way to delay packets: tc netem: {netem.stderr.strip()}; "
                    f"NFQUEUE: {nfq.stderr.strip()[-300:]}"), ()  # fmt: skip
        return None, backends
    except SimnetError as exc:
        return f"cannot shape links with tc tbf: {exc}", ()
    finally:
        ip("netns", "del", probe, check=False)


def simnet_available() -> str | None:
    """None when this machine can build a simulated cluster, else why not (a reason a test skips with).

    It needs Linux, root, ``ip`` and ``tc``, a kernel that lets it create network namespaces and attach
    tbf there, and a way to delay packets (``delay_backends``); it checks by doing so in a throwaway
    namespace.
    """
    return _probe()[0]


def delay_backends() -> tuple[str, ...]:
    """The ways this machine can delay packets, best first: ``"netem"`` (tc, in the kernel) where the
    kernel has ``sch_netem``, ``"nfqueue"`` (a daemon per node, see ``delayd.py``); empty when none."""
    return _probe()[1]


def push_delays(nodes: Iterable[SimNode], run_dir: Path, run: Callable[..., subprocess.Popen[Any]]) -> None:
    """Hand every node's delay daemon its peers' delays (the sender's link delay plus the node's own),
    starting the daemons the first time (``run(node_name, argv, **popen)`` starts one in its node), and
    wait until every one holds them. The control file's format is ``delayd.read_control``'s."""
    nodes = list(nodes)
    waits = []
    for node in nodes:
        node.delay_gen += 1
        lines = [str(node.delay_gen)] + [
            f"{peer.index} {peer.address} {peer.profile.delay_ms + node.profile.delay_ms}"
            for peer in nodes if peer is not node
        ]  # fmt: skip
        control = run_dir / f"n{node.index}-delay"
        control.write_text("\n".join(lines) + "\n")
        if node.delayd is None:
            with open(_log(run_dir, node), "ab") as out:
                argv = delayd_argv("--control", str(control))
                node.delayd = run(node.name, argv, stdout=out, stderr=subprocess.STDOUT).pid
            waits.append((node, "ready"))
        else:
            os.kill(node.delayd, signal.SIGHUP)
            waits.append((node, f"applied {node.delay_gen}"))
    for node, line in waits:
        _wait_delayd(node, _log(run_dir, node), line)


def _log(run_dir: Path, node: SimNode) -> Path:
    return run_dir / f"n{node.index}-delay.log"


def _wait_delayd(node: SimNode, log: Path, line: str) -> None:
    """Wait until the node's daemon prints ``line`` in ``log``; SimnetError with the log if it exits."""
    pid = node.delayd
    assert pid is not None

    def done() -> bool:
        text = log.read_text(errors="replace")
        if not process_alive(pid):
            raise SimnetError(f"the delay daemon of {node.name} exited:\n{text[-2000:]}")
        return line in text.splitlines()

    wait_for(done, 30, f"the delay daemon of {node.name} ({log})", interval=0.01)
