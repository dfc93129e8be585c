"""The coordinator's registry as a state machine: registration, rank assignment, liveness, snapshots."""

from __future__ import annotations

import pytest

from dpserve_coordinator.registry import Registry, RegistrationRefused
from dpserve_shared.schema import (
    PROTOCOL_VERSION,
    EngineLoad,
    EngineState,
    ModelInfo,
    RegisterEngine,
    RegisterFrontend,
)

MODEL = ModelInfo(name="m", root="/m", max_model_len=128, vocab_size=10, tokenizer_json="{}")


def engine(rank: int, engine_id: str | None = None, version: int = PROTOCOL_VERSION, model: ModelInfo = MODEL):
    engine_id = engine_id or f"engine-{rank}"
    return RegisterEngine(version, rank, engine_id, f"tcp://h:{5000 + max(rank, 0)}", model, kv_blocks_total=100)


def test_starting_then_ready_bumps_the_epoch_and_sets_the_model():
    registry = Registry(2)
    registry.engine_starting(0)
    registry.engine_starting(1)
    assert [e.state for e in registry.topology().engines] == [EngineState.STARTING] * 2
    epoch = registry.epoch
    assert registry.register_engine(engine(0), now_s=0.0) == 0
    topology = registry.topology()
    assert topology.epoch > epoch
    assert topology.model == MODEL
    assert [(e.rank, e.state) for e in topology.engines] == [(0, EngineState.READY), (1, EngineState.STARTING)]
    assert registry.ready_ranks() == [0]


def test_protocol_mismatch_is_refused_naming_both_versions():
    registry = Registry(1)
    with pytest.raises(RegistrationRefused, match=f"peer speaks 999, this side speaks {PROTOCOL_VERSION}"):
        registry.register_engine(engine(0, version=999), 0.0)
    with pytest.raises(RegistrationRefused, match="peer speaks 0"):
        registry.register_frontend(RegisterFrontend(0, "fe-1"), 0.0)


def test_unassigned_rank_gets_the_lowest_free_one():
    registry = Registry(3)
    registry.register_engine(engine(1), 0.0)
    assert registry.register_engine(engine(-1, "engine-x"), 0.0) == 0
    assert registry.register_engine(engine(-1, "engine-y"), 0.0) == 2


def test_a_live_rank_cannot_be_taken_but_a_dead_one_can():
    registry = Registry(1)
    registry.register_engine(engine(0, "engine-a"), 0.0)
    with pytest.raises(RegistrationRefused, match="rank 0 is already served by engine engine-a"):
        registry.register_engine(engine(0, "engine-b"), 0.0)
    assert registry.mark_dead(0, "process exited")
    assert not registry.mark_dead(0, "again")
    assert registry.register_engine(engine(0, "engine-b"), 1.0) == 0
    assert registry.engines[0].engine_id == "engine-b"


def test_another_model_is_refused():
    registry = Registry(2)
    registry.register_engine(engine(0), 0.0)
    other = ModelInfo(name="other", root="/o", max_model_len=128, vocab_size=10, tokenizer_json="{}")
    with pytest.raises(RegistrationRefused, match="serves model 'other'"):
        registry.register_engine(engine(1, model=other), 0.0)


def test_silent_engine_is_dead_and_comes_back_when_it_heartbeats():
    registry = Registry(1, engine_timeout_s=10.0)
    registry.register_engine(engine(0), 0.0)
    assert registry.expire(5.0) == ([], [])
    assert registry.expire(10.5) == ([], [0])
    assert registry.engines[0].state == EngineState.DEAD
    assert registry.heartbeat("engine-0", 11.0)
    assert registry.engines[0].state == EngineState.READY


def test_time_the_coordinator_did_not_run_is_nobodys_silence():
    registry = Registry(1, engine_timeout_s=10.0, frontend_timeout_s=5.0)
    registry.register_engine(engine(0), 0.0)
    registry.register_frontend(RegisterFrontend(PROTOCOL_VERSION, "fe-1"), 0.0)
    registry.forgive(8.0)  # the coordinator was starved of CPU for 8 s (its heartbeats queued meanwhile)
    assert registry.expire(12.0) == ([], [])
    assert registry.expire(18.5) == (["fe-1"], [0])


