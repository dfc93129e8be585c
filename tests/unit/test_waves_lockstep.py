"""The lock-step wave protocol (expert parallelism), in-process: LockstepCoordinatorWaves and LockstepEngineWaves
(shared/dpserve_shared/waves.py) through every transition, stale messages included.

`LockstepCluster` delivers messages by hand and models the one thing lock-step adds: a step is a collective, so
it happens only when every rank is running (otherwise the running ranks are blocked in it)."""

from __future__ import annotations

import pytest

from dpserve_shared.schema import StartWave, StartWaveRequest
from dpserve_shared.waves import (
    CoordinatorWaves,
    FrontendWaves,
    LockstepCoordinatorWaves,
    LockstepEngineWaves,
)

pytestmark = pytest.mark.timeout(10)

K = 4  # the all-reduce interval in these tests


class LockstepCluster:
    def __init__(self, num_ranks: int = 2):
        self.coordinator = LockstepCoordinatorWaves()
        self.engines = [LockstepEngineWaves(rank, sync_interval_steps=K) for rank in range(num_ranks)]
        self.frontend = FrontendWaves()
        self.work = [0] * num_ranks  # steps of work each rank has left
        self.num_dummy_steps = [0] * num_ranks
        self.completions: list[int] = []  # WaveComplete messages rank 0 sent, not yet delivered

    def broadcast(self, message: StartWave | None) -> None:
        if message is not None:
            for engine in self.engines:
                engine.on_start_wave(message)

    def publish(self) -> None:
        """A LoadSnapshot: the frontend and every engine hear the coordinator's (wave, running)."""
        self.frontend.on_snapshot(self.coordinator.wave, self.coordinator.running)
        for engine in self.engines:
            engine.on_snapshot(self.coordinator.wave, self.coordinator.running)

    def give(self, rank: int, num_steps: int, wave: int) -> StartWaveRequest | None:
        self.work[rank] += num_steps
        return self.engines[rank].on_request(wave)

    @property
    def is_blocked(self) -> bool:
        """Some rank is in a collective the others will not join."""
        running = [e.running for e in self.engines]
        return any(running) and not all(running)

    def step(self) -> bool:
        """One lock-step step if every rank runs; False if none can step."""
        if not all(e.running for e in self.engines):
            return False
        syncs = []
        for rank, engine in enumerate(self.engines):
            if self.work[rank]:
                self.work[rank] -= 1
            else:
                self.num_dummy_steps[rank] += 1
            syncs.append(engine.on_step())
        assert len(set(syncs)) == 1, "the ranks disagree on the sync step"
        if syncs[0]:
            any_unfinished = any(self.work)
            completed = {engine.on_sync(any_unfinished) for engine in self.engines}
            assert len(completed) == 1, "the ranks disagree on the pause"
            if None not in completed:
                self.completions.append(completed.pop())  # rank 0 reports it
        return True

    def run_until_paused(self, max_steps: int = 100) -> int:
        for num_steps in range(max_steps):
            if not self.step():
                return num_steps
        raise AssertionError("never paused")

    def deliver_completions(self) -> None:
        for wave in self.completions:
            self.coordinator.on_wave_complete(wave)
        self.completions.clear()


def _start_burst(c: LockstepCluster, rank: int, num_steps: int) -> None:
    """A frontend request to `rank`: stamped, sent, and its wake-up (and the engine's own) delivered."""
    wave, wake = c.frontend.stamp(rank)
    ask = c.give(rank, num_steps, wave)
    for message in (wake, ask):
        if message is not None:
            c.broadcast(c.coordinator.on_start_request(message))


def test_first_request_while_paused_starts_every_rank_and_all_pause_together():
    c = LockstepCluster()
    wave, wake = c.frontend.stamp(rank=0)
    assert wake == StartWaveRequest(0, 0)
    ask = c.give(0, 1, wave)
    assert ask == StartWaveRequest(0, 0)  # (e): a paused rank always asks
    assert c.is_blocked  # rank 0 is in its first collective until rank 1 joins
    start = c.coordinator.on_start_request(wake)
    assert start == StartWave(0, exclude_rank=0)
    assert c.coordinator.on_start_request(ask) is None  # the coordinator already knows
    c.broadcast(start)
    assert all(e.running for e in c.engines)
    assert c.run_until_paused() == K  # the first all-reduce finds nobody with work
    assert c.num_dummy_steps == [K - 1, K]
    assert all((e.wave, e.running, e.num_steps) == (1, False, 0) for e in c.engines)
    assert c.completions == [0]
    c.deliver_completions()
    assert (c.coordinator.wave, c.coordinator.running) == (1, False)


