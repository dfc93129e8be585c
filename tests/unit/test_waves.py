"""The wave protocol's races, in-process (shared/dpserve_shared/waves.py)."""

from __future__ import annotations

import pytest

from dpserve_shared.schema import StartWave, StartWaveRequest
from dpserve_shared.waves import CoordinatorWaves, EngineWaves, FrontendWaves

pytestmark = pytest.mark.timeout(10)


class Cluster:
    """Two engines, one frontend, one coordinator, with messages delivered by hand."""

    def __init__(self, num_ranks: int = 2):
        self.coordinator = CoordinatorWaves()
        self.engines = [EngineWaves(rank) for rank in range(num_ranks)]
        self.frontend = FrontendWaves()

    def broadcast(self, message: StartWave | None) -> None:
        if message is not None:
            for engine in self.engines:
                engine.on_start_wave(message)

    def publish(self) -> None:
        self.frontend.on_snapshot(self.coordinator.wave, self.coordinator.running)

    def complete_if_idle(self) -> None:
        done = self.coordinator.on_loads([e.running for e in self.engines])
        if done is not None:
            for engine in self.engines:
                engine.on_wave_complete(done)


def test_first_request_while_paused_wakes_the_other_ranks():
    c = Cluster()
    wave, wake = c.frontend.stamp(rank=0)
    assert wake == StartWaveRequest(0, 0)
    c.engines[0].on_request(wave)
    start = c.coordinator.on_start_request(wake)
    assert start == StartWave(0, exclude_rank=0)
    c.broadcast(start)
    assert all(e.running for e in c.engines)
    # A second request of the same burst does not ask again.
    assert c.frontend.stamp(rank=1)[1] is None


def test_bursts_separated_by_idle_time_advance_the_wave_once_each():
    c = Cluster()
    for expected_wave in range(3):
        wave, wake = c.frontend.stamp(rank=1)
        assert wave == expected_wave
        c.engines[1].on_request(wave)
        c.broadcast(c.coordinator.on_start_request(wake))
        for engine in c.engines:
            engine.on_idle()
        c.complete_if_idle()
        c.publish()
        assert (c.coordinator.wave, c.coordinator.running) == (expected_wave + 1, False)
        assert all((e.wave, e.running) == (expected_wave + 1, False) for e in c.engines)


def test_one_rank_idle_while_another_is_busy_keeps_the_wave_running():
    c = Cluster()
    wave, wake = c.frontend.stamp(rank=0)
    c.engines[0].on_request(wave)
    c.broadcast(c.coordinator.on_start_request(wake))
    c.engines[1].on_idle()
    c.complete_if_idle()
    assert c.coordinator.running and c.coordinator.wave == 0
    c.engines[0].on_idle()
    c.complete_if_idle()
    assert not c.coordinator.running and c.coordinator.wave == 1


def test_request_that_crosses_wave_complete_restarts_the_wave_for_everybody():
    c = Cluster()
    wave, wake = c.frontend.stamp(rank=0)
    c.engines[0].on_request(wave)
    c.broadcast(c.coordinator.on_start_request(wake))
    # The frontend sends a second request stamped wave 0 ...
    stale_wave, _ = c.frontend.stamp(rank=1)
    # ... while the wave completes (the frontend has not heard yet).
    for engine in c.engines:
        engine.on_idle()
    c.complete_if_idle()
    assert c.engines[1].wave == 1 and not c.engines[1].running
    ask = c.engines[1].on_request(stale_wave)
    assert ask == StartWaveRequest(1, 1)
    start = c.coordinator.on_start_request(ask)
    assert start == StartWave(1, exclude_rank=1)
    c.broadcast(start)
    assert all(e.running and e.wave == 1 for e in c.engines)


def test_stale_frontend_wake_up_after_completion_wakes_every_rank():
    c = Cluster()
    c.coordinator.on_wave_complete(0)  # wave 0 done; the frontend still believes wave 0 and paused
    start = c.coordinator.on_start_request(StartWaveRequest(0, 0))
    assert start == StartWave(1, exclude_rank=None)


def test_stale_start_wave_and_stale_completion_are_ignored():
    engine = EngineWaves(rank=0, wave=3)
    assert not engine.on_start_wave(StartWave(2, exclude_rank=None))
    assert not engine.running
    coordinator = CoordinatorWaves(wave=3)
    assert not coordinator.on_wave_complete(1)
    assert coordinator.wave == 3


def test_start_wave_excluding_a_rank_does_not_touch_it():
    engine = EngineWaves(rank=1)
    assert not engine.on_start_wave(StartWave(0, exclude_rank=1))
    assert not engine.running

