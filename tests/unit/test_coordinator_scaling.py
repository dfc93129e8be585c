"""Elastic DP without processes or sockets: the registry's scale bookkeeping and placement of an added rank (the
coordinator's scale step over real sockets is tests/integration/test_coordinator_scale_step.py)."""

from __future__ import annotations

import pytest

from dpserve_coordinator.placement import NodeResources, PlacementError, plan_added_rank
from dpserve_coordinator.registry import Registry, RegistrationRefused
from dpserve_shared.schema import PROTOCOL_VERSION, EngineLoad, EngineState, ModelInfo, RegisterEngine

MODEL = ModelInfo(name="m", root="-", max_model_len=64, vocab_size=10, tokenizer_json="{}")

pytestmark = pytest.mark.timeout(30)


def _register(registry: Registry, rank: int, engine_id: str, now_s: float = 0.0) -> int:
    return registry.register_engine(
        RegisterEngine(PROTOCOL_VERSION, rank, engine_id, f"tcp://h:{1000 + max(rank, 0)}", MODEL), now_s
    )


def _states(registry: Registry) -> dict[int, EngineState]:
    return {e.rank: e.state for e in registry.topology().engines}


# -- registry -------------------------------------------------------------------------------------------------------


def test_scale_plan_adds_missing_ranks_and_removes_from_the_top():
    registry = Registry(2)
    _register(registry, 0, "e0")
    _register(registry, 1, "e1")
    assert registry.scale_plan(2) == ([], [])
    assert registry.scale_plan(4) == ([2, 3], [])
    assert registry.scale_plan(1) == ([], [1])
    _register(registry, -1, "by-hand")  # takes rank 2
    assert registry.scale_plan(4) == ([3], [])  # rank 2 is served already
    assert registry.scale_plan(1) == ([], [2, 1])


def test_retire_drains_then_remove_frees_the_number():
    registry = Registry(3)
    for rank in range(3):
        _register(registry, rank, f"e{rank}")
    epoch = registry.epoch
    registry.set_target(1)
    registry.retire([2, 1])
    assert registry.topology().data_parallel_size == 1 and registry.epoch > epoch
    assert _states(registry) == {0: EngineState.READY, 1: EngineState.DRAINING, 2: EngineState.DRAINING}
    assert registry.ready_ranks() == [0]
    assert [load.rank for load in registry.load_snapshot(0, False, 0.0).loads] == [0]

    # No hand-started engine gets or takes a retiring number; the retiring engine itself may register again.
    assert _register(registry, -1, "by-hand") == 3
    with pytest.raises(RegistrationRefused, match="rank 1 is being removed by a scale-down"):
        _register(registry, 1, "intruder")
    assert _register(registry, 1, "e1") == 1 and _states(registry)[1] == EngineState.DRAINING

    registry.remove_engine(2)
    registry.remove_engine(1)
    assert sorted(_states(registry)) == [0, 3] and not registry.retiring
    assert _register(registry, -1, "later") == 1  # a removed number is free again


def test_a_late_retiring_engine_comes_back_draining_and_idle_needs_a_load():
    registry = Registry(2, engine_timeout_s=1.0)
    _register(registry, 0, "e0")
    _register(registry, 1, "e1")
    registry.retire([1])
    assert not registry.is_idle(1)  # no load reported yet
    registry.update_load("e1", EngineLoad(rank=1, num_running=2), 0.5)
    assert not registry.is_idle(1)
    registry.update_load("e1", EngineLoad(rank=1), 0.6)
    assert registry.is_idle(1)
    registry.heartbeat("e0", 2.0)
    assert registry.expire(2.0)[1] == [1]
    registry.heartbeat("e1", 2.1)
    assert _states(registry)[1] == EngineState.DRAINING


# -- placement ------------------------------------------------------------------------------------------------------


def _node(ip: str, cpu: float) -> NodeResources:
    return NodeResources(f"id-{ip}", ip, {"CPU": cpu, f"node:{ip}": 1.0})


def test_added_rank_goes_to_the_node_with_most_free_device():
    nodes = [_node("10.0.0.1", 2), _node("10.0.0.2", 6), _node("10.0.0.3", 4)]
    p = plan_added_rank(nodes, "10.0.0.1", 5, may_use_head=True)
    assert (p.rank, p.node_ip, p.is_on_head) == (5, "10.0.0.2", False)
    assert p.bundles == ({"CPU": 1.0, "node:10.0.0.2": 0.001}, {"CPU": 1.0})
    # A tie prefers a node off the head; the head is used when it is the only room.
    tie = plan_added_rank([_node("10.0.0.1", 4), _node("10.0.0.9", 4)], "10.0.0.1", 1, may_use_head=True)
    assert tie.node_ip == "10.0.0.9"
    head = plan_added_rank([_node("10.0.0.1", 3), _node("10.0.0.2", 1)], "10.0.0.1", 1, may_use_head=True)
    assert head.is_on_head and head.node_ip == "10.0.0.1"


def test_added_rank_that_does_not_fit_names_the_resources():
    expected = r"rank 3 does not fit on the Ray nodes: it needs CPU=2, free: 10\.0\.0\.1: CPU=1"
    with pytest.raises(PlacementError, match=expected):
        plan_added_rank([_node("10.0.0.1", 1)], "10.0.0.1", 3, may_use_head=True)
    with pytest.raises(PlacementError, match="non-head Ray nodes"):
        plan_added_rank([_node("10.0.0.1", 8)], "10.0.0.1", 3, may_use_head=False)
