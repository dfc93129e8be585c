"""The coordinator's index of every rank's prefix cache, and the deltas it publishes. Pure: no sockets, no clock
but the `now_s` it is given.

In: each engine's `KvEvents` (net stored/removed hashes per step, numbered from 1 per engine process). An event
applies when its number follows the last one applied for that rank; anything else (a gap, an engine this
coordinator has not heard from since it started or since the rank changed engines) is not applied and the
engine is asked for a snapshot (`KvResync`, at most every RESYNC_INTERVAL_S per rank), which replaces the rank's
set. The ranks' blocks stay in the index meanwhile (a slightly stale view routes better than none).

Out: `take_delta()` (the server calls it every publish tick) returns one `KvDelta` with the net change of every
rank since the previous one, numbered from 1 for this `index_id`; `snapshot()` the whole index as of the last
delta (take the delta first, so that nothing is in neither). Work per event is O(its blocks); per delta
O(changed blocks); the frontends all get the same PUB message.
"""

from __future__ import annotations

import dataclasses

from dpserve_shared.block_index import BlockIndex
from dpserve_shared.schema import KvDelta, KvEvents, KvIndexSnapshot, RankBlocks

RESYNC_INTERVAL_S = 1.0  # ask an engine for a snapshot again after this long without one


@dataclasses.dataclass
class _Pending:
    """A rank's net change since the last delta: `reset` (emptied first), then hash -> held or not."""

    reset: bool = False
    changes: dict[int, bool] = dataclasses.field(default_factory=dict)

    def to_wire(self, rank: int) -> RankBlocks:
        stored = [h for h, held in self.changes.items() if held]
        removed = [] if self.reset else [h for h, held in self.changes.items() if not held]
        return RankBlocks(rank, stored, removed, self.reset)


class KvIndex:
    def __init__(self, index_id: int):
        self.index_id = index_id
        self.seq = 0  # the last KvDelta taken
        self.blocks = BlockIndex()
        self._engines: dict[int, str] = {}  # rank -> the engine id whose events it follows
        self._engine_seq: dict[int, int] = {}  # rank -> its engine's last applied KvEvents.seq (absent: resyncing)
        self._resync_asked_s: dict[int, float] = {}
        self._pending: dict[int, _Pending] = {}

    # -- in: engines -----------------------------------------------------------------------------------------------

    def on_events(self, rank: int, engine_id: str, events: KvEvents, now_s: float) -> bool:
        """Apply one engine's events; True when that engine should be sent `KvResync`."""
        if self._engines.get(rank) != engine_id:
            self.reset_rank(rank)  # another engine serves the rank now: the old one's blocks are gone
            self._engines[rank] = engine_id
            self._engine_seq[rank] = 0  # a new process numbers from 1; a re-registered one resyncs
        if events.is_snapshot:
            self.reset_rank(rank, keep_engine=True)
            self._store(rank, events.stored)
            self._engine_seq[rank] = events.seq
            self._resync_asked_s.pop(rank, None)
            return False
        last = self._engine_seq.get(rank)
        if last is not None and events.seq == last + 1:
            self._engine_seq[rank] = events.seq
            self._remove(rank, events.removed)
            self._store(rank, events.stored)
            return False
        if last is not None and events.seq <= last:
            return False  # a duplicate
        self._engine_seq.pop(rank, None)  # a gap: nothing applies until its snapshot
        asked = self._resync_asked_s.get(rank)
        if asked is not None and now_s - asked < RESYNC_INTERVAL_S:
            return False
        self._resync_asked_s[rank] = now_s
        return True

    def reset_rank(self, rank: int, keep_engine: bool = False) -> None:
        """The rank's blocks are gone (its engine died, was replaced or removed; or a snapshot follows)."""
        if not keep_engine:
            self._engines.pop(rank, None)
            self._engine_seq.pop(rank, None)
            self._resync_asked_s.pop(rank, None)
        if self.blocks.num_blocks(rank) or rank in self._pending:
            self._pending[rank] = _Pending(reset=True)
        self.blocks.clear_rank(rank)

    def follow(self, serving: dict[int, str]) -> None:
        """The registry's ranks that serve (READY or DRAINING) and their engine ids: every other rank's blocks are
        dropped. Call when the topology changed (O(ranks))."""
        for rank in set(self._engines) | set(self.blocks.ranks()):
            if rank not in serving or (rank in self._engines and self._engines[rank] != serving[rank]):
                self.reset_rank(rank)

    def _store(self, rank: int, hashes: list[int]) -> None:
        if not hashes:
            return
        self.blocks.store(rank, hashes)
        changes = self._pending.setdefault(rank, _Pending()).changes
        for h in hashes:
            changes[h] = True

    def _remove(self, rank: int, hashes: list[int]) -> None:
        if not hashes:
            return
        self.blocks.remove(rank, hashes)
        changes = self._pending.setdefault(rank, _Pending()).changes
        for h in hashes:
            changes[h] = False

    # -- out: frontends --------------------------------------------------------------------------------------------

    def take_delta(self) -> KvDelta | None:
        """The net change since the previous delta (None: nothing changed)."""
        if not self._pending:
            return None
        self.seq += 1
        ranks = [pending.to_wire(rank) for rank, pending in sorted(self._pending.items())]
        self._pending.clear()
        return KvDelta(self.index_id, self.seq, ranks)

    def snapshot(self) -> KvIndexSnapshot:
        """The whole index as of delta `seq` (call `take_delta` first and publish what it returns)."""
        assert not self._pending, "take the pending delta before a snapshot"
        ranks = [RankBlocks(rank, self.blocks.blocks_of(rank)) for rank in self.blocks.ranks()]
        return KvIndexSnapshot(self.index_id, self.seq, ranks)
