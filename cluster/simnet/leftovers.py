"""Runs by prefix: which are on this machine, which nothing owns any more, and removing one (what a
crashed run left behind; ``scripts/simcluster.sh down``)."""

from __future__ import annotations

import shutil

from pdserve.cluster.simnet.errors import SimnetError
from pdserve.cluster.simnet.netns import RUN_RE, remove_network, run_links, run_namespaces, run_of
from pdserve.cluster.simnet.procs import empty_netns
from pdserve.cluster.simnet.state import BASE_DIR, read_state
from pdserve.procstat import process_alive


def list_runs() -> list[str]:
    """Prefixes of every run with something on this machine: a namespace, a link or a run directory."""
    found = {run_of(n) for n in run_namespaces() + run_links()}
    if BASE_DIR.is_dir():
        found |= {d.name for d in BASE_DIR.iterdir() if RUN_RE.match(d.name)}
    return sorted(r for r in found if r)


def run_is_stale(prefix: str) -> bool:
    """True when nothing owns the run any more: its owner process is gone and it was not detached."""
    state = read_state(prefix)
    if state is None:
        return True
    owner = state.get("owner", {})
    return not owner.get("detached") and not process_alive(owner.get("pid", -1), owner.get("start"))


def cleanup(prefix: str) -> list[str]:
    """Remove everything of run ``prefix`` (``pds-<6 hex>``), e.g. what a crashed run left: the processes in
    its namespaces (by pid), its links, bridge, namespaces and run directory. Returns what remains."""
    if not RUN_RE.match(prefix):
        raise SimnetError(f"not a run prefix: {prefix!r} (expected pds-<6 hex>)")
    problems = []
    namespaces = run_namespaces(prefix)
    for ns in namespaces:
        try:
            empty_netns(ns, grace=1.0)
        except SimnetError as exc:
            problems.append(str(exc))
    veths = [link for link in run_links(prefix) if link != f"{prefix}-br"]
    problems += remove_network(prefix, veths, f"{prefix}-br", namespaces)
    shutil.rmtree(BASE_DIR / prefix, ignore_errors=True)
    return problems
