"""placement_problem: a role that no alive node can host is named with what the nodes offer."""

from __future__ import annotations

from pdserve.cluster.placement import placement_problem

NODES = [
    {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 4.0, "node:10.0.0.1": 1.0}},
    {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "GPU": 2.0, "decode_node": 2.0}},
    {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 8.0, "prefill_node": 1.0}},
]


def test_a_node_with_the_resources_hosts_the_role() -> None:
    assert placement_problem("decode", NODES, {"CPU": 1, "GPU": 1, "decode_node": 1}) is None
    assert placement_problem("prefill", NODES, {"CPU": 1, "GPU": 0}) is None  # zero amounts ask for nothing


def test_no_node_fits_names_the_need_and_the_offers() -> None:
    problem = placement_problem("prefill", NODES, {"CPU": 1, "GPU": 0, "prefill_node": 1})
    # The only node with prefill_node is dead; node:* resources are Ray's own, not shown.
    assert problem == ("no node of the Ray cluster can host a prefill worker: it needs CPU=1, prefill_node=1; the "
                       "nodes offer 10.0.0.1: CPU=4; 10.0.0.2: CPU=8, GPU=2, decode_node=2")  # fmt: skip
    assert placement_problem("decode", NODES, {"CPU": 16}) is not None  # totals: more than any node has
    assert placement_problem("decode", [], {"CPU": 1}).endswith("nothing (no node is alive)")


def test_a_tensor_parallel_worker_asks_one_bundle_per_rank_and_its_labels_once() -> None:
    from pdserve.cluster.placement import rank_bundles

    assert rank_bundles(3, 2.0, 0.0, {"decode_node": 1, "unused": 0}) == [
        {"CPU": 2.0, "decode_node": 1},
        {"CPU": 2.0},
        {"CPU": 2.0},
    ]
    assert rank_bundles(1, 1.0, 1.0, {}) == [{"CPU": 1.0, "GPU": 1.0}]