def test_bursts_separated_by_idle_time_each_pause_and_restart():
    c = LockstepCluster()
    for burst in range(3):
        _start_burst(c, rank=burst % 2, num_steps=2)
        c.run_until_paused()
        c.deliver_completions()
        c.publish()
        assert (c.coordinator.wave, c.coordinator.running) == (burst + 1, False)
        assert all((e.wave, e.running) == (burst + 1, False) for e in c.engines)
        assert not c.is_blocked
    # paused: nothing steps, no dummy step is counted
    dummy = list(c.num_dummy_steps)
    assert not c.step()
    assert c.num_dummy_steps == dummy


def test_one_rank_busy_keeps_the_idle_one_stepping_until_the_sync_finds_none():
    c = LockstepCluster()
    _start_burst(c, rank=0, num_steps=K + 1)  # still busy at the first sync
    assert c.run_until_paused() == 2 * K
    assert c.num_dummy_steps == [K - 1, 2 * K]
    assert c.completions == [0]


def test_sync_with_work_left_keeps_the_wave():
    engine = LockstepEngineWaves(rank=0, sync_interval_steps=2, running=True)
    assert not engine.on_step()
    assert engine.on_step()
    assert engine.on_sync(True) is None
    assert (engine.wave, engine.running, engine.num_steps) == (0, True, 2)
    assert not engine.on_step() and engine.on_step()
    assert engine.on_sync(False) == 0
    assert (engine.wave, engine.running, engine.num_steps) == (1, False, 0)


def test_request_crossing_the_pause_whose_ask_overtakes_the_wave_complete():
    """(b) + (f): the ranks pause; rank 1 then gets a request stamped with the old wave and asks for wave 1 before
    the coordinator has heard rank 0's WaveComplete(0)."""
    c = LockstepCluster()
    _start_burst(c, rank=0, num_steps=1)
    stale_wave, wake = c.frontend.stamp(rank=1)  # the frontend believes wave 0 running: no wake-up
    assert wake is None
    c.run_until_paused()
    assert c.completions == [0]  # not delivered yet
    ask = c.give(1, 1, stale_wave)
    assert ask == StartWaveRequest(1, 1)
    assert c.is_blocked
    # The dense rule would do nothing (it believes the engines running) and leave rank 1 blocked for good:
    dense = CoordinatorWaves(wave=0, running=True)
    assert dense.on_start_request(ask) is None
    start = c.coordinator.on_start_request(ask)
    assert start == StartWave(1, exclude_rank=1)
    assert (c.coordinator.wave, c.coordinator.running) == (1, True)
    c.broadcast(start)
    assert not c.is_blocked
    c.deliver_completions()  # WaveComplete(0) arrives late: stale, ignored (d)
    assert (c.coordinator.wave, c.coordinator.running) == (1, True)
    c.run_until_paused()
    c.deliver_completions()
    assert (c.coordinator.wave, c.coordinator.running) == (2, False)
    assert c.work == [0, 0]


def test_request_crossing_the_pause_after_the_wave_complete_arrived():
    c = LockstepCluster()
    _start_burst(c, rank=0, num_steps=1)
    stale_wave, _ = c.frontend.stamp(rank=1)
    c.run_until_paused()
    c.deliver_completions()
    assert (c.coordinator.wave, c.coordinator.running) == (1, False)
    ask = c.give(1, 1, stale_wave)
    start = c.coordinator.on_start_request(ask)
    assert start == StartWave(1, exclude_rank=1)
    c.broadcast(start)
    c.run_until_paused()
    c.deliver_completions()
    assert (c.coordinator.wave, c.coordinator.running) == (2, False)


def test_stale_frontend_wake_up_after_completion_wakes_every_rank():
    c = LockstepCluster()
    _start_burst(c, rank=0, num_steps=1)
    c.run_until_paused()
    c.deliver_completions()
    # a frontend that still believes wave 0 paused asks for it: everybody (nobody excluded) starts wave 1
    start = c.coordinator.on_start_request(StartWaveRequest(0, 1))
    assert start == StartWave(1, exclude_rank=None)
    c.broadcast(start)
    assert all(e.running and e.wave == 1 for e in c.engines)
    c.run_until_paused()  # an empty wave: K dummy steps, then paused again
    c.deliver_completions()
    assert (c.coordinator.wave, c.coordinator.running) == (2, False)


def test_stale_start_wave_and_stale_wave_complete_are_ignored():
    engine = LockstepEngineWaves(rank=0, wave=3)
    assert not engine.on_start_wave(StartWave(2, exclude_rank=None))  # (c)
    assert not engine.running
    coordinator = LockstepCoordinatorWaves(wave=3, running=True)
    assert not coordinator.on_wave_complete(1)  # (d)
    assert (coordinator.wave, coordinator.running) == (3, True)
    assert coordinator.on_wave_complete(3)
    assert (coordinator.wave, coordinator.running) == (4, False)


