"""`pdserve bench transfer --across-netns` at its smallest: the pulls cross two network namespaces.

A smoke run (8 MiB, one layout, one chunk size, one round) on a real simulated cluster: every method
moved the bytes (the bench checks each against the holder's digest), our pull went by gRPC between
two host identities although the puller offers shared memory (and, where NIXL loads, by NIXL over
TCP too, with a bare NIXL read beside it), n2's eth0 received what was pulled, and
nothing of the run (namespace, link, run directory, process) is left afterwards. No timing asserted.
Needs root and `ip netns`; skips with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.simnet import simnet_available
from pdserve.kvtransfer.nixl import nixl_installed
from tests.support import REPO


@pytest.fixture(autouse=True, scope="module")
def _needs_simnet() -> None:
    if reason := simnet_available():
        pytest.skip(reason)


def leftovers(prefix: str, addresses: list[str]) -> list[str]:
    """What of run ``prefix`` still exists: its namespaces and root-namespace links (``ip``), its run
    directory, and live processes whose command line names the run or one of its node ``addresses``
    (the holder's ``--host``, the puller's ``--pull-from`` JSON, the delay daemons' control files)."""
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    left = [line for line in out.splitlines() if f"{prefix}-" in line]
    if (Path("/tmp/pds-simnet") / prefix).exists():
        left.append(f"/tmp/pds-simnet/{prefix}")
    marks = [prefix, *(f'"{a}"' for a in addresses), *(f"--host\0{a}" for a in addresses)]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if any(m in cmdline for m in marks):
            left.append(f"pid {proc.name}: {cmdline.replace(chr(0), ' ')[:200]}")
    return left


def test_transfer_bench_across_netns_pulls_over_the_link_and_leaves_nothing() -> None:
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", "transfer", "--total-mb", "8",
                        "--layers", "4", "--chunk-mb", "1", "--repeats", "1", "--across-netns", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["across"] == "netns" and out["link_profile"] == "fast" and out["repeats"] == 1
    link = out["link"]
    holder, puller = link["holder"], link["puller"]
    assert (holder["node"], puller["node"]) == ("n1", "n2") and holder["address"] != puller["address"]
    [row] = out["results"]
    assert row["total_bytes"] == 8 * 1024 * 1024 and row["num_chunks"] == 8
    nixl = nixl_installed()  # then also our NIXL pull and the bare NIXL read, over TCP on the link
    for method in ("raw_tcp", "grpc", "bare_grpc", *(["nixl_bare"] if nixl else [])):
        assert len(row[method]["seconds"]) == 1 and row[method]["gbps"] > 0
    assert "memcpy" not in row and "shm_over_raw" not in row  # no same-host path across namespaces
    assert set(row["transports"]) == {"grpc"} | ({"nixl"} if nixl else set())
    for t in row["transports"].values():
        assert t["gbps"] > 0 and t["over_raw"] > 0 and "over_memcpy" not in t
    assert row["grpc_over_raw"] > 0 and row["bare_grpc_over_raw"] > 0
    assert not nixl or row["transports"]["nixl"]["over_bare_nixl"] > 0
    # Our pull offered shared memory and still went by gRPC (or NIXL): each node is its own host.
    assert row["pulled_by"] == (["grpc", "nixl"] if nixl else ["grpc"])
    ids = row["host_ids"]
    assert ids["holder"] != ids["puller"]
    assert ids["holder"].startswith(f"{link['run']}-n1/") and ids["puller"].startswith(f"{link['run']}-n2/")
    # Three methods (five with NIXL), an untimed round and one timed: six (ten) tensors crossed n2's eth0.
    assert row["pulled_bytes"] == link["pulled_bytes"] == (10 if nixl else 6) * row["total_bytes"]
    assert link["puller_rx_bytes"] >= link["pulled_bytes"]
    assert leftovers(link["run"], [holder["address"], puller["address"]]) == []
