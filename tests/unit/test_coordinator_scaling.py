"""Elastic DP without processes: the registry's scale bookkeeping, placement of an added rank, and the
coordinator's scale step over real ZMQ sockets with a launcher that starts nothing."""

from __future__ import annotations

import asyncio

import pytest

from dpserve_coordinator import scaling
from dpserve_coordinator.launcher import EngineLauncher
from dpserve_coordinator.placement import NodeResources, PlacementError, plan_added_rank
from dpserve_coordinator.registry import Registry, RegistrationRefused
from dpserve_shared.schema import (
    PROTOCOL_VERSION,
    EngineLoad,
    EngineState,
    EngineStats,
    RegisterAck,
    RegisterEngine,
    ScaleAck,
    ScaleRequest,
    Shutdown,
)
from tests.unit.test_coordinator_server import MODEL, _dealer, _recv, _send, running_coordinator

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


# -- the coordinator's scale step -----------------------------------------------------------------------------------


class FakeLauncher(EngineLauncher):
    """Starts nothing; a rank's "process" exits when the test says so."""

    def __init__(self):
        self.started: list[int] = []
        self.stopped: list[int] = []
        self.exited: dict[int, asyncio.Event] = {}

    async def start(self, rank: int) -> None:
        self.started.append(rank)
        self.exited[rank] = asyncio.Event()

    async def wait_exit(self, rank: int) -> str:
        await self.exited[rank].wait()
        return "exited"

    async def stop(self, rank: int, timeout_s: float) -> None:
        self.stopped.append(rank)

    async def close(self, timeout_s: float) -> None:
        pass

    def kill_now(self) -> None:
        pass


def _ranks(ack: ScaleAck) -> dict[int, EngineState]:
    return {e.rank: e.state for e in ack.topology.engines}


async def _engine(ctx, addr: str, rank: int):
    engine = _dealer(ctx, f"engine-{rank}", addr)
    await _send(engine, RegisterEngine(PROTOCOL_VERSION, rank, f"engine-{rank}", f"tcp://h:{rank}", MODEL))
    assert (await _recv(engine, RegisterAck)).accepted
    return engine


async def _scale_scenario() -> None:
    launcher = FakeLauncher()
    async with running_coordinator(launcher) as (settings, coordinator, task, ctx):
        admin = _dealer(ctx, "scale-1", settings.control_addr)
        await _send(admin, ScaleRequest(2))
        early = await _recv(admin, ScaleAck)
        assert not early.accepted and "still starting its ranks" in early.error
        engine0 = await _engine(ctx, settings.control_addr, 0)
        await asyncio.sleep(0.5)  # until the start-up waiter (polling every 0.1 s) saw rank 0 READY

        for bad, message in ((0, "between 1 and 1024, got 0"), (scaling.MAX_DATA_PARALLEL_SIZE + 1, "got 1025")):
            await _send(admin, ScaleRequest(bad))
            refused = await _recv(admin, ScaleAck)
            assert not refused.accepted and refused.is_complete and message in refused.error

        # Up: accepted at once with rank 1 STARTING; a second request is refused while it runs.
        await _send(admin, ScaleRequest(2))
        ack = await _recv(admin, ScaleAck)
        assert ack.accepted and not ack.is_complete and ack.pub_addr == coordinator.pub_addr
        assert _ranks(ack) == {0: EngineState.READY, 1: EngineState.STARTING}
        other = _dealer(ctx, "scale-2", settings.control_addr)
        await _send(other, ScaleRequest(3))
        busy = await _recv(other, ScaleAck)
        assert not busy.accepted and "a scale to 2 is in progress" in busy.error
        engine1 = await _engine(ctx, settings.control_addr, 1)
        done = await _recv(admin, ScaleAck)
        assert done.accepted and done.is_complete and done.data_parallel_size == 2
        assert _ranks(done) == {0: EngineState.READY, 1: EngineState.READY}
        assert launcher.started == [0, 1]

        # Down: rank 1 DRAINING; Shutdown only once its load is 0; removed once its process exited.
        await _send(engine1, EngineStats(EngineLoad(rank=1, num_running=1)))
        await _send(admin, ScaleRequest(1, drain_timeout_s=30))
        ack = await _recv(admin, ScaleAck)
        assert ack.accepted and _ranks(ack) == {0: EngineState.READY, 1: EngineState.DRAINING}
        with pytest.raises(TimeoutError):
            await _recv(engine1, Shutdown, timeout_s=1.0)  # still running a request
        await _send(engine1, EngineStats(EngineLoad(rank=1)))
        shutdown = await _recv(engine1, Shutdown)
        assert shutdown.drain and shutdown.reason == "scale-down" and 25 < shutdown.drain_timeout_s <= 30
        assert 1 in coordinator.registry.engines and not launcher.stopped
        launcher.exited[1].set()
        done = await _recv(admin, ScaleAck)
        assert done.accepted and done.is_complete and _ranks(done) == {0: EngineState.READY}
        assert launcher.stopped == [1] and not coordinator.supervisor.is_watching(1)
        await asyncio.sleep(1.5)
        assert launcher.started == [0, 1], "a removed rank must not be restarted"
        engine0.close(0)

        coordinator.stop()
        assert await asyncio.wait_for(task, 10) == 0


def test_scale_up_and_down_over_real_sockets(monkeypatch):
    monkeypatch.setattr(scaling, "DRAIN_SETTLE_S", 0.2)
    asyncio.run(_scale_scenario())
