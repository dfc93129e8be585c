"""ThreadBudget: the node's cores shared by the ranks on it that have work."""

import pytest
import torch
from dpserve_shared.schema import CoreUse, EngineInfo, EngineLoad, EngineState, Topology

from dpserve_engine.threads import NOTICE_HOLD_S, ThreadBudget

pytestmark = pytest.mark.timeout(30)


def topology(*engines: tuple[int, str, EngineState]) -> Topology:
    return Topology(epoch=1, engines=[EngineInfo(r, f"e{r}", f"tcp://{ip}:1", state, ip) for r, ip, state in engines])


def load(rank: int, running: int = 0, waiting: int = 0) -> EngineLoad:
    return EngineLoad(rank=rank, num_running=running, num_waiting=waiting)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cores_split_among_busy_neighbours_on_the_same_node():
    budget = ThreadBudget(True, "10.0.0.1", cores=4)
    budget.on_topology(
        topology(
            (0, "10.0.0.1", EngineState.READY),
            (1, "10.0.0.1", EngineState.READY),
            (2, "10.0.0.1", EngineState.DRAINING),
            (3, "10.0.0.2", EngineState.READY),  # another node: never counted
            (4, "10.0.0.1", EngineState.DEAD),
        ),
        rank=0,
    )
    assert budget.neighbours == {1, 2}

    def wanted(loads):
        budget.on_loads(loads)
        return budget.wanted()

    assert wanted([load(0, running=3), load(1), load(2), load(3, running=9)]) == 4  # alone with work
    assert wanted([load(0, running=3), load(1, waiting=1), load(2), load(3, running=9)]) == 2
    assert wanted([load(1, running=1), load(2, running=1), load(4, running=1)]) == 1  # 4 // 3


def test_applies_only_when_enabled(restore_threads):
    torch.set_num_threads(1)
    fixed = ThreadBudget(False, "10.0.0.1", cores=2)  # --num-threads given: never changes
    fixed.on_topology(topology((0, "10.0.0.1", EngineState.READY)), rank=0)
    fixed.on_loads([load(0, running=1)])
    assert torch.get_num_threads() == 1
    adaptive = ThreadBudget(True, "10.0.0.1", cores=2)
    adaptive.on_topology(topology((0, "10.0.0.1", EngineState.READY), (1, "10.0.0.1", EngineState.READY)), rank=0)
    adaptive.on_loads([load(0, running=1), load(1)])
    assert torch.get_num_threads() == 2 and adaptive.current == 2
    adaptive.on_loads([load(0, running=1), load(1, running=1)])
    assert torch.get_num_threads() == 1


def two_ranks(cores: int = 2) -> ThreadBudget:
    budget = ThreadBudget(False, "10.0.0.1", cores=cores)  # not applied: the choice alone
    budget.on_topology(topology((0, "10.0.0.1", EngineState.READY), (1, "10.0.0.1", EngineState.READY),
                                (2, "10.0.0.2", EngineState.READY)), rank=0)  # fmt: skip
    return budget


def test_a_neighbours_notice_outranks_older_snapshots_for_a_while():
    budget = two_ranks()
    assert budget.addresses == {1: "tcp://10.0.0.1:1"}  # where its notices go: the ranks on this node only
    budget.on_loads([load(1, running=1)], now=100.0)
    assert budget.wanted() == 1
    budget.on_notice(CoreUse(1, busy=False), now=100.05)  # it ran out of work: every core is ours at once
    assert budget.wanted() == 2
    budget.on_loads([load(1, running=1)], now=100.2)  # a snapshot from before the notice: ignored
    assert budget.wanted() == 2
    budget.on_loads([load(1, running=1)], now=100.05 + NOTICE_HOLD_S)  # after the hold the snapshots rule again
    assert budget.wanted() == 1
    budget.on_notice(CoreUse(2, busy=True), now=101.0)  # another node's rank: not a neighbour
    budget.on_notice(CoreUse(7, busy=True), now=101.0)  # not in the topology
    budget.on_loads([load(1)], now=101.0)
    assert budget.wanted() == 2


def test_a_neighbour_that_leaves_the_topology_no_longer_counts():
    budget = two_ranks(cores=4)
    budget.on_notice(CoreUse(1, busy=True), now=1.0)
    assert budget.wanted() == 2
    budget.on_topology(topology((0, "10.0.0.1", EngineState.READY), (1, "10.0.0.1", EngineState.DEAD)), rank=0)
    assert budget.neighbours == frozenset() and budget.wanted() == 4
