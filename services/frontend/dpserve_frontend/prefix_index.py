"""This API server's mirror of the coordinator's prefix-cache index (coordinator kv_index.py). Pure: no sockets,
no clock but the `now_s` it is given.

It follows the coordinator's `KvDelta`s (PUB) in order. Until it has a `KvIndexSnapshot`, after a gap in the
deltas' numbers, or when the coordinator changed (another `index_id`: it restarted), it is out of sync: it
keeps the deltas that arrive (up to MAX_BUFFERED) and wants a snapshot (`wants_snapshot`, at most every
RESYNC_INTERVAL_S); the snapshot replaces the index and the kept deltas that follow it are applied. Routing
reads it while out of sync too: the blocks it last knew are a better guess than none.

Every API server applies the same deltas to the same snapshot, so given the same loads they make the same
choice (router.py).
"""

from __future__ import annotations

from dpserve_shared.block_index import BlockIndex
from dpserve_shared.schema import KvDelta, KvIndexSnapshot

RESYNC_INTERVAL_S = 1.0
MAX_BUFFERED = 1024


class PrefixIndex:
    def __init__(self) -> None:
        self.blocks = BlockIndex()
        self.index_id: int | None = None
        self.seq = 0
        self.is_synced = False
        self._buffer: list[KvDelta] = []
        self._asked_s: float | None = None
        self.num_resyncs = 0  # snapshots applied

    def on_delta(self, delta: KvDelta) -> None:
        if self.is_synced and delta.index_id == self.index_id:
            if delta.seq <= self.seq:
                return  # already in the snapshot
            if delta.seq == self.seq + 1:
                self._apply(delta)
                return
        self.is_synced = False  # a gap, a new coordinator, or no snapshot yet
        if len(self._buffer) >= MAX_BUFFERED:
            self._buffer.clear()
        self._buffer.append(delta)

    def on_snapshot(self, snapshot: KvIndexSnapshot) -> None:
        self.blocks.clear()
        for change in snapshot.ranks:
            self.blocks.store(change.rank, change.stored)
        self.index_id, self.seq = snapshot.index_id, snapshot.seq
        self.is_synced = True
        self._asked_s = None
        self.num_resyncs += 1
        buffered, self._buffer = self._buffer, []
        for delta in sorted(buffered, key=lambda d: d.seq):
            if delta.index_id == self.index_id:
                self.on_delta(delta)

    def wants_snapshot(self, now_s: float) -> bool:
        """True when out of sync and no snapshot was asked for within RESYNC_INTERVAL_S (it is asked now)."""
        if self.is_synced or (self._asked_s is not None and now_s - self._asked_s < RESYNC_INTERVAL_S):
            return False
        self._asked_s = now_s
        return True

    def lose_sync(self) -> None:
        """Deltas may have been missed (this API server registered again): want a snapshot now."""
        self.is_synced = False
        self._asked_s = None

    def forget_rank(self, rank: int) -> None:
        """A rank this API server dropped (its coordinator's delta will say so too)."""
        self.blocks.clear_rank(rank)

    def match(self, hashes: list[int]) -> dict[int, int]:
        """rank -> how many leading blocks of `hashes` its prefix cache holds (ranks with none absent)."""
        return self.blocks.match(hashes)

    def _apply(self, delta: KvDelta) -> None:
        for change in delta.ranks:
            self.blocks.apply(change)
        self.seq = delta.seq
