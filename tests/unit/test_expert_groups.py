"""The coordinator's expert-parallel group formations (expert_groups.py) without sockets: what each member is sent
per generation, the waves a re-formed group steps in, and when a broken group is repaired. The engines' answers
come from a fake peer (the `reply` it is given records and answers ExpertGroupJoined); the same over real
processes: tests/integration/test_elastic_ep.py."""

from __future__ import annotations

import asyncio

import pytest

from dpserve_coordinator.expert_groups import ALIVE_AFTER_BREAK_S, ExpertGroups, FormationFailed
from dpserve_coordinator.registry import Registry
from dpserve_shared.schema import (
    PROTOCOL_VERSION,
    ExpertGroup,
    ExpertGroupBroken,
    ExpertGroupJoined,
    ModelInfo,
    RegisterEngine,
    StartWave,
)
from dpserve_shared.waves import LockstepCoordinatorWaves

MODEL = ModelInfo(name="m", root="-", max_model_len=64, vocab_size=10, tokenizer_json="{}")

pytestmark = pytest.mark.timeout(30)


def _register(registry: Registry, rank: int, engine_id: str, now_s: float = 0.0) -> None:
    registry.register_engine(RegisterEngine(PROTOCOL_VERSION, rank, engine_id, f"tcp://h:{1000 + rank}", MODEL,
                                            node_ip="127.0.0.1"), now_s)  # fmt: skip


class Peers:
    """The engines' side: records every ExpertGroup and answers ExpertGroupJoined (unless silent)."""

    def __init__(self):
        self.sent: list[tuple[str, ExpertGroup]] = []
        self.published: list = []
        self.silent: set[str] = set()
        self.groups: ExpertGroups | None = None

    async def reply(self, engine_id: str, msg) -> None:
        self.sent.append((engine_id, msg))
        if engine_id not in self.silent:
            self.groups.on_joined(engine_id, ExpertGroupJoined(msg.generation, is_member=msg.rank >= 0))


def _setup(num_ranks: int) -> tuple[Registry, LockstepCoordinatorWaves, Peers, ExpertGroups]:
    registry = Registry(num_ranks)
    for rank in range(num_ranks):
        _register(registry, rank, f"e{rank}")
    waves = LockstepCoordinatorWaves(wave=4)
    peers = Peers()
    peers.groups = ExpertGroups(registry, waves, peers.reply, peers.published.append, "127.0.0.1")
    return registry, waves, peers, peers.groups


def test_the_first_group_starts_paused_and_a_scale_step_re_forms_at_the_sync_in_a_new_running_wave():
    async def scenario():
        registry, waves, peers, groups = _setup(3)
        await groups.form([0, 1])
        assert [(i, m.generation, m.rank, m.world_size, m.leave_now, m.wave) for i, m in peers.sent] == [
            ("e0", 1, 0, 2, False, 0), ("e1", 1, 1, 2, False, 0)]
        assert (waves.wave, waves.running) == (4, False) and peers.published == []
        peers.sent.clear()
        await groups.form([0, 1, 2])  # scale up: the old members leave at their next sync
        assert [(i, m.generation, m.rank, m.world_size, m.leave_now, m.wave) for i, m in peers.sent] == [
            ("e0", 2, 0, 3, False, 5), ("e1", 2, 1, 3, False, 5), ("e2", 2, 2, 3, False, 5)]
        assert (waves.wave, waves.running) == (5, True)
        assert peers.published == [StartWave(5)]  # paused ranks step to that sync
        assert len({m.port for _, m in peers.sent}) == 1
        peers.sent.clear()
        await groups.form([0, 1], leavers=[2])  # scale down: rank 2 leaves and joins none
        assert [(i, m.rank, m.world_size) for i, m in peers.sent] == [("e0", 0, 2), ("e1", 1, 2), ("e2", -1, 2)]
        assert groups.members == {0: "e0", 1: "e1"} and groups.generation == 3

    asyncio.run(scenario())


def test_a_formation_names_the_ranks_that_did_not_join():
    async def scenario():
        registry, waves, peers, groups = _setup(2)
        peers.silent.add("e1")
        with pytest.raises(FormationFailed, match=r"ranks \[1\] did not join"):
            await groups.form([0, 1], timeout_s=0.2)

    asyncio.run(scenario())


def test_a_dead_member_is_repaired_with_its_replacement_once_every_member_was_heard_from():
    async def scenario():
        registry, waves, peers, groups = _setup(2)
        await groups.form([0, 1])
        watcher = asyncio.create_task(groups.watch())
        try:
            groups.on_broken("e0", ExpertGroupBroken(1, "peer closed"))  # the survivor's report comes first
            await asyncio.sleep(0.3)
            assert groups.generation == 1  # rank 1's engine not heard from since: it may be the dead one
            registry.mark_dead(1, "engine process exited with code -9")
            assert groups.broken_ranks() == [1]
            await asyncio.sleep(0.2)
            assert groups.generation == 1  # no replacement yet
            now = asyncio.get_running_loop().time()  # registry times are time.monotonic(), as the loop's
            _register(registry, 1, "e1-new", now + ALIVE_AFTER_BREAK_S)
            registry.heartbeat("e0", now + ALIVE_AFTER_BREAK_S)
            for _ in range(40):
                if groups.num_repairs:
                    break
                await asyncio.sleep(0.05)
            assert groups.num_repairs == 1 and groups.members == {0: "e0", 1: "e1-new"}
            repair = [(i, m.generation, m.leave_now) for i, m in peers.sent if m.generation == 2]
            assert repair == [("e0", 2, True), ("e1-new", 2, True)]
        finally:
            watcher.cancel()

    asyncio.run(scenario())


def test_a_stale_or_foreign_broken_report_is_ignored():
    async def scenario():
        registry, waves, peers, groups = _setup(2)
        await groups.form([0, 1])
        await groups.form([0, 1])
        groups.on_broken("e0", ExpertGroupBroken(1, "old"))
        groups.on_broken("stranger", ExpertGroupBroken(2, "?"))
        assert not groups._reported_broken

    asyncio.run(scenario())


def test_a_scale_to_a_size_that_does_not_divide_the_experts_is_refused():
    from dpserve_coordinator.scaling import Scaler
    from dpserve_shared.schema import ScaleRequest

    registry = Registry(2)
    for rank in range(2):
        registry.register_engine(RegisterEngine(PROTOCOL_VERSION, rank, f"e{rank}", f"tcp://h:{rank}", MODEL,
                                                num_experts=4), 0.0)  # fmt: skip
    groups = ExpertGroups(registry, LockstepCoordinatorWaves(), None, None, "127.0.0.1")
    scaler = Scaler(registry, None, None, 10.0, groups)
    scaler.open()
    ack = scaler.request("admin", ScaleRequest(3), "tcp://h:1")
    assert not ack.accepted and "must divide the model's 4 experts" in ack.error and "got 3" in ack.error
