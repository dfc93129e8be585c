"""Elastic DP: the coordinator's scale step (ScaleRequest -> two ScaleAcks, scale up, drain and scale down) over real
ZMQ sockets, in-process, with a launcher that starts nothing. (Moved from tests/unit/test_coordinator_scaling.py,
whose registry and placement tests stay unit tests.)"""

from __future__ import annotations

import asyncio

import pytest

from dpserve_coordinator import scaling
from dpserve_coordinator.launcher import EngineLauncher
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
from tests.integration.test_coordinator_server import MODEL, _dealer, _recv, _send, running_coordinator

pytestmark = pytest.mark.timeout(30)


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
        for _ in range(200):  # until the start-up waiter (polling every 0.1 s) saw rank 0 READY
            if coordinator.scaler._refusal is None:
                break
            await asyncio.sleep(0.05)

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
