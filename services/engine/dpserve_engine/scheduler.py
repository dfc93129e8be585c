"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Algorithm. Every step has a budget of `max_num_batched_tokens` tokens. Running sequences go first, decodes (one
token each) before unfinished chunked prefills, in arrival order; each takes min(its uncomputed tokens, budget
left). A running sequence whose new tokens need a KV block when none is free preempts the most recently arrived
running sequence (its blocks are freed and it goes back to the front of the waiting queue to be recomputed later,
prompt plus generated tokens); if it is itself the most recent one, it preempts itself. Then, if nothing was
preempted, waiting sequences are admitted in arrival order while budget, `max_num_seqs` and free blocks allow:
each shares its cached prefix blocks and takes a prefill chunk of the rest. Admission stops at the first
sequence that does not fit (FIFO, no overtaking), and at the first whose next prompt block a running sequence
is computing right now: it joins a step later with that block from the prefix cache (32 identical prompts cost
one prefill, not 32). Since add_request refuses a request whose prompt + max_tokens
needs more blocks than exist, the oldest running sequence can always make progress: no deadlock, no loss.
With --max-queue-time-s, `take_expired` removes (before a step is scheduled) the waiting sequences that arrived
longer ago than that and were never scheduled; a preempted one (scheduled before) and a moved request's
continuation are not removed.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from dpserve_engine.block_manager import BlockManager
from dpserve_engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledBatch:
    """Decodes first (one token each), then prefill chunks. num_tokens[i] tokens of seqs[i] run this step."""

    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # arrival order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        has_preempted = False
        for seq in sorted(self.running, key=lambda s: s.is_prefilling):  # stable: decodes first, arrival order
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted for an earlier sequence in this loop
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_append(seq, num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                has_preempted = True
                budget += scheduled.pop(victim, 0)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.may_append(seq, num_tokens)
                scheduled[seq] = num_tokens
                budget -= num_tokens
        if not has_preempted:
            scheduled.update(self._admit(budget))
        # One-token chunks (decodes) first: the model runs them as one batched paged-attention call.
        order = sorted(scheduled.items(), key=lambda item: item[1] > 1)
        num_decodes = sum(1 for _, n in order if n == 1)
        return ScheduledBatch([s for s, _ in order], [n for _, n in order], num_decodes)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _in_flight_blocks(self) -> set[int]:
        """Hashes of the full prompt blocks that running sequences have still to compute (not cached yet)."""
        if not self.block_manager.enable_prefix_caching:
            return set()
        bs = self.block_manager.block_size
        pending: set[int] = set()
        for seq in self.running:
            if seq.is_prefilling:
                pending.update(seq.block_hashes[seq.num_computed_tokens // bs :])
        return pending

    def _waits_for_prefix(self, seq: Sequence, num_cached: int, pending: set[int]) -> bool:
        """The next block of seq's prompt is being computed by a running sequence: seq is admitted once it is in
        the prefix cache (a step or a chunk later) instead of computing the same tokens beside it."""
        k = -(-num_cached // self.block_manager.block_size)  # a fully cached prompt's last block is a hit
        return not seq.wants_prompt_logprobs and k < len(seq.block_hashes) and seq.block_hashes[k] in pending

    def _admit(self, budget: int) -> list[tuple[Sequence, int]]:
        admitted = []
        if not self.waiting:
            return admitted  # most steps: nothing to admit, no need to look at what is in flight
        pending = self._in_flight_blocks()
        bs = self.block_manager.block_size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_cached = self.block_manager.num_cached_tokens(seq)
            if pending and self._waits_for_prefix(seq, num_cached, pending):
                break  # FIFO: the ones behind it wait too (one step; identical prompts would share anyway)
            num_tokens = min(len(seq) - num_cached, budget)
            if not self.block_manager.can_allocate(seq, num_tokens):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_tokens)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = time.monotonic()
            self.running.append(seq)
            admitted.append((seq, num_tokens))
            budget -= num_tokens
            if self.block_manager.enable_prefix_caching and seq.num_uncomputed_tokens > 1:
                pending.update(seq.block_hashes[seq.num_computed_tokens // bs :])
        return admitted

    def take_expired(self, arrived_before: float) -> list[Sequence]:
        """Remove and return the waiting sequences never scheduled that arrived (time.monotonic()) before
        `arrived_before`, except continuations; they hold no blocks. New sequences join the queue's end in arrival
        order, so the scan stops at the first one that arrived later."""
        expired = []
        for seq in self.waiting:
            if seq.first_scheduled_s is not None or seq.is_continuation or seq.arrival_s is None:
                continue
            if seq.arrival_s >= arrived_before:
                break
            expired.append(seq)
        for seq in expired:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
        return expired

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
