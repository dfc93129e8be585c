"""The coordinator process logic in-process over real ZMQ sockets, with a launcher that starts nothing."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
import zmq.asyncio

from dpserve_coordinator.launcher import EngineLauncher
from dpserve_coordinator.server import Coordinator
from dpserve_coordinator.settings import CoordinatorSettings
from dpserve_shared.codec import encode, from_coordinator_decoder
from dpserve_shared.schema import (
    PROTOCOL_VERSION,
    EngineLoad,
    EngineState,
    EngineStats,
    FrontendGone,
    LoadSnapshot,
    ModelInfo,
    RegisterAck,
    RegisterEngine,
    RegisterFrontend,
    Shutdown,
    Topology,
    Unregister,
)
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(30)

MODEL = ModelInfo(name="m", root="-", max_model_len=64, vocab_size=10, tokenizer_json="{}")


class FakeLauncher(EngineLauncher):
    def __init__(self):
        self.started: list[int] = []
        self.closed = False
        self._never = asyncio.Event()

    async def start(self, rank: int) -> None:
        self.started.append(rank)

    async def wait_exit(self, rank: int) -> str:
        await self._never.wait()
        return ""

    async def close(self, timeout_s: float) -> None:
        self.closed = True

    def kill_now(self) -> None:
        self.closed = True


async def _recv(sock, kind, timeout_s: float = 5.0):
    decoder = from_coordinator_decoder()
    async with asyncio.timeout(timeout_s):
        while True:
            msg = decoder.decode(await sock.recv())
            if isinstance(msg, kind):
                return msg


def _dealer(ctx, identity: str, addr: str):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


@contextlib.asynccontextmanager
async def running_coordinator(launcher: EngineLauncher):
    """A DP=1 coordinator running as a task, and a ZMQ context; both cancelled and destroyed on the way out."""
    settings = CoordinatorSettings(data_parallel_size=1, data_parallel_backend="mp",
                                   data_parallel_rpc_port=free_port(), engine_startup_timeout_s=10)
    coordinator = Coordinator(settings, launcher)
    task = asyncio.create_task(coordinator.run())
    ctx = zmq.asyncio.Context()
    try:
        yield settings, coordinator, task, ctx
    finally:
        if not task.done():
            task.cancel()
        ctx.destroy(0)


async def _scenario() -> None:
    launcher = FakeLauncher()
    async with running_coordinator(launcher) as (settings, coordinator, task, ctx):
        engine = _dealer(ctx, "engine-x", settings.control_addr)
        await engine.send(encode(RegisterEngine(PROTOCOL_VERSION + 1, 0, "engine-x", "tcp://h:1", MODEL)))
        refused = await _recv(engine, RegisterAck)
        assert not refused.accepted
        assert f"peer speaks {PROTOCOL_VERSION + 1}, this side speaks {PROTOCOL_VERSION}" in refused.error

        await engine.send(encode(RegisterEngine(PROTOCOL_VERSION, 0, "engine-x", "tcp://h:1", MODEL)))
        ack = await _recv(engine, RegisterAck)
        assert ack.accepted and ack.rank == 0 and ack.pub_addr == coordinator.pub_addr
        assert launcher.started == [0]

        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(ack.pub_addr)
        frontend = _dealer(ctx, "fe-1", settings.control_addr)
        await frontend.send(encode(RegisterFrontend(PROTOCOL_VERSION, "fe-1")))
        frontend_ack = await _recv(frontend, RegisterAck)
        assert frontend_ack.topology.model == MODEL
        assert [(e.rank, e.state, e.input_addr) for e in frontend_ack.topology.engines] == [
            (0, EngineState.READY, "tcp://h:1")
        ]
        assert (await _recv(sub, Topology)).engines[0].engine_id == "engine-x"  # within 2 s

        await engine.send(encode(EngineStats(EngineLoad(rank=0, num_waiting=1, num_running=2))))
        async with asyncio.timeout(3):
            while True:
                snapshot = await _recv(sub, LoadSnapshot)
                if snapshot.loads and snapshot.loads[0].num_running == 2:
                    break

        await frontend.send(encode(Unregister("fe-1")))
        assert (await _recv(sub, FrontendGone)).frontend_id == "fe-1"

        coordinator._stopping.set()
        assert (await _recv(sub, Shutdown)).drain
        assert await asyncio.wait_for(task, 10) == 0
        assert launcher.closed


def test_registration_topology_load_and_frontend_gone_over_real_sockets():
    asyncio.run(_scenario())


def test_startup_timeout_names_the_missing_ranks(caplog):
    settings = CoordinatorSettings(data_parallel_size=2, data_parallel_backend="mp",
                                   data_parallel_rpc_port=free_port(), engine_startup_timeout_s=0.5)
    launcher = FakeLauncher()
    code = asyncio.run(Coordinator(settings, launcher).run())
    assert code == 1 and launcher.closed
    assert "ranks [0, 1] did not register within --engine-startup-timeout-s" in caplog.text
