"""Where workers may run: check, before any actor is created, that some node of the Ray cluster
can host each role (its CPUs, GPUs and the custom resources the config asks for). Without this
an actor that fits nowhere waits forever in Ray's queue, and ``up`` would wait with it."""

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
