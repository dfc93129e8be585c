"""The cache-aware router's cost: a rank's estimated time to first token for one prompt. Pure.

    ttft(rank) = (prompt tokens not cached on the rank + prefill tokens already queued there) / its prefill rate
               + running sequences / its decode rate                       (one decode step of its batch)
               + KV_PRESSURE_S * how far its KV use would go past KV_SOFT_LIMIT (toward preemptions)
               + the wait for a batch slot, when its batch (--max-num-seqs) is full with what runs and is queued

- cached tokens: the leading blocks of the prompt the rank's prefix cache holds (the coordinator's index,
  prefix_index.py), at most all but the last prompt token (the engine always computes one);
- queued prefill tokens: its waiting requests' uncomputed tokens (the snapshot), plus the work reserved by
  every API server's picks the engine has not reported yet (the snapshot), plus this API server's own sends
  since the snapshot;
- the slot wait: a rank runs at most max_num_seqs sequences; the requests queued there beyond its free slots,
  and this one, wait for running ones to finish. One finishes every (decode step time of the batch it will run
  x output tokens left / batch size), with half of this request's max_tokens standing in for what the running
  ones have left, so requests sharing a prefix stay on the rank that holds it until its batch is full and its
  queue is long, then spill over (sticky until saturated);
- the rates are measured by the engines (EngineLoad.prefill_tokens_per_s / decode_tokens_per_s, tokens per
  second of step time), so the trade-off between a cache hit and a queue calibrates itself; the router prices
  every rank at the mean over the ranks that measured theirs (router.py says why); until one has, DEFAULT_*
  stand in. With one decode rate for all, a decode step's time grows with the rank's batch.
"""

from __future__ import annotations

import dataclasses

DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
DEFAULT_DECODE_TOKENS_PER_S = 200.0
KV_SOFT_LIMIT = 0.9  # KV use above this fraction starts to cost
KV_PRESSURE_S = 1.0  # the cost of a rank whose KV cache the request would fill


@dataclasses.dataclass(frozen=True)
class PromptMatch:
    """One request's prompt as the router sees it: hashed once, matched against every rank's cache once."""

    num_tokens: int  # prompt tokens of all its sequences
    cached_blocks: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> leading blocks it holds
    block_size: int = 0
    tie_key: int = 0  # where ties start (the first block's hash): the same in every API server
    num_output_tokens: int = 0  # its max_tokens (the slot wait's guess of how long a sequence runs)

    def num_cached_tokens(self, rank: int) -> int:
        blocks = self.cached_blocks.get(rank, 0)
        return min(blocks * self.block_size, max(0, self.num_tokens - 1))


@dataclasses.dataclass(frozen=True)
class RankState:
    """What the cost needs to know of one rank."""

    num_queued_tokens: int = 0  # waiting + reserved + sent, prefill tokens
    num_running: int = 0
    num_queued: int = 0  # waiting + reserved + sent, sequences
    max_num_seqs: int = 0  # the batch's capacity (0: unknown, no slot wait)
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


def estimated_ttft_s(rank_state: RankState, num_prompt_tokens: int, num_cached_tokens: int = 0,
                     block_size: int = 0, num_output_tokens: int = 0) -> float:  # fmt: skip
    uncached = max(0, num_prompt_tokens - num_cached_tokens)
    prefill_rate = rank_state.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
    prefill_s = (uncached + rank_state.num_queued_tokens) / prefill_rate
    return (prefill_s + decode_step_s(rank_state) + kv_pressure_s(rank_state, uncached, block_size)
            + slot_wait_s(rank_state, num_output_tokens))  # fmt: skip


def decode_step_s(rank_state: RankState) -> float:
    """One decode step of the rank's batch."""
    return rank_state.num_running / (rank_state.decode_tokens_per_s or DEFAULT_DECODE_TOKENS_PER_S)


def slot_wait_s(rank_state: RankState, num_output_tokens: int) -> float:
    capacity = rank_state.max_num_seqs
    if capacity <= 0:
        return 0.0
    short = rank_state.num_queued + 1 - max(0, capacity - rank_state.num_running)  # sequences without a slot
    if short <= 0:
        return 0.0
    rows = max(1, min(capacity, rank_state.num_running + rank_state.num_queued))  # the batch it will step
    step_s = rows / (rank_state.decode_tokens_per_s or DEFAULT_DECODE_TOKENS_PER_S)
    return short * step_s * max(1, num_output_tokens) / (2 * capacity)


def kv_pressure_s(rank_state: RankState, num_new_tokens: int, block_size: int) -> float:
    total = rank_state.kv_blocks_total
    if total <= 0:
        return 0.0
    new_blocks = -(-num_new_tokens // block_size) if block_size > 0 else 0
    use = (rank_state.kv_blocks_used + new_blocks) / total
    if use <= KV_SOFT_LIMIT:
        return 0.0
    return KV_PRESSURE_S * min(1.0, (use - KV_SOFT_LIMIT) / (1.0 - KV_SOFT_LIMIT))
