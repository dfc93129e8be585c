"""Which engine rank gets the next request. Pure: no sockets, no clock.

Scheduling rule (vLLM's data-parallel load balancing, with its known fixes):

    cost(rank) = 4 * (waiting + sent) + running

`waiting` and `running` come from the latest `LoadSnapshot` the coordinator published; `sent` counts the
requests this frontend routed to the rank since that snapshot, so a burst that arrives between two snapshots
(which come at most every 100 ms) is spread instead of all landing on the rank that looked idle. A request's
`sent` weight is its number of sequences (`n` children and every prompt of a batch go to one rank). A new
snapshot replaces the local counts. The lowest cost wins; ties go to the first rank at or after a start index
that rotates after every pick, so equal ranks take turns instead of rank 0 taking every tie.

Only ranks the topology lists as READY are candidates. A rank can be pinned (HTTP header
`X-data-parallel-rank`); pinning a rank that is not serving is the caller's error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from dpserve_shared.schema import EngineLoad

WAITING_WEIGHT = 4


class NoEngineAvailable(Exception):
    """No rank is serving."""


class RankNotServing(Exception):
    """A pinned rank that is not serving."""

    def __init__(self, rank: int, serving: list[int]):
        super().__init__(f"data-parallel rank {rank} is not serving; serving ranks: {serving}")
        self.rank = rank
        self.serving = serving


@dataclasses.dataclass
class _RankLoad:
    num_waiting: int = 0
    num_running: int = 0
    num_sent: int = 0  # sequences this frontend sent since the snapshot

    def cost(self) -> int:
        return WAITING_WEIGHT * (self.num_waiting + self.num_sent) + self.num_running


class Router:
    def __init__(self) -> None:
        self._loads: dict[int, _RankLoad] = {}
        self._serving: list[int] = []  # sorted
        self._next_start = 0

    @property
    def serving_ranks(self) -> list[int]:
        return list(self._serving)

    def set_serving(self, ranks: Iterable[int]) -> None:
        """The ranks new requests may go to (READY in the topology and connected)."""
        self._serving = sorted(set(ranks))
        for rank in self._serving:
            self._loads.setdefault(rank, _RankLoad())
        for rank in list(self._loads):
            if rank not in self._serving:
                del self._loads[rank]

    def update_snapshot(self, loads: Iterable[EngineLoad]) -> None:
        """A new coordinator snapshot: replaces waiting/running and forgets the local sends."""
        for load in loads:
            entry = self._loads.get(load.rank)
            if entry is not None:
                entry.num_waiting = load.num_waiting
                entry.num_running = load.num_running
        for entry in self._loads.values():
            entry.num_sent = 0

    def pick(self, pinned_rank: int | None = None, num_seqs: int = 1, exclude: int | None = None) -> int:
        """Choose a rank (other than `exclude`: one that just gave a request back) and count `num_seqs` sends to
        it."""
        if pinned_rank is not None:
            if pinned_rank not in self._loads:
                raise RankNotServing(pinned_rank, self.serving_ranks)
            rank = pinned_rank
        else:
            rank = self._lowest_cost(exclude)
        self._loads[rank].num_sent += num_seqs
        return rank

    def _lowest_cost(self, exclude: int | None = None) -> int:
        ranks = self._serving if exclude is None else [r for r in self._serving if r != exclude]
        if not ranks:
            raise NoEngineAvailable("no engine rank is serving")
        start = self._next_start % len(ranks)
        best_rank, best_cost = -1, None
        for i in range(len(ranks)):
            rank = ranks[(start + i) % len(ranks)]
            cost = self._loads[rank].cost()
            if best_cost is None or cost < best_cost:
                best_rank, best_cost = rank, cost
        self._next_start = start + 1
        return best_rank

    def cost(self, rank: int) -> int:
        return self._loads[rank].cost()
