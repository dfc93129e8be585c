"""Lock-step stepping of an expert-parallel rank (--enable-expert-parallel): the engine's side of the wave protocol.

With the experts sharded over the ranks every step of every rank is a set of collectives over all ranks, so
while a wave runs every rank steps: the core's step when it has requests, else a dummy step (the same
collectives with 0 rows). Every SYNC_INTERVAL_STEPS steps the ranks all-reduce "has unfinished requests"; when no
rank has, all of them pause after that same step, move to the next wave, and rank 0 sends WaveComplete to the
coordinator. The rules for starting (a request, StartWave, the coordinator's LoadSnapshot) and the races they
settle are dpserve_shared.waves' LockstepEngineWaves; this module runs them against a core and the group.

Where the step runs: on the service's one thread, between socket polls, as for dense models. A collective blocks
that thread until every rank has reached it. That cannot deadlock: a rank enters a collective only while it is in
a wave, every rank of the wave reaches the same collective (the same number of steps, each with the same
collectives), and a paused rank is not blocked, it polls its sockets and is started by StartWave, by the next
LoadSnapshot that says its wave runs, or by a request of its own. Heartbeats go from their own thread
(coordinator_link.py), so a rank waiting in a collective is not taken for dead; messages that arrive meanwhile
wait in ZMQ's queues for the next poll. Running the step in a thread of its own would not help: its outputs and
the pause decision are needed before the next poll anyway, and two threads would have to agree on the wave.

Idle: a paused rank polls with the service's idle timeout and runs nothing, so its dummy-step counter stops.

Re-forming the group (elastic EP, a replaced rank; group_membership.py): the sync's all-reduce also carries the
newest group generation each rank was sent, and the step where it shows a newer one is the last in the old group
for every rank (`leave`, then `regroup` with the new group). A step that fails (a peer died: its collective fails
at once, the peer's sockets being closed; or the model raised) leaves the ranks' collectives out of step, so the
rank leaves the group and waits for the coordinator's next one, keeping its requests (a core's step that raises
has committed no token: the null engine exchanges before it generates, EngineCore's forward runs before it
samples).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from dpserve_shared.schema import RequestOutput
from dpserve_shared.waves import SYNC_INTERVAL_STEPS, LockstepEngineWaves

from dpserve_engine.group_membership import GroupMembership
from dpserve_engine.interface import EngineCoreBase

if TYPE_CHECKING:  # it imports torch, which a dense null engine never loads
    from dpserve_engine.expert_parallel import ExpertGroup

log = logging.getLogger("dpserve.engine")


class SyncFailed(RuntimeError):
    """The all-reduce after a step failed (the group broke); the step itself succeeded: its `outputs` (tokens the
    core committed) must still reach their frontends."""

    def __init__(self, outputs: list[RequestOutput], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.outputs = outputs


class Lockstep:
    def __init__(self, rank: int, group: ExpertGroup, core: EngineCoreBase,
                 sync_interval_steps: int = SYNC_INTERVAL_STEPS):  # fmt: skip
        self.waves = LockstepEngineWaves(rank, sync_interval_steps)
        self.membership = GroupMembership(rank)
        self.group: ExpertGroup | None = group
        self.core = core
        self.num_dummy_steps = 0
        self.num_waves_completed = 0
        self._past_collective_time_s = 0.0  # in the groups before this one

    @property
    def collective_time_s(self) -> float:
        return self._past_collective_time_s + (self.group.collective_time_s if self.group is not None else 0.0)

    @property
    def can_step(self) -> bool:
        return self.waves.running and self.membership.can_step

    def leave(self) -> None:
        """Leave the group (agreed, broken, or told to at once): stop stepping and tear it down."""
        self.waves.on_leave()
        if self.group is not None:
            self._past_collective_time_s += self.group.collective_time_s
            self.group.close()
            self.group = None

    def regroup(self, group: ExpertGroup | None, wave: int) -> None:
        """Joined a re-formed group (None: none, the rank was removed): step in `wave` from now on."""
        self.group = group
        if group is not None:
            self.waves.on_regroup(wave)

    def step(self) -> tuple[list[RequestOutput], int | None]:
        """One step of the running wave (the core's, or a dummy one), then the all-reduce when it is due. Returns
        the step's outputs and the wave that completed after it, if one did. Raises what the step raised (nothing
        committed), or SyncFailed (with the step's outputs) when the all-reduce failed."""
        if self.core.has_unfinished():
            outputs = self.core.step()
        else:
            self.core.dummy_step()
            self.num_dummy_steps += 1
            outputs = []
        completed = None
        if self.waves.on_step():
            try:
                has_unfinished, generation = self.group.all_reduce_sync(self.core.has_unfinished(),
                                                                        self.membership.sync_generation)
            except Exception as e:  # noqa: BLE001 - torch raises several kinds
                raise SyncFailed(outputs, e) from e
            completed = self.waves.on_sync(has_unfinished)
            if self.membership.on_sync(generation):
                log.info("leaving the expert-parallel group of generation %d for generation %d at this step's sync "
                         "(every rank does)", self.membership.generation, generation)  # fmt: skip
                self.leave()
            if completed is not None:
                self.num_waves_completed += 1
                log.debug("wave %d complete: every rank paused (%d dummy steps so far)", completed,
                          self.num_dummy_steps)  # fmt: skip
        return outputs, completed


def hold(poll, timeout_s: float) -> float:
    """Wait until `poll(ms)` says a message is pending, for up to `timeout_s`; returns the time held (the test
    hook ServiceSettings.hold_first_pause_s)."""
    started = time.monotonic()
    remaining_ms = int(timeout_s * 1000)
    while remaining_ms > 0 and not poll(min(remaining_ms, 100)):
        remaining_ms = int((timeout_s - (time.monotonic() - started)) * 1000)
    return time.monotonic() - started
