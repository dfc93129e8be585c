"""Which engine rank gets the next request. Pure: no sockets, no clock.

Three policies (`RoutingPolicy`, --routing): cache-aware (the default: docs/benchmarks.md, session 11, has it
1.29 x least-loaded's throughput on shared prefixes and 1.02 x with no reuse, real model at DP=2; the lowest
estimated time to first token, routing_cost.py: the prompt's tokens not in the rank's prefix cache plus the
prefill already queued there, over the rank's measured prefill rate, plus its decode and KV pressure; ties start
at the prompt's first block hash, so every API server given the same view picks the same rank; estimates within
TIE_TOLERANCE_S or TIE_TOLERANCE_FRACTION of the best are a tie, which the least-loaded cost below settles, so
requests the cache does not care about, and a burst of them, spread as least-loaded spreads them; a rank with
more sequences than the mean by BALANCE_ABS and BALANCE_REL of the mean is skipped, so a popular prefix does not
pile up on the rank that holds it), least-loaded (below: vLLM's rule) and round-robin (the next candidate with
room).

Least-loaded (vLLM's data-parallel load balancing, with its known fixes):

    cost(rank) = 4 * (waiting + reserved + sent) + running

`waiting` and `running` come from the latest `LoadSnapshot` the coordinator published; `reserved` (also from the
snapshot) is what every API server routed to the rank that its engine had not reported receiving yet
(coordinator reservations.py), so API servers routing a burst at once see each other's picks; `sent` counts the
requests this frontend routed to the rank since that snapshot, so a burst that arrives between two snapshots
(which come at most every 100 ms) is spread instead of all landing on the rank that looked idle. A request's
`sent` weight is its number of sequences (`n` children and every prompt of a batch go to one rank); a sequence
that ends before the next snapshot leaves it again (`Router.finished`). A new snapshot replaces the local counts.
The lowest cost wins; ties go to the first rank at or after a start index that rotates after every pick, so equal
ranks take turns instead of rank 0 taking every tie.

Only ranks the topology lists as READY are candidates. A rank can be pinned (HTTP header
`X-data-parallel-rank`); pinning a rank that is not serving is the caller's error.

Sessions (opt-in HTTP header `X-Session-Id`, any policy): a session's requests go to the rank its last request
went to while that rank serves, has room (admission control) and is not saturated: its queue (waiting + reserved
+ sent) at most SESSION_SLACK requests longer than the shortest candidate's, its KV use under
SESSION_MAX_KV_USE. Otherwise the policy picks and the session follows. This API server remembers the newest
MAX_SESSIONS sessions (the cache-aware policy finds a conversation's prefix without it, in every API server).

Admission control (`AdmissionLimits`: --max-num-queued-requests, vLLM's --max-num-queued-reqs, and
--max-num-queued-tokens, per rank): a new request may only go to a rank whose queue, as this frontend sees it
(waiting and reserved requests and their prompt tokens from the snapshot, plus what this frontend sent since),
has room for it; the lowest cost among those wins. When no candidate has room (a pinned request: its rank),
`pick` raises `QueuesFull` and nothing is sent. A rank with an empty queue always takes the request, so one
larger than a cap is not refused forever. Another API server's sends since the last snapshot are not seen, so
with several the caps are approximate (less so than vLLM's: the reservations close the gap within a snapshot). Re-sends of
requests already accepted (their rank died) are never refused.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Iterable

from dpserve_shared.schema import EngineLoad

from dpserve_frontend.routing_cost import PromptMatch, RankState, estimated_ttft_s

WAITING_WEIGHT = 4
SESSION_SLACK = 8
SESSION_MAX_KV_USE = 0.95
MAX_SESSIONS = 65536
TIE_TOLERANCE_S = 0.005  # cache-aware: estimates within this (or TIE_TOLERANCE_FRACTION of the best) are a tie
TIE_TOLERANCE_FRACTION = 0.05
BALANCE_ABS = 2  # cache-aware: a rank with more than mean + max(BALANCE_ABS, BALANCE_REL * mean) sequences
BALANCE_REL = 0.25  # (running, waiting and picked but not yet reported: _RankLoad.num_sequences) is skipped


class RoutingPolicy(str, enum.Enum):
    LEAST_LOADED = "least-loaded"
    CACHE_AWARE = "cache-aware"
    ROUND_ROBIN = "round-robin"


class NoEngineAvailable(Exception):
    """No rank is serving."""


class QueuesFull(Exception):
    """No candidate rank has room in its queue for the request (admission control)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # "queued_requests" or "queued_tokens": the cap that refused it


