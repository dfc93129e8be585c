"""Which rank's prefix cache holds which block: the structure under the coordinator's index (kv_index.py) and
each frontend's mirror of it (prefix_index.py). Pure.

Each block hash maps to a bitmask of the ranks that hold it, and each rank to its set of hashes, so that
- a change costs O(changed blocks): `store`/`remove` touch one entry per hash;
- a rank that restarts is emptied in O(its blocks);
- `match(prompt's hashes)` walks the prompt's blocks once for every rank together (a running AND of bitmasks),
  O(matched blocks), however many ranks there are.
"""

from __future__ import annotations

from collections.abc import Iterable

from dpserve_shared.schema import RankBlocks


def _ranks_of(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class BlockIndex:
    def __init__(self) -> None:
        self._owners: dict[int, int] = {}  # block hash -> bitmask of the ranks holding it
        self._by_rank: dict[int, set[int]] = {}  # rank -> its block hashes

    def store(self, rank: int, hashes: Iterable[int]) -> None:
        mine = self._by_rank.setdefault(rank, set())
        bit = 1 << rank
        owners = self._owners
        for h in hashes:
            if h not in mine:
                mine.add(h)
                owners[h] = owners.get(h, 0) | bit

    def remove(self, rank: int, hashes: Iterable[int]) -> None:
        mine = self._by_rank.get(rank)
        if not mine:
            return
        bit = 1 << rank
        owners = self._owners
        for h in hashes:
            if h in mine:
                mine.discard(h)
                mask = owners[h] & ~bit
                if mask:
                    owners[h] = mask
                else:
                    del owners[h]

    def clear_rank(self, rank: int) -> None:
        """Forget every block of `rank` (it restarted, died or left)."""
        mine = self._by_rank.pop(rank, None)
        if not mine:
            return
        keep = ~(1 << rank)
        owners = self._owners
        for h in mine:
            mask = owners[h] & keep
            if mask:
                owners[h] = mask
            else:
                del owners[h]

    def apply(self, change: RankBlocks) -> None:
        """A KvDelta's change for one rank (reset first, then removed, then stored)."""
        if change.reset:
            self.clear_rank(change.rank)
        if change.removed:
            self.remove(change.rank, change.removed)
        if change.stored:
            self.store(change.rank, change.stored)

    def clear(self) -> None:
        self._owners.clear()
        self._by_rank.clear()

    def ranks(self) -> list[int]:
        return sorted(r for r, blocks in self._by_rank.items() if blocks)

    def blocks_of(self, rank: int) -> list[int]:
        return list(self._by_rank.get(rank, ()))

    def num_blocks(self, rank: int) -> int:
        return len(self._by_rank.get(rank, ()))

    def holds(self, rank: int, block_hash: int) -> bool:
        return block_hash in self._by_rank.get(rank, ())

    def match(self, hashes: list[int]) -> dict[int, int]:
        """For each rank holding the prompt's first block: how many of its leading blocks (`hashes`, in order) it
        holds. Ranks holding none are absent."""
        owners = self._owners
        matched: dict[int, int] = {}
        alive = owners.get(hashes[0], 0) if hashes else 0
        depth = 0
        while alive and depth < len(hashes):
            mask = owners.get(hashes[depth], 0)
            dropped = alive & ~mask
            for rank in _ranks_of(dropped):
                matched[rank] = depth
            alive &= mask
            depth += 1
        for rank in _ranks_of(alive):
            matched[rank] = depth
        return matched
