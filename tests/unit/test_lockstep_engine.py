"""The engine's lock-step side in-process: the null engine's expert-parallel mode and `Lockstep` (lockstep.py) over
a group of one rank, whose collectives are the identity (what a world size of 1 computes). The same code over 2
real processes: tests/integration/test_expert_parallel_group.py and test_lockstep_waves.py."""

from __future__ import annotations

import pytest

from dpserve_engine.interface import EngineCoreBase
from dpserve_engine.lockstep import Lockstep, SyncFailed
from dpserve_engine.null_core import NULL_EP_NUM_LAYERS, NullEngineCore
from dpserve_shared.schema import EngineRequest, ExpertGroup, FinishReason, SamplingParams

pytestmark = pytest.mark.timeout(30)


class GroupOfOne:
    """ExpertComm and the has-unfinished all-reduce for world size 1; records the rows each gather carried."""

    rank = 0
    world_size = 1
    collective_time_s = 0.0

    def __init__(self):
        self.gathered_rows: list[int] = []

    def gather(self, x):
        self.gathered_rows.append(x.shape[0])
        return x, [x.shape[0]]

    def scatter_sum(self, y, counts):
        return y

    def all_reduce_has_unfinished(self, has_unfinished: bool) -> bool:
        return has_unfinished

    def all_reduce_sync(self, has_unfinished: bool, generation: int) -> tuple[bool, int]:
        return has_unfinished, generation

    def close(self) -> None:
        self.closed = True


def _request(request_id: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def test_null_engine_runs_the_moe_layers_collectives_in_every_step_and_dummy_step(model_info):
    core = NullEngineCore(model_info)
    assert core.supports_expert_parallel
    group = GroupOfOne()
    core.set_expert_comm(group)
    core.add_request(_request("a", 2))
    core.add_request(_request("b", 1))
    core.step()
    core.step()
    core.dummy_step()
    assert group.gathered_rows == [2] * NULL_EP_NUM_LAYERS + [1] * NULL_EP_NUM_LAYERS + [0] * NULL_EP_NUM_LAYERS


def test_a_dense_core_has_no_expert_parallel_mode():
    class Dense(EngineCoreBase):
        add_request = abort = step = has_unfinished = load = None

    assert not Dense.supports_expert_parallel.fget(Dense.__new__(Dense))
    with pytest.raises(NotImplementedError, match="needs a mixture-of-experts model"):
        Dense.set_expert_comm(Dense.__new__(Dense), GroupOfOne())


def test_lockstep_steps_dummies_until_the_sync_then_pauses_and_counts_them(model_info):
    core = NullEngineCore(model_info)
    group = GroupOfOne()
    core.set_expert_comm(group)
    lockstep = Lockstep(0, group, core, sync_interval_steps=4)
    core.add_request(_request("a", 2))
    assert lockstep.waves.on_request(0) is not None  # paused: starts and asks the coordinator
    results = [lockstep.step() for _ in range(4)]
    finished = [o for outputs, _ in results for o in outputs if o.finish_reason == FinishReason.LENGTH]
    assert [o.request_id for o in finished] == ["a"]
    assert [completed for _, completed in results] == [None, None, None, 0]
    assert lockstep.num_dummy_steps == 2
    assert (lockstep.waves.wave, lockstep.waves.running) == (1, False)
    assert lockstep.num_waves_completed == 1


def test_lockstep_keeps_the_wave_while_work_is_left_at_the_sync(model_info):
    core = NullEngineCore(model_info)
    group = GroupOfOne()
    core.set_expert_comm(group)
    lockstep = Lockstep(0, group, core, sync_interval_steps=2)
    core.add_request(_request("long", 3))
    lockstep.waves.on_request(0)
    completions = [lockstep.step()[1] for _ in range(4)]
    assert completions == [None, None, None, 0]  # busy at the first sync (step 2), done by the second (step 4)
    assert lockstep.num_dummy_steps == 1


def test_a_pending_group_stops_the_rank_at_the_sync_keeping_its_requests_then_it_steps_in_the_new_wave(model_info):
    """Re-forming (group_membership.py): a later ExpertGroup makes a paused rank step to the sync, where it leaves
    the old group (closed, no more steps) with its request untouched; joined, it steps in the message's wave."""
    core = NullEngineCore(model_info)
    group = GroupOfOne()
    core.set_expert_comm(group)
    lockstep = Lockstep(0, group, core, sync_interval_steps=2)
    message = ExpertGroup("127.0.0.1", 1, 1, 0, generation=2, wave=5)
    assert lockstep.membership.on_group(message)  # healthy group: agree at the sync
    lockstep.waves.start_to_sync()
    assert lockstep.membership.to_join() is None
    core.add_request(_request("a", 10))
    outputs, _ = lockstep.step()
    assert len(outputs) == 1 and lockstep.can_step
    outputs, completed = lockstep.step()  # the sync: generation 2 is newer than the group's (0)
    assert completed is None and not lockstep.can_step and getattr(group, "closed", False)
    assert lockstep.membership.to_join() is message
    new_group = GroupOfOne()
    core.set_expert_comm(new_group)
    lockstep.regroup(new_group, message.wave)
    lockstep.membership.on_joined(message)
    assert lockstep.can_step and (lockstep.waves.wave, lockstep.waves.num_steps) == (5, 0)
    outputs, _ = lockstep.step()
    assert [o.new_token_ids for o in outputs] and core.has_unfinished()  # the third token of 10, nothing lost


def test_a_failed_exchange_commits_no_token(model_info):
    class Failing(GroupOfOne):
        def gather(self, x):
            raise RuntimeError("peer closed")

    core = NullEngineCore(model_info)
    core.set_expert_comm(Failing())
    core.add_request(_request("a", 1))
    with pytest.raises(RuntimeError):
        core.step()
    core.set_expert_comm(GroupOfOne())
    outputs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.LENGTH)]


def test_a_rank_removed_from_the_group_steps_no_more_whatever_the_coordinator_publishes(model_info):
    """A scale-down's removed rank (ExpertGroup rank -1) drains without the group: a LoadSnapshot saying the wave
    runs (rule (h)) must not make it a rank with a wave to step in (its drain would never end)."""
    core = NullEngineCore(model_info)
    group = GroupOfOne()
    core.set_expert_comm(group)
    lockstep = Lockstep(2, group, core)
    message = ExpertGroup("127.0.0.1", 1, 2, -1, generation=2, wave=3)
    lockstep.membership.on_group(message)
    lockstep.membership.on_sync(2)
    lockstep.leave()
    lockstep.regroup(None, message.wave)
    lockstep.membership.on_joined(message)
    assert lockstep.waves.on_snapshot(3, True)
    assert not lockstep.can_step and lockstep.group is None


def test_a_failed_sync_after_a_good_step_hands_over_the_step_outputs(model_info):
    class SyncBreaks(GroupOfOne):
        def all_reduce_sync(self, has_unfinished, generation):
            raise RuntimeError("peer closed")

    core = NullEngineCore(model_info)
    group = SyncBreaks()
    core.set_expert_comm(group)
    lockstep = Lockstep(0, group, core, sync_interval_steps=1)
    core.add_request(_request("a", 1))
    lockstep.waves.on_request(0)
    with pytest.raises(SyncFailed) as caught:
        lockstep.step()
    assert [(o.request_id, o.finish_reason) for o in caught.value.outputs] == [("a", FinishReason.LENGTH)]
