"""The prefix cache's changes since the coordinator last heard them (KV events, docs/architecture.md: "How a
request is routed"): the block hashes stored and evicted, netted per hash, off until the engine starts reporting.
Used by the block manager and by the null engine's prefix cache alike."""

from __future__ import annotations


class KvEventLog:
    def __init__(self) -> None:
        self._changes: dict[int, bool] | None = None  # hash -> held, since the last take (None: not tracked)

    def start(self) -> None:
        if self._changes is None:
            self._changes = {}

    def stored(self, block_hash: int) -> None:
        if self._changes is not None:
            self._changes[block_hash] = True

    def removed(self, block_hash: int) -> None:
        if self._changes is not None:
            self._changes[block_hash] = False

    def take(self) -> tuple[list[int], list[int]]:
        """(stored, removed) hashes since the last take; a hash stored then evicted in between counts as removed."""
        changes = self._changes
        if not changes:
            return [], []
        self._changes = {}
        return [h for h, held in changes.items() if held], [h for h, held in changes.items() if not held]
