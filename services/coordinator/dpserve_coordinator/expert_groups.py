"""The expert-parallel group's formations (--enable-expert-parallel): the first one, each re-formation of a scale
step, and the repair after a member died (docs/architecture.md "Re-forming the expert-parallel group").

A formation (`form`) is one generation: every member gets ExpertGroup(generation, rank 0's node, a port free
there, the world size, its rank; rank -1 to a rank that leaves), and the formation is done when each of them has
answered ExpertGroupJoined for that generation. The first generation starts the ranks paused in wave 0; a later
one moves the coordinator's waves to a new wave, running (LockstepCoordinatorWaves.on_regroup), which every member
steps in from its join on. Formations run one at a time (a lock): a scale step waits for a repair and the other
way round.

Two ways to leave the old group (group_membership.py on the engines):
- healthy (a scale step): `leave_now` False; the members leave at the step where their all-reduce first sees the
  new generation, so nobody is left inside a collective; StartWave makes paused ranks step to that sync.
- broken (a member died, or a member reported ExpertGroupBroken): `leave_now` True, at once.

Repair (`watch`, a task): the group is broken when a member's engine is DEAD or is no longer the one that joined
(a replacement registered), or a member reported ExpertGroupBroken for the current generation. The supervisor
replaces a dead rank as for dense models; once every member is READY again, and each has been heard from since
the break was seen (a survivor's report usually comes before the supervisor sees the death: re-forming then
would send the dead engine its ExpertGroup and leave the others waiting in the join), the group is re-formed with
the same ranks. The survivors meanwhile keep their requests without stepping (their collectives with the dead rank
failed at once: its sockets closed), and frontends re-send the dead rank's requests to them (engine_pool.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

from dpserve_shared.net import free_port
from dpserve_shared.schema import EngineState, ExpertGroup, ExpertGroupBroken, ExpertGroupJoined, StartWave
from dpserve_shared.timing import EXPERT_GROUP_TIMEOUT_S
from dpserve_shared.waves import LockstepCoordinatorWaves

from dpserve_coordinator.registry import Registry

log = logging.getLogger("dpserve.coordinator")

FORM_TIMEOUT_S = EXPERT_GROUP_TIMEOUT_S + 10.0  # every member's join gives up after EXPERT_GROUP_TIMEOUT_S
# A member is alive after a break when it was heard from this long after the break was seen (heartbeats come every
# HEARTBEAT_INTERVAL_S, EngineStats more often): a dead engine's last messages may still be in the queue.
ALIVE_AFTER_BREAK_S = 0.3
_POLL_S = 0.05

Reply = Callable[[str, object], Awaitable[None]]  # one message to one DEALER on the control socket
Publish = Callable[[object], None]  # one broadcast


class FormationFailed(Exception):
    pass


def _is_local(host: str) -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


class ExpertGroups:
    def __init__(self, registry: Registry, waves: LockstepCoordinatorWaves, reply: Reply, publish: Publish,
                 default_host: str):  # fmt: skip
        self._registry = registry
        self._waves = waves
        self._reply = reply
        self._publish = publish
        self._default_host = default_host
        self.generation = 0
        self.members: dict[int, str] = {}  # rank -> the engine id that joined the current generation
        self.num_repairs = 0
        self.last_repair_s = 0.0  # how long the last repair took, from the death seen to the group joined
        self._lock = asyncio.Lock()
        self._joined: dict[int, set[str]] = {}  # generation -> engine ids that answered
        self._reported_broken = False
        self._is_closed = False

    def close(self) -> None:
        """The coordinator is stopping: its ranks leave, nothing is to be repaired."""
        self._is_closed = True

    def adopt(self, ranks: list[int]) -> None:
        """The ranks' engines outlived a coordinator before this one, in a group of a generation this one does not
        know: count on from one surely later (the wall clock's seconds), with them as the members."""
        self.generation = max(self.generation, int(time.time()))
        engines = self._registry.engines
        self.members = {rank: engines[rank].engine_id for rank in ranks if rank in engines}

    # -- forming ------------------------------------------------------------------------------------------------

    async def form(self, ranks: list[int], leavers: list[int] = (), leave_now: bool = False,
                   timeout_s: float = FORM_TIMEOUT_S) -> None:  # fmt: skip
        """One formation of `ranks` (every one READY or DRAINING, registered); `leavers` leave the old group and
        join none. Raises FormationFailed naming the ranks that did not answer within `timeout_s`."""
        async with self._lock:
            await self._form(ranks, list(leavers), leave_now, timeout_s)

    async def _form(self, ranks: list[int], leavers: list[int], leave_now: bool, timeout_s: float) -> None:
        registry = self._registry
        generation = self.generation + 1
        ids = {rank: registry.engines[rank].engine_id for rank in ranks + leavers}
        host = registry.engines[ranks[0]].node_ip or self._default_host
        port = free_port(host if _is_local(host) else self._default_host)
        wave = self._waves.on_regroup() if generation > 1 else 0
        how = ("" if generation == 1 else ", the old group left at once" if leave_now
               else ", the old group left at the ranks' next sync")
        log.info("expert-parallel group, generation %d: ranks %s at tcp://%s:%d%s%s", generation, ranks, host, port,
                 f", ranks {leavers} leave" if leavers else "", how)  # fmt: skip
        self._joined[generation] = set()
        self.generation = generation
        self._reported_broken = False
        for rank in ranks + leavers:
            member_rank = rank if rank in ranks else -1
            await self._reply(ids[rank], ExpertGroup(host, port, len(ranks), member_rank, EXPERT_GROUP_TIMEOUT_S,
                                                     generation, leave_now, wave))  # fmt: skip
        if generation > 1 and not leave_now:
            self._publish(StartWave(wave))  # paused ranks step to the sync where they leave together
        started = time.monotonic()
        expected = set(ids.values())
        while not expected <= self._joined[generation]:
            if time.monotonic() - started > timeout_s:
                missing = sorted(r for r, i in ids.items() if i not in self._joined[generation])
                raise FormationFailed(f"expert-parallel group generation {generation}: ranks {missing} did not join "
                                      f"within {timeout_s:.0f} s")  # fmt: skip
            await asyncio.sleep(_POLL_S)
        self.members = {rank: ids[rank] for rank in ranks}
        del self._joined[generation]
        log.info("expert-parallel group, generation %d: %d ranks joined in %.2f s", generation, len(ranks),
                 time.monotonic() - started)  # fmt: skip

    def on_joined(self, engine_id: str, msg: ExpertGroupJoined) -> None:
        joined = self._joined.get(msg.generation)
        if joined is not None:
            joined.add(engine_id)

    def on_broken(self, engine_id: str, msg: ExpertGroupBroken) -> None:
        if msg.generation == self.generation and engine_id in self.members.values():
            log.warning("expert-parallel group generation %d: a rank reports it broken (%s)", msg.generation,
                        msg.reason)  # fmt: skip
            self._reported_broken = True

    # -- repair -------------------------------------------------------------------------------------------------

    def broken_ranks(self) -> list[int]:
        """Members whose engine is gone, DEAD, or not the one that joined (replaced)."""
        engines = self._registry.engines
        return sorted(rank for rank, engine_id in self.members.items()
                      if rank not in engines or engines[rank].state == EngineState.DEAD
                      or engines[rank].engine_id != engine_id)  # fmt: skip

    def _can_repair(self, broken_since: float) -> bool:
        """Every member serves (a replacement registered) and was heard from since the break was seen."""
        engines = self._registry.engines
        return all(rank in engines and engines[rank].state in (EngineState.READY, EngineState.DRAINING)
                   and engines[rank].last_seen_s >= broken_since + ALIVE_AFTER_BREAK_S
                   for rank in self.members)  # fmt: skip

    async def watch(self) -> None:
        """Re-form the group with the same ranks once it is broken and every member serves again."""
        broken_since: float | None = None
        while True:
            await asyncio.sleep(_POLL_S)
            if not self.members or self._lock.locked() or self._is_closed:
                continue
            broken = self.broken_ranks()
            if not broken and not self._reported_broken:
                broken_since = None
                continue
            if broken_since is None:
                broken_since = time.monotonic()
                log.warning("expert-parallel group generation %d is broken (%s); re-forming it once every rank "
                            "serves again", self.generation,
                            f"ranks {broken} gone" if broken else "a rank reported a failed step")  # fmt: skip
            if not self._can_repair(broken_since):
                continue
            try:
                await self.form(sorted(self.members), leave_now=True)
            except FormationFailed as e:
                log.error("%s; trying again when the ranks serve", e)
                continue
            self.num_repairs += 1
            self.last_repair_s = time.monotonic() - broken_since
            log.info("expert-parallel group repaired %.1f s after it broke", self.last_repair_s)
            broken_since = None
