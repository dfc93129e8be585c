"""The null engine's prefix cache: which block hashes it would hold, with no K/V behind them.

An LRU of `num_blocks` block hashes (`dpserve_shared.block_hash`, the real engine's names for its blocks). A
request's prompt, when admitted, hits its leading blocks that are cached, then all its full blocks become the
most recently used (evicting the least recently used past capacity). It reports KV events like the real block
manager, so the coordinator's index, the frontends' cache-aware routing and their hit rates can be measured with
no model.
"""

from __future__ import annotations

import collections

from dpserve_shared.block_hash import block_hashes

from dpserve_engine.kv_events import KvEventLog


class NullPrefixCache:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._kv_events = KvEventLog()
        self.num_queries = 0  # prompt tokens looked up
        self.num_hits = 0  # of those, found

    def admit(self, prompt: list[int]) -> int:
        """Look the prompt up and cache its full blocks; returns its cached tokens (at most all but the last)."""
        hashes = block_hashes(prompt, self.block_size)
        num_hit = 0
        for h in hashes:
            if h not in self._lru:
                break
            num_hit += 1
        num_cached = min(num_hit * self.block_size, len(prompt) - 1)
        self.num_queries += len(prompt)
        self.num_hits += num_cached
        for h in hashes:
            self._touch(h)
        return num_cached

    def _touch(self, block_hash: int) -> None:
        lru = self._lru
        if block_hash in lru:
            lru.move_to_end(block_hash)
            return
        lru[block_hash] = None
        self._kv_events.stored(block_hash)
        while len(lru) > self.num_blocks:
            evicted, _ = lru.popitem(last=False)
            self._kv_events.removed(evicted)

    # -- KV events (as BlockManager's) -------------------------------------------------------------------------

    def start_kv_events(self) -> None:
        self._kv_events.start()

    def take_kv_events(self) -> tuple[list[int], list[int]]:
        return self._kv_events.take()

    def cached_hashes(self) -> list[int]:
        return list(self._lru)
