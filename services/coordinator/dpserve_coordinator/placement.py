"""Placement planning: which node each rank goes to and which Ray bundles it reserves. No Ray imports.

One STRICT_PACK placement group per rank. Bundle 0 is the rank's device (`{"GPU": 1}` when the cluster has
GPUs, else `{"CPU": 1}`), bundle 1 is `{"CPU": 1}` for the engine-host actor. The first
`data_parallel_size_local` ranks are pinned to the head node (the node the coordinator runs on) through a tiny
amount of its `node:<ip>` resource; the others go to the other nodes (each pinned the same way to the node
chosen for it here). A layout that cannot
fit fails here, before anything is reserved, with a message that names the missing resources.

A rank added later by a scale-up (`plan_added_rank`) is planned alone from the cluster's free resources at that
moment: the node with the most free device resource takes it, the head included unless the deployment was
started API-only on the head (`data_parallel_size_local` 0); `data_parallel_size_local` applies at start only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

DEVICE_BUNDLE = 0
ACTOR_BUNDLE = 1
_HEAD_PIN = 0.001


class PlacementError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class NodeResources:
    node_id: str
    node_ip: str
    resources: Mapping[str, float]  # free resources


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    rank: int
    node_ip: str
    is_on_head: bool
    bundles: tuple[dict[str, float], ...]


def nodes_from_ray(ray_nodes: Iterable[Mapping], available: Mapping[str, Mapping[str, float]] | None = None):
    """`ray.nodes()` entries (plus optional per-node free resources by node id) -> alive NodeResources."""
    nodes = []
    for node in ray_nodes:
        if not node.get("Alive", node.get("alive", False)):
            continue
        node_id = node["NodeID"]
        resources = (available or {}).get(node_id, node.get("Resources", {}))
        nodes.append(NodeResources(node_id, node["NodeManagerAddress"], dict(resources)))
    return nodes


def rank_bundles(use_gpu: bool, head_ip: str | None) -> tuple[dict[str, float], ...]:
    device = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
    if head_ip is not None:
        device[f"node:{head_ip}"] = _HEAD_PIN
    return (device, {"CPU": 1.0})


def _needs(bundles: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            total[key] = total.get(key, 0.0) + amount
    return total


def _fits(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(free.get(key, 0.0) + 1e-9 >= amount for key, amount in need.items())


def _take(free: dict[str, float], need: Mapping[str, float]) -> None:
    for key, amount in need.items():
        free[key] = free.get(key, 0.0) - amount


def _describe(need: Mapping[str, float]) -> str:
    return ", ".join(f"{key}={amount:g}" for key, amount in sorted(need.items()) if not key.startswith("node:"))


def plan_placement(
    nodes: list[NodeResources], head_ip: str, data_parallel_size: int, data_parallel_size_local: int
) -> list[RankPlacement]:
    """Place ranks 0..size-1: the first `data_parallel_size_local` on the head, the rest elsewhere."""
    if not 0 <= data_parallel_size_local <= data_parallel_size:
        raise PlacementError(
            f"--data-parallel-size-local ({data_parallel_size_local}) must be between 0 and "
            f"--data-parallel-size ({data_parallel_size})"
        )
    head = next((n for n in nodes if n.node_ip == head_ip), None)
    if head is None:
        raise PlacementError(f"the head node {head_ip} is not among the alive Ray nodes {[n.node_ip for n in nodes]}")
    use_gpu = any(n.resources.get("GPU", 0) > 0 for n in nodes)
    free = {n.node_id: dict(n.resources) for n in nodes}
    plan: list[RankPlacement] = []

    head_bundles = rank_bundles(use_gpu, head_ip)
    head_need = _needs(head_bundles)
    for rank in range(data_parallel_size_local):
        if not _fits(free[head.node_id], head_need):
            total = {k: v * data_parallel_size_local for k, v in _needs(rank_bundles(use_gpu, None)).items()}
            raise PlacementError(
                f"the head node {head_ip} cannot host {data_parallel_size_local} ranks: they need {_describe(total)}, "
                f"it has {_describe(head.resources)} free (each rank reserves {_describe(head_need)}); "
                "lower --data-parallel-size-local or add resources"
            )
        _take(free[head.node_id], head_need)
        plan.append(RankPlacement(rank, head_ip, True, head_bundles))

    # Ranks off the head are pinned to the node chosen here too: an unpinned STRICT_PACK group could be put on the
    # head by Ray whenever the head has free CPUs (with `--data-parallel-size-local 0` it would).
    other_need = _needs(rank_bundles(use_gpu, None))
    others = sorted((n for n in nodes if n.node_id != head.node_id), key=lambda n: n.node_ip)
    for rank in range(data_parallel_size_local, data_parallel_size):
        # Spread: the node with the most free device resource takes the next rank (ties: lowest IP).
        device_key = "GPU" if use_gpu else "CPU"
        fitting = [n for n in others if _fits(free[n.node_id], other_need)]
        node = max(fitting, key=lambda n: free[n.node_id].get(device_key, 0.0), default=None)
        if node is None:
            missing = list(range(rank, data_parallel_size))
            have = "; ".join(f"{n.node_ip}: {_describe(free[n.node_id]) or 'nothing'}" for n in others) or "none"
            raise PlacementError(
                f"ranks {missing} do not fit on the non-head Ray nodes: each needs {_describe(other_need)}, "
                f"free on other nodes: {have}; add Ray nodes or raise --data-parallel-size-local"
            )
        _take(free[node.node_id], other_need)
        plan.append(RankPlacement(rank, node.node_ip, False, rank_bundles(use_gpu, node.node_ip)))
    return plan


def plan_added_rank(nodes: list[NodeResources], head_ip: str, rank: int, may_use_head: bool) -> RankPlacement:
    """Place one rank added at runtime on the node with the most free device resource (ties: off the head, then
    the lowest IP); `nodes` carry the resources free now (other ranks' groups already taken out)."""
    use_gpu = any(n.resources.get("GPU", 0) > 0 for n in nodes)
    need = _needs(rank_bundles(use_gpu, None))
    device_key = "GPU" if use_gpu else "CPU"
    candidates = sorted((n for n in nodes if may_use_head or n.node_ip != head_ip), key=lambda n: n.node_ip)
    fitting = [n for n in candidates if _fits(n.resources, need)]
    node = max(fitting, key=lambda n: (n.resources.get(device_key, 0.0), n.node_ip != head_ip), default=None)
    if node is None:
        have = "; ".join(f"{n.node_ip}: {_describe(n.resources) or 'nothing'}" for n in candidates) or "none"
        where = "Ray nodes" if may_use_head else "non-head Ray nodes (the head is API-only)"
        raise PlacementError(
            f"rank {rank} does not fit on the {where}: it needs {_describe(need)}, free: {have}; "
            "add Ray nodes or free resources"
        )
    is_on_head = node.node_ip == head_ip
    return RankPlacement(rank, node.node_ip, is_on_head, rank_bundles(use_gpu, node.node_ip))
