"""Where workers may run: check, before any actor is created, that some node of the Ray cluster
can host each role (its CPUs, GPUs and the custom resources the config asks for). Without this
an actor that fits nowhere waits forever in Ray's queue, and ``up`` would wait with it. And the
placement group that holds a tensor-parallel worker's ranks together on one node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _fits(offer: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(offer.get(name, 0.0) >= amount for name, amount in need.items() if amount > 0)


def placement_problem(role: str, nodes: Sequence[Mapping[str, Any]], need: Mapping[str, float]) -> str | None:
    """None when an alive node of ``nodes`` (``ray.nodes()``: dicts with ``Alive``, ``Resources``,
    ``NodeManagerAddress``) offers everything in ``need`` (resource -> amount, totals not free
    amounts: a busy node frees up, a missing resource never appears); else a message naming what
    the role needs and what each node offers."""
    alive = [n for n in nodes if n.get("Alive")]
    if any(_fits(n.get("Resources", {}), need) for n in alive):
        return None
    wanted = ", ".join(f"{k}={v:g}" for k, v in sorted(need.items()) if v > 0)
    offers = "; ".join(
        f"{n.get('NodeManagerAddress', '?')}: "
        + ", ".join(f"{k}={v:g}" for k, v in sorted(n.get("Resources", {}).items()) if not k.startswith("node:"))
        for n in alive
    )  # fmt: skip
    return (f"no node of the Ray cluster can host a {role} worker: it needs {wanted}; the nodes offer "
            f"{offers or 'nothing (no node is alive)'}")  # fmt: skip


def rank_bundles(ranks: int, cpus: float, gpus: float, custom: Mapping[str, float]) -> list[dict[str, float]]:
    """The placement-group bundles of a worker of ``ranks`` tensor-parallel ranks: one per rank, with
    the CPUs and GPUs of one rank; the role's custom resources (a node label) in rank 0's only, as a
    worker asks for them once. Zero amounts are left out (Ray refuses them in a bundle)."""
    one = {name: amount for name, amount in (("CPU", cpus), ("GPU", gpus)) if amount > 0}
    labels = {name: amount for name, amount in custom.items() if amount > 0}
    return [{**one, **labels}] + [dict(one) for _ in range(ranks - 1)]


def worker_placement(name: str, ranks: int, cpus: float, gpus: float,
                     custom: Mapping[str, float]) -> tuple[dict[str, Any], Any]:  # fmt: skip
    """Ray options for a worker's own actor, and the placement group it needs (None for one rank).

    A worker of N > 1 ranks is N actors in one placement group of N bundles packed on one node
    (``STRICT_PACK``: the ranks share the KV cache's memory and a loopback group): its own actor in
    bundle 0, ranks 1..N-1 in the others (``engine/parallel/rank_actors.py``). The caller removes
    the group when the worker is done with (``ray.util.remove_placement_group``); a restarted worker
    actor comes back into its bundle."""
    labels = {name: amount for name, amount in custom.items() if amount > 0}
    if ranks == 1:
        return dict(num_cpus=cpus, num_gpus=gpus, resources=labels), None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = rank_bundles(ranks, cpus, gpus, custom)
    group = placement_group(bundles, strategy="STRICT_PACK", name=name)
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return dict(num_cpus=cpus, num_gpus=gpus, resources=labels, scheduling_strategy=strategy), group