@dataclasses.dataclass(frozen=True)
class AdmissionLimits:
    """Per-rank caps on what may wait in an engine's queue; None = no cap."""

    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None

    @property
    def is_enabled(self) -> bool:
        return self.max_num_queued_requests is not None or self.max_num_queued_tokens is not None

    def refusal(self, load: _RankLoad, num_seqs: int, num_tokens: int) -> str | None:
        """Why a rank with `load` cannot take `num_seqs` sequences of `num_tokens` prompt tokens, or None."""
        queued, queued_tokens = load.num_queued, load.num_queued_tokens
        if queued == 0:
            return None  # an empty queue takes anything
        if self.max_num_queued_requests is not None and queued + num_seqs > self.max_num_queued_requests:
            return "queued_requests"
        if self.max_num_queued_tokens is not None and queued_tokens + num_tokens > self.max_num_queued_tokens:
            return "queued_tokens"
        return None

    def describe(self, reason: str) -> str:
        if reason == "queued_requests":
            return f"--max-num-queued-requests {self.max_num_queued_requests}"
        return f"--max-num-queued-tokens {self.max_num_queued_tokens}"


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
    num_waiting_tokens: int = 0  # prompt tokens still to prefill of the waiting ones (snapshot)
    num_sent_tokens: int = 0  # prompt tokens of this frontend's sends since the snapshot
    num_reserved: int = 0  # every API server's picks its engine had not reported (snapshot)
    num_reserved_tokens: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefill_tokens_per_s: float = 0.0  # the rank's measured rates (0: none yet)
    decode_tokens_per_s: float = 0.0
    max_num_seqs: int = 0  # its batch's capacity (0: unknown)

    @property
    def num_queued(self) -> int:
        return self.num_waiting + self.num_reserved + self.num_sent

    @property
    def num_sequences(self) -> int:
        """Its sequences: running and waiting as its engine last reported them, and the picks it has not reported
        yet (every API server's reserved ones, this one's sends since the snapshot that are still open: `finished`
        takes back one that ended before the next snapshot). Without the picks, a burst that came between two
        snapshots went whole to the rank the last snapshot showed the lighter: with 32 closed-loop clients on 2
        ranks, rank 1 reported 8 sequences and rank 0 none, the guard skipped rank 1 for all 31 picks until the
        next snapshot, and since the 32 then finished together the next burst went whole to rank 1: one rank idle
        while the other ran 32 (99 output tok/s against least-loaded's 169; docs/benchmarks.md, session 14)."""
        return self.num_running + self.num_queued

    @property
    def num_queued_tokens(self) -> int:
        return self.num_waiting_tokens + self.num_reserved_tokens + self.num_sent_tokens

    def cost(self) -> int:
        return WAITING_WEIGHT * self.num_queued + self.num_running

    def state(self, fleet_rates: tuple[float, float] = (0.0, 0.0)) -> RankState:
        """`fleet_rates`: the (prefill, decode) rates to price it at (Router._fleet_rates)."""
        return RankState(self.num_queued_tokens, self.num_running, self.num_queued, self.max_num_seqs,
                         self.kv_blocks_used, self.kv_blocks_total, fleet_rates[0] or self.prefill_tokens_per_s,
                         fleet_rates[1] or self.decode_tokens_per_s)  # fmt: skip


