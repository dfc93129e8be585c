"""KV-cache blocks: allocation, reference counts and the prefix cache.

A block holds the K/V of `block_size` consecutive tokens of one or more sequences. A full block is named by a
chained hash (`dpserve_shared.block_hash`: the previous block's hash and its own token ids, the same value in
every process, which is what lets the frontends route by it), so two requests with the same prefix share the
same physical blocks. A freed block keeps its hash and waits in an LRU of cached blocks: a later request
with that prefix takes it back (a prefix hit); an allocation that finds no never-used block evicts the least
recently freed one.

KV events (`start_kv_events`, `take_kv_events`): the hashes that entered and left the cache since the last take,
net (a hash stored then evicted within one step is in neither list unless it was there before), for the
coordinator's index of every rank's cache (routing by prefix).
"""

from __future__ import annotations

import collections

from dpserve_shared.block_hash import block_hash

from dpserve_engine.kv_events import KvEventLog
from dpserve_engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_block_ids: collections.deque[int] = collections.deque(range(num_blocks))  # never used / no hash
        self.cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()  # ref 0, hash kept; LRU
        self.hash_to_block: dict[int, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up
        self.num_prefix_hits = 0  # of those, found
        self._kv_events = KvEventLog()

    # -- accounting ------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------------------------

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes over the full blocks among its first num_tokens tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks holding seq's leading full blocks, up to all of them. At least one token is always left to
        compute (its logits give the first output token): when every token is cached (a prompt that fills its
        last block, sent before), the last one is computed again as a decode row whose K/V is not written
        (`Sequence.num_reused_tokens`), not its whole block."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        self._update_hashes(seq, len(seq))
        hits = []
        for h in seq.block_hashes[: len(seq) // self.block_size]:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _computed(self, seq: Sequence, hits: list[int]) -> int:
        """Tokens a seq admitted with these hits starts with computed: all but the last one at most."""
        return min(len(hits) * self.block_size, len(seq) - 1)

    def num_cached_tokens(self, seq: Sequence) -> int:
        return self._computed(seq, self._prefix_hits(seq))

    def cache_blocks(self, seq: Sequence) -> None:
        """Name the blocks that became full with computed K/V so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        for i in range(seq.num_computed_tokens // self.block_size):
            block_id = seq.block_table[i]
            if self.block_hash[block_id] is None and seq.block_hashes[i] not in self.hash_to_block:
                self.block_hash[block_id] = seq.block_hashes[i]
                self.hash_to_block[seq.block_hashes[i]] = block_id
                self._kv_events.stored(seq.block_hashes[i])

    # -- KV events ------------------------------------------------------------------------------------------

    def start_kv_events(self) -> None:
        self._kv_events.start()

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        """(stored, removed) hashes since the last take."""
        return self._kv_events.take()

    def cached_hashes(self) -> list[int]:
        """Every hash the cache holds (a KV-events snapshot)."""
        return list(self.hash_to_block)

    # -- allocation ------------------------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.cached_free.popitem(last=False)  # evict the least recently freed cached block
            del self.hash_to_block[self.block_hash[block_id]]
            self._kv_events.removed(self.block_hash[block_id])
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Can a waiting seq be admitted with its first num_new_tokens uncached tokens?"""
        hits = self._prefix_hits(seq)
        num_needed = self.num_blocks_for(self._computed(seq, hits) + num_new_tokens) - len(hits)
        num_hits_in_lru = sum(1 for b in hits if b in self.cached_free)
        return num_needed <= self.num_free_blocks - num_hits_in_lru

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Admit seq: share its cached prefix blocks, then allocate blocks for num_new_tokens more tokens."""
        assert not seq.block_table
        hits = self._prefix_hits(seq)
        for block_id in hits:
            if self.ref_counts[block_id] == 0:
                del self.cached_free[block_id]
            self.ref_counts[block_id] += 1
        seq.block_table = list(hits)
        seq.num_computed_tokens = self._computed(seq, hits)
        seq.num_reused_tokens = len(hits) * self.block_size
        if not seq.was_admitted:  # a preempted seq coming back is not a new prefix query
            seq.was_admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens
            if self.enable_prefix_caching and not seq.wants_prompt_logprobs:
                self.num_prefix_queries += seq.num_prompt_tokens
                self.num_prefix_hits += seq.num_computed_tokens
        self.may_append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return num_needed <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold num_new_tokens more tokens."""
        num_needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(num_needed):
            seq.block_table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Last blocks go first, so the LRU evicts a prefix's tail before its head."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is not None:
                    self.cached_free[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_reused_tokens = 0