def test_exited_engine_does_not_come_back_by_heartbeat():
    registry = Registry(1)
    registry.register_engine(engine(0), 0.0)
    registry.mark_dead(0, "engine process exited with code 1")
    registry.heartbeat("engine-0", 1.0)
    assert registry.engines[0].state == EngineState.DEAD


def test_silent_frontend_is_dropped():
    registry = Registry(1, frontend_timeout_s=5.0)
    registry.register_frontend(RegisterFrontend(PROTOCOL_VERSION, "fe-1"), 0.0)
    registry.register_frontend(RegisterFrontend(PROTOCOL_VERSION, "fe-2"), 0.0)
    registry.heartbeat("fe-2", 4.0)
    assert registry.expire(6.0) == (["fe-1"], [])
    assert list(registry.frontends) == ["fe-2"]
    assert not registry.heartbeat("fe-1", 6.5)  # unknown: it must register again
    assert registry.drop_frontend("fe-2")


def test_load_snapshot_lists_ready_ranks_and_tracks_changes():
    registry = Registry(2)
    registry.register_engine(engine(0), 0.0)
    registry.register_engine(engine(1), 0.0)
    version = registry.load_version
    registry.update_load("engine-1", EngineLoad(rank=0, num_running=3), 1.0)  # the rank is stamped by the registry
    assert registry.load_version == version + 1
    registry.update_load("engine-1", EngineLoad(rank=1, num_running=3), 1.1)
    assert registry.load_version == version + 1  # unchanged
    snapshot = registry.load_snapshot(wave=0, engines_running=False, now_s=2.0)
    assert [(l.rank, l.num_running) for l in snapshot.loads] == [(0, 0), (1, 3)]
    registry.mark_dead(0, "gone")
    assert [l.rank for l in registry.load_snapshot(0, False, 3.0).loads] == [1]


def test_a_rank_with_work_whose_step_counter_stands_still_is_stuck_while_it_heartbeats():
    """A step that never returns: the heartbeats still come (their thread lives), the step counter does not move.
    Idle ranks and ranks whose steps go on are not stuck."""
    registry = Registry(3, engine_timeout_s=10.0, stall_timeout_s=60.0)
    for rank in range(3):
        registry.register_engine(engine(rank), now_s=0.0)
    for t in range(0, 100, 5):  # heartbeats every 5 s for 100 s
        registry.update_load("engine-0", EngineLoad(0, num_running=2, step=7), now_s=t)  # stuck at step 7
        registry.update_load("engine-1", EngineLoad(1, num_running=2, step=7 + t), now_s=t)  # stepping
        registry.update_load("engine-2", EngineLoad(2, step=7), now_s=t)  # idle: no step, no work
        _, dead = registry.expire(now_s=t + 1)
        assert dead == ([0] if t + 1 > 60 and t - 5 + 1 <= 60 else []), t
    states = {e.rank: (e.state, e.dead_reason) for e in registry.topology().engines}
    assert states[0] == (EngineState.DEAD, "stuck: no engine step for 61 s with 2 requests")
    assert states[1][0] == states[2][0] == EngineState.READY


def test_deaths_are_counted_by_kind_and_survive_the_replacement():
    from dpserve_coordinator.registry import death_kind

    assert death_kind("engine process 12 exited with code -9") == "killed"
    assert death_kind("engine process 12 exited with code 1") == "exited"
    assert death_kind("stuck: no engine step for 61 s with 2 requests") == "stuck"
    assert death_kind("missed heartbeats") == "missed_heartbeats"
    registry = Registry(1)
    registry.register_engine(engine(0), now_s=0.0)
    registry.mark_dead(0, "engine process 12 exited with code -9")
    registry.register_engine(engine(0, "engine-0b"), now_s=1.0)  # the replacement
    registry.mark_dead(0, "missed heartbeats")
    registry.mark_dead(0, "engine process 13 exited with code -9")  # already DEAD: the reason only
    info = registry.topology().engines[0]
    assert info.deaths == {"killed": 1, "missed_heartbeats": 1}
    assert info.dead_reason == "engine process 13 exited with code -9"