class Router:
    def __init__(self, policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED) -> None:
        self.policy = policy
        self._loads: dict[int, _RankLoad] = {}
        self._serving: list[int] = []  # sorted
        self._next_start = 0
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()  # session id -> rank, LRU
        # Every rank is priced at the mean (prefill, decode) rates of the ranks that measured theirs: the ranks of
        # a deployment run one model on like hardware, and a rank priced at its own rates would starve after one
        # slow sample (taken while the machine was busy, say): no request, so no new sample, ever. A rank that
        # has measured nothing yet (new, or only prefix hits so far) is priced like the others too.
        self._fleet_rates = (0.0, 0.0)
        self.epoch = 0  # snapshots taken: a send made in this epoch is in `num_sent`, not yet in the snapshot's counts

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

    # Why the last `pick` chose its rank (the routing metrics): pinned (X-data-parallel-rank), session
    # (X-Session-Id), prefix (cache-aware: the rank holds part of the prompt), load (the lowest cost otherwise).
    last_reason = "load"

    def update_snapshot(self, loads: Iterable[EngineLoad]) -> None:
        """A new coordinator snapshot: replaces waiting/running and forgets the local sends."""
        for load in loads:
            entry = self._loads.get(load.rank)
            if entry is not None:
                entry.num_waiting = load.num_waiting
                entry.num_running = load.num_running
                entry.num_waiting_tokens = load.num_waiting_tokens
                entry.num_reserved = load.num_reserved
                entry.num_reserved_tokens = load.num_reserved_tokens
                entry.kv_blocks_used = load.kv_blocks_used
                entry.kv_blocks_total = load.kv_blocks_total
                entry.prefill_tokens_per_s = load.prefill_tokens_per_s
                entry.decode_tokens_per_s = load.decode_tokens_per_s
                entry.max_num_seqs = load.max_num_seqs
        for entry in self._loads.values():
            entry.num_sent = 0
            entry.num_sent_tokens = 0
        self.epoch += 1
        self._fleet_rates = (_mean(e.prefill_tokens_per_s for e in self._loads.values()),
                             _mean(e.decode_tokens_per_s for e in self._loads.values()))  # fmt: skip

    def pick(
        self,
        pinned_rank: int | None = None,
        num_seqs: int = 1,
        exclude: int | None = None,
        num_tokens: int = 0,
        limits: AdmissionLimits | None = None,
        prompt: PromptMatch | None = None,
        session_id: str | None = None,
    ) -> int:
        """Choose a rank (other than `exclude`: one that just gave a request back) whose queue has room under
        `limits` (None: no admission control), and count `num_seqs` sends of `num_tokens` prompt tokens to it.
        `prompt`: the request's prompt matched against every rank's prefix cache (cache-aware routing);
        `session_id`: its conversation (X-Session-Id), kept on its rank until that saturates.
        Raises `QueuesFull` when no candidate has room."""
        if limits is not None and not limits.is_enabled:
            limits = None
        self.last_reason = "load"
        if pinned_rank is not None:
            self.last_reason = "pinned"
            if pinned_rank not in self._loads:
                raise RankNotServing(pinned_rank, self.serving_ranks)
            rank = pinned_rank
            reason = limits.refusal(self._loads[rank], num_seqs, num_tokens) if limits is not None else None
            if reason is not None:
                raise QueuesFull(reason, f"data-parallel rank {rank}'s queue is full ({limits.describe(reason)}); retry later")
        else:
            rank = self._session_rank(session_id, exclude, limits, num_seqs, num_tokens)
            if rank is not None:
                self.last_reason = "session"
            else:
                rank = self._lowest_cost(exclude, limits, num_seqs, num_tokens, prompt)
                if self.policy is RoutingPolicy.CACHE_AWARE and prompt is not None and prompt.num_cached_tokens(rank):
                    self.last_reason = "prefix"  # the chosen rank holds part of the prompt
            if session_id is not None:
                self._remember(session_id, rank)
        load = self._loads[rank]
        load.num_sent += num_seqs
        # the prefill it queues: with a prompt match (cache-aware), what the rank's cache does not hold
        load.num_sent_tokens += num_tokens - (prompt.num_cached_tokens(rank) if prompt is not None else 0)
        return rank

    def finished(self, rank: int, epoch: int, num_tokens: int = 0) -> None:
        """A sequence sent to `rank` in snapshot epoch `epoch` (with `num_tokens` prompt tokens counted to it)
        ended here. One sent since the current snapshot leaves this API server's sent counts, so a quick
        succession of short requests does not pile up there until the next snapshot; an older one is the
        snapshot's (or the next one's) business."""
        load = self._loads.get(rank)
        if load is None or epoch != self.epoch:
            return
        load.num_sent = max(0, load.num_sent - 1)
        load.num_sent_tokens = max(0, load.num_sent_tokens - max(0, num_tokens))

    def _lowest_cost(
        self, exclude: int | None = None, limits: AdmissionLimits | None = None, num_seqs: int = 1,
        num_tokens: int = 0, prompt: PromptMatch | None = None,
    ) -> int:  # fmt: skip
        ranks = self._serving if exclude is None else [r for r in self._serving if r != exclude]
        if not ranks:
            raise NoEngineAvailable("no engine rank is serving")
        is_keyed = self.policy is RoutingPolicy.CACHE_AWARE and prompt is not None
        start = (prompt.tie_key if is_keyed else self._next_start) % len(ranks)
        candidates: list[tuple[int, float]] = []  # (rank, cost) in rotation order
        refusals = set()
        for i in range(len(ranks)):
            rank = ranks[(start + i) % len(ranks)]
            load = self._loads[rank]
            if limits is not None:
                reason = limits.refusal(load, num_seqs, num_tokens)
                if reason is not None:
                    refusals.add(reason)
                    continue
            candidates.append((rank, self._cost(rank, load, num_tokens, prompt)))
        if not candidates:
            # every candidate refused: name the request cap if any rank was past it, else the token cap
            reason = "queued_requests" if "queued_requests" in refusals else "queued_tokens"
            raise QueuesFull(reason, f"every serving rank's queue is full ({limits.describe(reason)}); retry later")
        self._next_start = start + 1
        if self.policy is not RoutingPolicy.CACHE_AWARE:
            best_cost = min(cost for _, cost in candidates)
            return next(rank for rank, cost in candidates if cost == best_cost)
        # Load guard: a rank with more sequences than the mean by BALANCE_ABS and BALANCE_REL of it takes none
        # (its prefix gets computed on another rank, which then holds it too), so a popular prefix cannot pile its
        # traffic on one rank where a batch's time hardly grows with its size (small batches, the null engine).
        sizes = {rank: self._loads[rank].num_sequences for rank, _ in candidates}
        mean = sum(sizes.values()) / len(sizes)
        limit = mean + max(BALANCE_ABS, BALANCE_REL * mean)
        candidates = [(rank, cost) for rank, cost in candidates if sizes[rank] <= limit]
        best_cost = min(cost for _, cost in candidates)
        # Estimates this close are a tie: the rank with the fewest sequences (the least-loaded cost) takes it, so
        # requests the cache does not care about spread like least-loaded ones.
        close = best_cost + max(TIE_TOLERANCE_S, TIE_TOLERANCE_FRACTION * best_cost)
        tied = [rank for rank, cost in candidates if cost <= close]
        return min(tied, key=lambda rank: self._loads[rank].cost())  # the first in rotation order among equals

    def _session_rank(self, session_id: str | None, exclude: int | None, limits: AdmissionLimits | None,
                      num_seqs: int, num_tokens: int) -> int | None:  # fmt: skip
        """The session's rank if it may take this request (see the module docstring), else None."""
        rank = self._sessions.get(session_id) if session_id is not None else None
        load = self._loads.get(rank) if rank is not None else None
        if load is None or rank == exclude:
            return None
        if limits is not None and limits.refusal(load, num_seqs, num_tokens) is not None:
            return None
        shortest = min(self._loads[r].num_queued for r in self._serving)
        is_kv_full = load.kv_blocks_total > 0 and load.kv_blocks_used >= SESSION_MAX_KV_USE * load.kv_blocks_total
        if load.num_queued > shortest + SESSION_SLACK or is_kv_full:
            return None
        return rank

    def _remember(self, session_id: str, rank: int) -> None:
        self._sessions[session_id] = rank
        self._sessions.move_to_end(session_id)
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def _cost(self, rank: int, load: _RankLoad, num_tokens: int, prompt: PromptMatch | None) -> float:
        if self.policy is RoutingPolicy.LEAST_LOADED:
            return load.cost()
        if self.policy is RoutingPolicy.ROUND_ROBIN:
            return 0  # every candidate ties: the rotation picks
        if prompt is None:
            return estimated_ttft_s(load.state(self._fleet_rates), num_tokens)
        return estimated_ttft_s(load.state(self._fleet_rates), prompt.num_tokens, prompt.num_cached_tokens(rank), prompt.block_size,
                                prompt.num_output_tokens)  # fmt: skip

    def cost(self, rank: int) -> int:
        """The least-loaded cost (for inspection)."""
        return self._loads[rank].cost()


def _mean(rates: Iterable[float]) -> float:
    """The mean of the measured (non-zero) rates; 0 when none is."""
    measured = [rate for rate in rates if rate > 0]
    return sum(measured) / len(measured) if measured else 0.0