def test_start_wave_for_the_current_wave_starts_a_paused_rank_but_not_the_excluded_one():
    engine = LockstepEngineWaves(rank=1, wave=2)
    assert not engine.on_start_wave(StartWave(2, exclude_rank=1))
    assert not engine.running
    assert engine.on_start_wave(StartWave(2, exclude_rank=0))
    assert (engine.wave, engine.running, engine.num_steps) == (2, True, 0)


def test_a_running_rank_ignores_start_wave_and_requests_and_keeps_its_step_count():
    engine = LockstepEngineWaves(rank=0, sync_interval_steps=8)
    engine.on_request(0)
    engine.on_step()
    assert not engine.on_start_wave(StartWave(0))
    assert engine.on_request(0) is None
    assert engine.num_steps == 1  # a restart in the middle would break the ranks' common count


def test_a_request_never_moves_the_rank_wave():
    engine = LockstepEngineWaves(rank=0, wave=2)
    assert engine.on_request(5) == StartWaveRequest(2, 0)
    assert engine.wave == 2 and engine.running


def test_snapshot_restarts_a_rank_whose_start_wave_was_lost():
    """(h): the StartWave broadcast is dropped for rank 1; the next LoadSnapshot starts it."""
    c = LockstepCluster()
    wave, wake = c.frontend.stamp(rank=0)
    c.give(0, 1, wave)
    c.coordinator.on_start_request(wake)  # its StartWave is lost
    assert c.is_blocked
    c.publish()
    assert not c.is_blocked
    c.run_until_paused()
    c.deliver_completions()
    assert (c.coordinator.wave, c.coordinator.running) == (1, False)


def test_snapshot_starts_an_excluded_rank_whose_request_never_came():
    """The frontend asked for a wave excluding rank 0 (it was to get the request), but the request never reached
    it (refused as invalid, or the frontend died): the snapshot starts rank 0, the empty wave ends."""
    c = LockstepCluster()
    start = c.coordinator.on_start_request(StartWaveRequest(0, 0))
    c.broadcast(start)
    assert c.is_blocked and c.engines[1].running
    c.publish()
    assert c.run_until_paused() == K
    c.deliver_completions()
    assert (c.coordinator.wave, c.coordinator.running) == (1, False)


def test_stale_or_paused_snapshots_start_nothing():
    engine = LockstepEngineWaves(rank=0, wave=2)
    assert not engine.on_snapshot(1, True)  # published before the coordinator heard WaveComplete(1)
    assert not engine.on_snapshot(2, False)
    assert not engine.running
    assert engine.on_snapshot(2, True)
    assert engine.running


def test_the_coordinator_ignores_loads_in_lock_step():
    coordinator = LockstepCoordinatorWaves(wave=0, running=True)
    assert coordinator.on_loads([False, False]) is None
    assert (coordinator.wave, coordinator.running) == (0, True)
    assert coordinator.on_loads([True, False]) is None


def test_newer_wave_asked_while_paused_is_adopted_and_started():
    coordinator = LockstepCoordinatorWaves(wave=1, running=False)
    assert coordinator.on_start_request(StartWaveRequest(3, 0)) == StartWave(3, exclude_rank=0)
    assert (coordinator.wave, coordinator.running) == (3, True)
    assert coordinator.on_start_request(StartWaveRequest(3, 1)) is None  # already running that wave


def test_re_forming_the_group_moves_everybody_to_a_new_running_wave_and_the_old_completion_is_stale():
    """Elastic EP: the coordinator re-forms in a wave newer than any rank's (one may be a wave ahead, its
    WaveComplete in flight), running; the members leave at their sync without completing a wave, then step in it
    from step 0 on."""
    coordinator = LockstepCoordinatorWaves(wave=3, running=True)
    ahead = LockstepEngineWaves(rank=0, sync_interval_steps=2, wave=4)  # its WaveComplete(3) still in flight
    behind = LockstepEngineWaves(rank=1, sync_interval_steps=2, wave=3, running=True, num_steps=1)
    wave = coordinator.on_regroup()
    assert (wave, coordinator.running) == (4, True)
    ahead.start_to_sync()
    assert ahead.running and ahead.num_steps == 0
    behind.on_leave()
    assert (behind.wave, behind.running, behind.num_steps) == (3, False, 0)  # not a completion
    for rank in (ahead, behind):
        rank.on_regroup(wave)
        assert (rank.wave, rank.running, rank.num_steps) == (4, True, 0)
    assert not coordinator.on_wave_complete(3)  # the completion from before the re-formation
    assert coordinator.on_wave_complete(4) and (coordinator.wave, coordinator.running) == (5, False)
