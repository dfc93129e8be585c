"""The rank supervisor's restart policy, over a scripted launcher (no processes): replacements without a lifetime
cap, a back-off that doubles with each quick death, FAILED for a crash loop (still retried), healthy again after
a stable run, a launch that fails retried. The real processes: tests/e2e/test_dp_serving.py."""

from __future__ import annotations

import asyncio

import pytest

from dpserve_coordinator import supervisor as supervisor_module
from dpserve_coordinator.launcher import EngineLauncher, LaunchError
from dpserve_coordinator.registry import Registry
from dpserve_coordinator.settings import CoordinatorSettings
from dpserve_coordinator.supervisor import RankSupervisor
from dpserve_shared.schema import PROTOCOL_VERSION, EngineState, ModelInfo, RegisterEngine

pytestmark = pytest.mark.timeout(30)
MODEL = ModelInfo(name="m", root="-", max_model_len=64, vocab_size=10, tokenizer_json="{}")


class ScriptedLauncher(EngineLauncher):
    """Each start registers the rank at once (as an engine would); `kill(rank)` ends its process; starts listed in
    `refuse` raise LaunchError."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self.starts: list[float] = []
        self.refuse: set[int] = set()  # indices into starts that fail
        self._exits: dict[int, asyncio.Event] = {}

    async def start(self, rank: int) -> None:
        self.starts.append(asyncio.get_running_loop().time())
        if len(self.starts) - 1 in self.refuse:
            raise LaunchError("no room")
        self._exits[rank] = asyncio.Event()
        self.registry.register_engine(
            RegisterEngine(PROTOCOL_VERSION, rank, f"e{len(self.starts)}", f"tcp://h:{1000 + rank}", MODEL), 0.0
        )

    async def wait_exit(self, rank: int) -> str:
        await self._exits[rank].wait()
        return "engine process exited with code -9"

    def kill(self, rank: int) -> None:
        self._exits[rank].set()

    async def close(self, timeout_s: float) -> None:
        pass

    def kill_now(self) -> None:
        pass


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(supervisor_module, "RESTART_DELAY_S", 0.01)
    monkeypatch.setattr(supervisor_module, "MAX_RESTART_DELAY_S", 0.04)
    monkeypatch.setattr(supervisor_module, "STABLE_S", 0.3)


async def _until(predicate, timeout_s: float = 5.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)


def _setup():
    registry = Registry(1)
    launcher = ScriptedLauncher(registry)
    sup = RankSupervisor(registry, CoordinatorSettings(max_engine_restarts=2), launcher)
    registry.engine_starting(0)  # as the coordinator's start-up does
    return registry, launcher, sup


def test_a_crash_loop_is_failed_and_still_retried_on_a_growing_back_off_then_heals(fast, monkeypatch):
    delays = []
    note_death = RankSupervisor._note_death

    def recording(self, *args):
        delays.append(note_death(self, *args))
        return delays[-1]

    monkeypatch.setattr(RankSupervisor, "_note_death", recording)

    async def scenario():
        registry, launcher, sup = _setup()
        await sup.start(0)
        for n in range(1, 6):  # five quick deaths in a row
            launcher.kill(0)
            await _until(lambda: len(launcher.starts) == n + 1)
            info = registry.topology().engines[0]
            assert info.restarts == n and info.failed == (n > 2), (n, info)
        assert delays == [0.01, 0.02, 0.04, 0.04, 0.04]  # doubling, capped at MAX_RESTART_DELAY_S
        await _until(lambda: not registry.topology().engines[0].failed)  # it lived STABLE_S: healthy again
        launcher.kill(0)  # a death after a stable run starts the back-off from the beginning
        await _until(lambda: len(launcher.starts) == 7)
        assert not registry.topology().engines[0].failed
        await sup.close(1.0)

    asyncio.run(scenario())


def test_the_dead_reason_is_in_the_topology_and_a_failed_launch_is_retried(fast):
    async def scenario():
        registry, launcher, sup = _setup()
        await sup.start(0)
        launcher.refuse = {1, 2}  # the first two replacements cannot be launched
        launcher.kill(0)
        await _until(lambda: registry.topology().engines[0].state == EngineState.DEAD)
        assert registry.topology().engines[0].dead_reason == "engine process exited with code -9"
        await _until(lambda: len(launcher.starts) == 4)
        await _until(lambda: registry.topology().engines[0].state == EngineState.READY)
        assert registry.topology().engines[0].restarts == 3 and registry.topology().engines[0].dead_reason == ""
        await sup.close(1.0)

    asyncio.run(scenario())


def test_retry_now_ends_a_dead_ranks_back_off(monkeypatch):
    """`dpserve scale` to a size that includes a DEAD rank: its replacement does not wait out the back-off."""
    monkeypatch.setattr(supervisor_module, "RESTART_DELAY_S", 60.0)
    monkeypatch.setattr(supervisor_module, "STABLE_S", 0.3)

    async def scenario():
        registry, launcher, sup = _setup()
        await sup.start(0)
        assert not sup.retry_now(0)  # serving: nothing to retry
        launcher.kill(0)
        await _until(lambda: registry.topology().engines[0].state == EngineState.DEAD)
        await _until(lambda: sup.retry_now(0))
        await _until(lambda: len(launcher.starts) == 2, timeout_s=2.0)  # not 60 s
        await sup.close(1.0)

    asyncio.run(scenario())


def test_a_dead_rank_of_an_expert_parallel_deployment_is_replaced(fast):
    """Like a dense rank's, but a first death with no back-off (the whole group waits for it): the coordinator's
    ExpertGroups re-forms the group once the replacement registered."""

    async def scenario():
        registry = Registry(1)
        launcher = ScriptedLauncher(registry)
        sup = RankSupervisor(registry, CoordinatorSettings(enable_expert_parallel=True), launcher)
        registry.engine_starting(0)
        await sup.start(0)
        launcher.kill(0)
        await _until(lambda: len(launcher.starts) == 2, timeout_s=2.0)
        assert registry.topology().engines[0].deaths == {"killed": 1}
        await sup.close(1.0)

    asyncio.run(scenario())
