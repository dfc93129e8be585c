"""The coordinator process logic in-process over real ZMQ sockets, with a launcher that starts nothing."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq
import zmq.asyncio

from dpserve_coordinator.launcher import EngineLauncher
from dpserve_coordinator.server import Coordinator, CoordinatorState
from dpserve_coordinator.settings import CoordinatorSettings
from dpserve_shared.codec import from_coordinator_decoder
from dpserve_shared.envelope import frames, split
from dpserve_shared.zmq_security import ZmqSecurity
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
    ScaleRequest,
    Shutdown,
    Topology,
    Unregister,
)
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(60)  # a busy 2-core machine: the broadcasts below are due within 2 s

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


DEPLOYMENT = "dep-test"  # the test coordinator's deployment id


async def _send(sock, msg, deployment_id: str = DEPLOYMENT) -> None:
    await sock.send_multipart(frames(deployment_id, msg))


async def _recv(sock, kind, timeout_s: float = 10.0, deployment_id: str = DEPLOYMENT):
    """The next message of `kind` (in the envelope of `deployment_id`; nothing else may come)."""
    decoder = from_coordinator_decoder()
    others = []
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                envelope = split(await sock.recv_multipart())
                assert envelope is not None and envelope[0] == deployment_id, envelope
                msg = decoder.decode(envelope[1])
                if isinstance(msg, kind):
                    return msg
                others.append(type(msg).__name__)
    except TimeoutError:
        raise TimeoutError(f"no {kind.__name__} within {timeout_s} s (came instead: {others})") from None


def _dealer(ctx, identity: str, addr: str):
    sock = ctx.socket(zmq.DEALER)
    ZmqSecurity.from_environment().client(sock)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


@contextlib.asynccontextmanager
async def running_coordinator(launcher: EngineLauncher):
    """A DP=1 coordinator running as a task, and a ZMQ context; both cancelled and destroyed on the way out."""
    settings = CoordinatorSettings(data_parallel_size=1, data_parallel_backend="mp",
                                   data_parallel_rpc_port=free_port(), engine_startup_timeout_s=10,
                                   deployment_id=DEPLOYMENT)
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
        await _send(engine, RegisterEngine(PROTOCOL_VERSION + 1, 0, "engine-x", "tcp://h:1", MODEL))
        refused = await _recv(engine, RegisterAck)
        assert not refused.accepted
        assert f"peer speaks {PROTOCOL_VERSION + 1}, this side speaks {PROTOCOL_VERSION}" in refused.error

        await _send(engine, RegisterEngine(PROTOCOL_VERSION, 0, "engine-x", "tcp://h:1", MODEL))
        ack = await _recv(engine, RegisterAck)
        assert ack.accepted and ack.rank == 0 and ack.pub_addr == coordinator.pub_addr
        assert launcher.started == [0]

        sub = ctx.socket(zmq.SUB)
        ZmqSecurity.from_environment().client(sub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(ack.pub_addr)
        frontend = _dealer(ctx, "fe-1", settings.control_addr)
        await _send(frontend, RegisterFrontend(PROTOCOL_VERSION, "fe-1"))
        frontend_ack = await _recv(frontend, RegisterAck)
        assert frontend_ack.topology.model == MODEL
        assert [(e.rank, e.state, e.input_addr) for e in frontend_ack.topology.engines] == [
            (0, EngineState.READY, "tcp://h:1")
        ]
        topology = await _recv(sub, Topology)  # within 2 s
        assert topology.engines[0].engine_id == "engine-x"
        while topology.model is not None:  # a change carries the model; a plain republish (2 s) leaves it out
            topology = await _recv(sub, Topology)
        assert topology.engines[0].engine_id == "engine-x"

        await _send(engine, EngineStats(EngineLoad(rank=0, num_waiting=1, num_running=2)))
        async with asyncio.timeout(10):
            while True:
                snapshot = await _recv(sub, LoadSnapshot)
                if snapshot.loads and snapshot.loads[0].num_running == 2:
                    break

        await _send(frontend, Unregister("fe-1"))
        assert (await _recv(sub, FrontendGone)).frontend_id == "fe-1"

        coordinator.stop()
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


async def _isolation_scenario() -> None:
    launcher = FakeLauncher()
    async with running_coordinator(launcher) as (settings, coordinator, task, ctx):
        engine = _dealer(ctx, "engine-a", settings.control_addr)
        await _send(engine, RegisterEngine(PROTOCOL_VERSION, 0, "engine-a", "tcp://h:1", MODEL))
        assert (await _recv(engine, RegisterAck)).accepted

        # Another deployment's peer reached this port: its registration, its Unregister of our rank 0 (same
        # engine id) and an unenveloped message are all dropped, without an answer.
        stray = _dealer(ctx, "engine-b", settings.control_addr)
        await _send(stray, RegisterEngine(PROTOCOL_VERSION, 1, "engine-b", "tcp://h:2", MODEL), "dep-other")
        await _send(stray, Unregister("engine-a", "exiting"), "dep-other")
        await stray.send(b"\x80")  # one frame: not a dpserve envelope
        assert not await stray.poll(1000)
        assert coordinator.registry.engines[0].state == EngineState.READY and 1 not in coordinator.registry.engines
        assert coordinator.guard.num_dropped == 2

        # A peer started by hand (no --deployment-id) registers unbound and learns the id from the ack's envelope;
        # anything but a registration from it must then carry the id.
        frontend = _dealer(ctx, "fe-hand", settings.control_addr)
        await _send(frontend, RegisterFrontend(PROTOCOL_VERSION, "fe-hand"), "")
        assert (await _recv(frontend, RegisterAck, deployment_id=DEPLOYMENT)).accepted
        await _send(frontend, Unregister("fe-hand"), "")
        await asyncio.sleep(0.3)
        assert "fe-hand" in coordinator.registry.frontends
        await _send(frontend, Unregister("fe-hand"))
        await asyncio.sleep(0.3)
        assert "fe-hand" not in coordinator.registry.frontends

        coordinator.stop()
        assert await asyncio.wait_for(task, 10) == 0


def test_messages_of_another_deployment_are_dropped(caplog):
    asyncio.run(_isolation_scenario())
    assert caplog.text.count("from deployment 'dep-other'") == 1  # logged once per foreign id
    assert "not a dpserve peer of this release" in caplog.text


async def _stop_scenario() -> None:
    settings = CoordinatorSettings(data_parallel_size=1, data_parallel_backend="mp", deployment_id=DEPLOYMENT)
    coordinator = Coordinator(settings, FakeLauncher())
    try:
        assert coordinator.state is CoordinatorState.STARTING
        coordinator.stop()
        coordinator.stop()  # idempotent
        assert coordinator.state is CoordinatorState.DRAINING
        refused = coordinator.scaler.request("scale-1", ScaleRequest(2), "")
        assert not refused.accepted and refused.error == "the coordinator is shutting down"
    finally:
        coordinator.ctx.destroy(0)


def test_stop_is_one_idempotent_transition():
    asyncio.run(_stop_scenario())


async def _stop_while_starting_scenario() -> None:
    launcher = FakeLauncher()
    async with running_coordinator(launcher) as (settings, coordinator, task, ctx):
        async with asyncio.timeout(5):
            while launcher.started != [0]:  # launched; its engine never registers
                await asyncio.sleep(0.01)
        coordinator.stop()
        assert await asyncio.wait_for(task, 5) == 0  # not after --engine-startup-timeout-s
        assert coordinator.state is CoordinatorState.STOPPED and launcher.closed


def test_a_stop_while_the_ranks_start_does_not_wait_for_them():
    asyncio.run(_stop_while_starting_scenario())
