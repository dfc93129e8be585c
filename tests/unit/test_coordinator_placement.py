"""Placement planning from fake Ray node lists: which node each rank lands on and what it reserves."""

from __future__ import annotations

import pytest

from dpserve_coordinator.placement import NodeResources, PlacementError, nodes_from_ray, plan_placement

HEAD = "10.0.0.1"


def node(ip: str, **resources: float) -> NodeResources:
    return NodeResources(node_id=f"id-{ip}", node_ip=ip, resources={f"node:{ip}": 1.0, **resources})


def test_cpu_cluster_all_ranks_on_the_head():
    plan = plan_placement([node(HEAD, CPU=5)], HEAD, data_parallel_size=2, data_parallel_size_local=2)
    assert [p.rank for p in plan] == [0, 1]
    for p in plan:
        assert p.node_ip == HEAD and p.is_on_head
        assert p.bundles == ({"CPU": 1.0, f"node:{HEAD}": 0.001}, {"CPU": 1.0})


def test_gpu_cluster_uses_gpu_device_bundles():
    plan = plan_placement([node(HEAD, CPU=8, GPU=2)], HEAD, 2, 2)
    assert plan[0].bundles == ({"GPU": 1.0, f"node:{HEAD}": 0.001}, {"CPU": 1.0})


def test_local_ranks_first_then_other_nodes_spread_by_free_resources():
    nodes = [node("10.0.0.3", CPU=4), node(HEAD, CPU=4), node("10.0.0.2", CPU=4)]
    plan = plan_placement(nodes, HEAD, data_parallel_size=5, data_parallel_size_local=1)
    assert [(p.rank, p.node_ip, p.is_on_head) for p in plan] == [
        (0, HEAD, True),
        (1, "10.0.0.2", False),
        (2, "10.0.0.3", False),
        (3, "10.0.0.2", False),
        (4, "10.0.0.3", False),
    ]
    # Pinned to the chosen node, so Ray cannot move the group onto the head.
    assert plan[1].bundles == ({"CPU": 1.0, "node:10.0.0.2": 0.001}, {"CPU": 1.0})


def test_size_local_zero_keeps_the_head_free():
    nodes = [node(HEAD, CPU=16), node("10.0.0.2", CPU=4)]
    plan = plan_placement(nodes, HEAD, data_parallel_size=2, data_parallel_size_local=0)
    assert {p.node_ip for p in plan} == {"10.0.0.2"}


def test_head_too_small_names_what_is_missing():
    with pytest.raises(PlacementError, match=r"head node 10\.0\.0\.1 cannot host 2 ranks: they need CPU=4.*CPU=3"):
        plan_placement([node(HEAD, CPU=3)], HEAD, 2, 2)


def test_no_gpu_left_on_other_nodes_names_the_ranks():
    nodes = [node(HEAD, CPU=8, GPU=1), node("10.0.0.2", CPU=8, GPU=1)]
    with pytest.raises(PlacementError, match=r"ranks \[2\] do not fit .* GPU=1.*10\.0\.0\.2: CPU=7, GPU=0"):
        plan_placement(nodes, HEAD, data_parallel_size=3, data_parallel_size_local=1)


def test_ranks_beyond_local_never_go_to_the_head():
    with pytest.raises(PlacementError, match=r"ranks \[1\] do not fit"):
        plan_placement([node(HEAD, CPU=64)], HEAD, data_parallel_size=2, data_parallel_size_local=1)


def test_bad_size_local_is_refused():
    with pytest.raises(PlacementError, match="between 0 and"):
        plan_placement([node(HEAD, CPU=64)], HEAD, data_parallel_size=2, data_parallel_size_local=3)


def test_nodes_from_ray_skips_dead_nodes_and_prefers_free_resources():
    ray_nodes = [
        {"NodeID": "a", "NodeManagerAddress": HEAD, "Alive": True, "Resources": {"CPU": 8.0}},
        {"NodeID": "b", "NodeManagerAddress": "10.0.0.2", "Alive": False, "Resources": {"CPU": 8.0}},
    ]
    nodes = nodes_from_ray(ray_nodes, available={"a": {"CPU": 2.0}})
    assert nodes == [NodeResources("a", HEAD, {"CPU": 2.0})]
