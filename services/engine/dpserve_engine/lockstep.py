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

A step that fails (a peer died: its collective fails; the model raised) leaves the ranks' collectives out of
step for good, so the rank fails its requests and exits; re-forming the group with a replacement (and scaling
an expert-parallel deployment) is not supported yet, and the coordinator does not replace the rank.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from dpserve_shared.schema import RequestOutput
from dpserve_shared.waves import SYNC_INTERVAL_STEPS, LockstepEngineWaves

from dpserve_engine.interface import EngineCoreBase

if TYPE_CHECKING:  # it imports torch, which a dense null engine never loads
    from dpserve_engine.expert_parallel import ExpertGroup

log = logging.getLogger("dpserve.engine")


class Lockstep:
    def __init__(self, rank: int, group: ExpertGroup, core: EngineCoreBase,
                 sync_interval_steps: int = SYNC_INTERVAL_STEPS):  # fmt: skip
        self.waves = LockstepEngineWaves(rank, sync_interval_steps)
        self.group = group
        self.core = core
        self.num_dummy_steps = 0
        self.num_waves_completed = 0

    @property
    def collective_time_s(self) -> float:
        return self.group.collective_time_s

    def step(self) -> tuple[list[RequestOutput], int | None]:
        """One step of the running wave (the core's, or a dummy one), then the all-reduce when it is due. Returns
        the step's outputs and the wave that completed after it, if one did."""
        if self.core.has_unfinished():
            outputs = self.core.step()
        else:
            self.core.dummy_step()
            self.num_dummy_steps += 1
            outputs = []
        completed = None
        if self.waves.on_step():
            completed = self.waves.on_sync(self.group.all_reduce_has_unfinished(self.core.has_unfinished()))
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
