"""The frontend's coordinator link against a fake coordinator (real ZMQ): registration with retry, topology and
load snapshots followed, heartbeats, wave wake-ups, Unregister on exit."""

import asyncio
import socket

import pytest

from dpserve_frontend.coordinator_client import CoordinatorClient, RegistrationRefused
from dpserve_frontend.settings import FrontendSettings
from dpserve_frontend.state import FrontendState
from dpserve_shared.schema import (
    EngineLoad,
    EngineState,
    Heartbeat,
    LoadSnapshot,
    RegisterFrontend,
    StartWaveRequest,
    Unregister,
)
from tests.integration._frontend_helpers import FakeCoordinator, NullEngine, run

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_for(predicate, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_registers_retrying_until_the_coordinator_answers_then_follows_it(model_info):
    port = free_port()
    engines = [NullEngine(0, model_info), NullEngine(1, model_info)]
    coordinator = None
    settings = FrontendSettings(coordinator_addr=f"tcp://127.0.0.1:{port}", frontend_id="fe-a",
                                heartbeat_interval_s=0.1)
    try:
        async def scenario():
            nonlocal coordinator
            state = FrontendState(settings)
            client = CoordinatorClient(settings, state.apply_topology, state.apply_snapshot)
            state.pool.on_start_wave = client.request_start_wave
            registering = asyncio.ensure_future(client.register())
            await asyncio.sleep(0.8)  # nobody listens yet: the frontend keeps retrying
            assert not registering.done()
            coordinator = FakeCoordinator(model_info, engines[:1], port=port)
            await asyncio.wait_for(registering, 10)
            assert state.model_info.name == model_info.name
            assert state.pool.serving_ranks == [0]
            client.start()
            # a new rank appears on the broadcast channel; then a snapshot
            await asyncio.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
            coordinator.set_engines(engines)
            await wait_for(lambda: state.pool.serving_ranks == [0, 1])
            coordinator.publish(LoadSnapshot([EngineLoad(0, num_waiting=5), EngineLoad(1)], wave=4,
                                             engines_running=False, timestamp=1.0))
            await wait_for(lambda: state.pool.waves.wave == 4)
            assert state.pool.router.cost(1) < state.pool.router.cost(0)  # the snapshot reached the router
            # a request while the engines are paused asks the coordinator to start a wave
            from dpserve_frontend.generation import Generation
            from dpserve_frontend.spec import GenerationSpec, PromptInput
            from dpserve_shared.schema import SamplingParams

            spec = GenerationSpec([PromptInput([1, 2])], SamplingParams(max_tokens=2))
            generation = Generation(state.pool, state.tokenizer, state.metrics, spec, "r1")
            generation.start()
            assert generation.rank == 1  # the pool routed it to the idle rank
            async for _ in generation.deltas():
                pass
            await wait_for(lambda: coordinator.of_type(StartWaveRequest))
            assert coordinator.of_type(StartWaveRequest)[0].wave == 4
            assert [r.wave for e in engines for r in e.requests()] == [4]
            # rank 0 dies
            coordinator.set_engines([engines[0].info(EngineState.DEAD), engines[1]])
            await wait_for(lambda: state.pool.serving_ranks == [1])
            await wait_for(lambda: len(coordinator.of_type(Heartbeat)) >= 3)
            await client.close()
            await state.pool.close()
            await wait_for(lambda: coordinator.of_type(Unregister))
            assert coordinator.of_type(Unregister)[0].sender_id == "fe-a"
            assert all(m.frontend_id == "fe-a" for m in coordinator.of_type(RegisterFrontend))

        run(scenario())
    finally:
        if coordinator is not None:
            coordinator.close()
        for engine in engines:
            engine.close()


def test_refused_registration_raises(model_info):
    coordinator = FakeCoordinator(model_info, accept=False)
    try:
        async def scenario():
            settings = FrontendSettings(coordinator_addr=coordinator.control_addr, frontend_id="fe-b")
            state = FrontendState(settings)
            client = CoordinatorClient(settings, state.apply_topology, state.apply_snapshot)
            with pytest.raises(RegistrationRefused, match="refused by test"):
                await client.register()
            await client.close()

        run(scenario())
    finally:
        coordinator.close()


def test_restarted_coordinator_is_picked_up(model_info):
    engine = NullEngine(0, model_info)
    first = FakeCoordinator(model_info, [engine])
    port = int(first.control_addr.rsplit(":", 1)[1])
    second = None
    settings = FrontendSettings(coordinator_addr=first.control_addr, frontend_id="fe-c", heartbeat_interval_s=0.1,
                                coordinator_silence_s=0.5)
    try:
        async def scenario():
            nonlocal second
            state = FrontendState(settings)
            client = CoordinatorClient(settings, state.apply_topology, state.apply_snapshot)
            await client.register()
            client.start()
            first.close()  # the coordinator dies: the frontend keeps its topology and keeps serving
            await asyncio.sleep(0.3)
            assert state.pool.serving_ranks == [0]
            second = FakeCoordinator(model_info, [engine], port=port)  # back, with a new broadcast port
            await wait_for(lambda: second.of_type(RegisterFrontend), timeout_s=10)
            for _ in range(100):  # PUB/SUB drops what is sent before the subscription arrives: keep publishing
                second.publish(LoadSnapshot([EngineLoad(0, num_running=1)], wave=9, timestamp=2.0))
                await asyncio.sleep(0.05)
                if state.pool.waves.wave == 9:
                    break
            assert state.pool.waves.wave == 9
            await client.close()
            await state.pool.close()

        run(scenario())
    finally:
        if second is not None:
            second.close()
        engine.close()
