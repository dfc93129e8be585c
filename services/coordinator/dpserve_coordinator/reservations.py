"""Work routed to a rank that its engine has not reported yet, across every API server. Pure: no sockets.

Each API server reports how many requests (and prompt tokens) it has routed to each rank's engine since it
first did (`RoutedRequests`: RankCount per rank and engine id, cumulative); each engine reports how many it has
received from each API server since it started (`EngineStats.received`, cumulative). For a pair (API server,
engine) the reservation is `sent - received` (per component, never below 0), and a rank's is the sum over the
API servers for its current engine. Cumulative counts make a lost or repeated report harmless and a restarted
coordinator right from the first reports; keying by engine id makes a replaced engine start from nothing (what
was sent to the old one is not waited for). The totals go on every LoadSnapshot (EngineLoad.num_reserved /
_tokens), so a burst that several API servers route at once is spread instead of all of them picking the rank
that looked idle.

Work per report is O(ranks it names) (an API server's) or O(API servers it names) (an engine's); `version` grows
whenever a total changes, so that the server publishes a snapshot.
"""

from __future__ import annotations

_Pair = tuple[str, str]  # (frontend id, engine id)


class Reservations:
    def __init__(self) -> None:
        self._sent: dict[_Pair, tuple[int, int]] = {}
        self._received: dict[_Pair, tuple[int, int]] = {}
        self._rank_of: dict[str, int] = {}  # engine id -> rank (as its reports name it)
        self._frontends_of: dict[str, set[str]] = {}  # engine id -> API servers in a pair with it
        self._totals: dict[int, tuple[int, int]] = {}  # rank -> reserved (requests, tokens)
        self.version = 0

    def reserved(self, rank: int) -> tuple[int, int]:
        return self._totals.get(rank, (0, 0))

    # -- reports ---------------------------------------------------------------------------------------------------

    def on_sent(self, frontend_id: str, counts) -> None:
        """An API server's RoutedRequests.sent (RankCount: rank, engine_id, num_requests, num_tokens)."""
        for count in counts:
            self._rank_of.setdefault(count.engine_id, count.rank)
            self._update(self._sent, (frontend_id, count.engine_id), (count.num_requests, count.num_tokens))

    def on_received(self, rank: int, engine_id: str, counts) -> None:
        """An engine's EngineStats.received (FrontendCount: frontend_id, num_requests, num_tokens)."""
        self._rank_of[engine_id] = rank
        for count in counts:
            self._update(self._received, (count.frontend_id, engine_id), (count.num_requests, count.num_tokens))

    # -- who exists ------------------------------------------------------------------------------------------------

    def follow(self, serving: dict[int, str]) -> None:
        """The registry's serving ranks and their engine ids (call on a topology change): every other engine's
        pairs are dropped (its requests are re-sent or failed; nothing reaches it any more)."""
        live = set(serving.values())
        for engine_id in [e for e in self._rank_of if e not in live]:
            for frontend_id in list(self._frontends_of.get(engine_id, ())):
                self._drop((frontend_id, engine_id))
            self._rank_of.pop(engine_id, None)
            self._frontends_of.pop(engine_id, None)

    def drop_frontend(self, frontend_id: str) -> None:
        """An API server is gone: its requests were aborted."""
        for engine_id, frontends in self._frontends_of.items():
            if frontend_id in frontends:
                self._drop((frontend_id, engine_id))

    # -- bookkeeping -----------------------------------------------------------------------------------------------

    def _update(self, table: dict[_Pair, tuple[int, int]], pair: _Pair, value: tuple[int, int]) -> None:
        before = self._outstanding(pair)
        table[pair] = value
        self._frontends_of.setdefault(pair[1], set()).add(pair[0])
        self._changed(pair[1], before, self._outstanding(pair))

    def _drop(self, pair: _Pair) -> None:
        before = self._outstanding(pair)
        self._sent.pop(pair, None)
        self._received.pop(pair, None)
        self._frontends_of.get(pair[1], set()).discard(pair[0])
        self._changed(pair[1], before, (0, 0))

    def _outstanding(self, pair: _Pair) -> tuple[int, int]:
        sent = self._sent.get(pair)
        if sent is None:
            return 0, 0
        got = self._received.get(pair, (0, 0))
        return max(0, sent[0] - got[0]), max(0, sent[1] - got[1])

    def _changed(self, engine_id: str, before: tuple[int, int], after: tuple[int, int]) -> None:
        if before == after:
            return
        rank = self._rank_of.get(engine_id)
        if rank is None:
            return
        requests, tokens = self._totals.get(rank, (0, 0))
        requests, tokens = requests + after[0] - before[0], tokens + after[1] - before[1]
        if requests or tokens:
            self._totals[rank] = (requests, tokens)
        else:
            self._totals.pop(rank, None)
        self.version += 1
