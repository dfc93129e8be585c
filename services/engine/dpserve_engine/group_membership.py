"""One rank's membership in the expert-parallel group across re-formations (elastic EP, a replaced rank): a pure
state machine, no sockets, no torch. The service (service.py) and Lockstep (lockstep.py) drive it.

The coordinator re-forms the group by sending every member an ExpertGroup of a later `generation` (a new port, the
new world size; rank -1 to a rank a scale-down removes). The old group's ranks must leave it at the same step:
a rank that leaves while a peer is inside a collective with it would leave that peer blocked until the group's
timeout. So leaving is agreed inside the group: the all-reduce every SYNC_INTERVAL_STEPS steps carries, beside
"has unfinished", the newest generation each rank has been sent (a MAX over ranks); the step where it exceeds the
group's generation is the one after which every rank stops (STOPPED), tears the group down and joins the new one,
which may need to wait for its own ExpertGroup (the messages travel on each rank's own socket). A paused rank with
a pending generation starts stepping so that the all-reduce comes (waves.start_to_sync).

When the old group is broken (a member died: `leave_now`; or a step's collective failed: BROKEN) there is nothing
to agree: the rank leaves at once and joins as soon as its ExpertGroup is here.

  MEMBER --(sync sees a newer generation)--> STOPPED --(its ExpertGroup is here)--> join --> MEMBER | OUTSIDE
  MEMBER --(a step failed)--> BROKEN --(a newer ExpertGroup)--> join
  MEMBER --(ExpertGroup with leave_now)--> join
"""

from __future__ import annotations

import dataclasses
import enum

from dpserve_shared.schema import ExpertGroup


class Phase(enum.Enum):
    MEMBER = "member"  # in a working group: steps as the waves say
    STOPPED = "stopped"  # left at the agreed step; waits for the ExpertGroup the ranks agreed on
    BROKEN = "broken"  # a step's collective failed: left; waits for a newer ExpertGroup
    OUTSIDE = "outside"  # member of no group (a scale-down removed the rank): steps no more


@dataclasses.dataclass
class GroupMembership:
    rank: int
    generation: int = 0  # of the group the rank is (or was last) in
    phase: Phase = Phase.MEMBER
    pending: ExpertGroup | None = None  # the newest ExpertGroup of a later generation
    agreed: int = 0  # the generation the ranks' all-reduce agreed to leave for

    @property
    def can_step(self) -> bool:
        return self.phase is Phase.MEMBER

    @property
    def sync_generation(self) -> int:
        """What this rank contributes to the all-reduce: the newest generation it was sent."""
        return self.pending.generation if self.pending is not None else self.generation

    def on_group(self, message: ExpertGroup) -> bool:
        """A later ExpertGroup arrived (a stale one is ignored). True when the rank must step to the next
        all-reduce so that the ranks agree to leave (a healthy group, no `leave_now`)."""
        if message.generation <= self.sync_generation:
            return False
        self.pending = message
        return self.phase is Phase.MEMBER and not message.leave_now

    def on_sync(self, max_generation: int) -> bool:
        """The all-reduce's newest generation (the same on every rank). True: leave after this step."""
        if self.phase is not Phase.MEMBER or max_generation <= self.generation:
            return False
        self.agreed = max_generation
        self.phase = Phase.STOPPED
        return True

    def on_failure(self) -> None:
        """A step's collective failed: the group is unusable."""
        if self.phase is Phase.MEMBER:
            self.phase = Phase.BROKEN

    def to_join(self) -> ExpertGroup | None:
        """The ExpertGroup to join now, if one is due: at once when the old group is broken or gone, after the
        agreed step otherwise (and only the generation agreed on, or a later one)."""
        message = self.pending
        if message is None:
            return None
        if message.leave_now or self.phase in (Phase.BROKEN, Phase.OUTSIDE):
            return message
        if self.phase is Phase.STOPPED and message.generation >= self.agreed:
            return message
        return None

    def on_joined(self, message: ExpertGroup) -> None:
        self.generation = message.generation
        self.phase = Phase.OUTSIDE if message.rank < 0 else Phase.MEMBER
        self.pending = None
        self.agreed = 0
