"""The engine's lock-step side in-process: the null engine's expert-parallel mode and `Lockstep` (lockstep.py) over
a group of one rank, whose collectives are the identity (what a world size of 1 computes). The same code over 2
real processes: tests/integration/test_expert_parallel_group.py and test_lockstep_waves.py."""

from __future__ import annotations

import pytest

from dpserve_engine.interface import EngineCoreBase
from dpserve_engine.lockstep import Lockstep
from dpserve_engine.null_core import NULL_EP_NUM_LAYERS, NullEngineCore
from dpserve_shared.schema import EngineRequest, FinishReason, SamplingParams

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
