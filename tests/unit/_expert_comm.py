"""In-process fakes of `moe.ExpertComm` (the peer's side of the expert-parallel protocol; the engine implements
it over torch.distributed), and helpers to run a model's shards as simulated ranks.

- `RecordingComm`: rank r of a group whose every rank's input is known beforehand; runs one MoE layer per rank in
  sequence, keeping each rank's partial output for the test to sum.
- `ThreadGroup` / `ThreadComm`: N threads as N ranks, meeting at a barrier in every collective, as N processes
  would; `run_ranks(N, work)` runs work(rank) on them (a hang fails by the barrier's timeout).
- `prefill(model, tokens)`: one prompt through a model over a fresh KV cache -> its final hidden states.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from dpserve_engine.model import AttentionMetadata, PrefillChunk


class RecordingComm:
    """Rank `rank` of a group whose every rank's input is known beforehand (`inputs`): gather returns them all;
    scatter_sum keeps this rank's partial output and returns it whole, for the test to sum over the ranks."""

    def __init__(self, rank: int, inputs: list[torch.Tensor]):
        self.rank, self.world_size, self.inputs = rank, len(inputs), inputs
        self.partial: torch.Tensor | None = None

    def gather(self, x):
        assert torch.equal(x, self.inputs[self.rank])
        return torch.cat(self.inputs), [t.shape[0] for t in self.inputs]

    def scatter_sum(self, y, counts):
        self.partial = y
        return y


class ThreadGroup:
    """N threads as N ranks: every collective is a barrier where each rank leaves its tensor and reads all."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=20)
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.num_collectives = [0] * world_size

    def exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.num_collectives[rank] += 1
        self.slots[rank] = t
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return everyone


@dataclasses.dataclass
class ThreadComm:
    group: ThreadGroup
    rank: int

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def gather(self, x):
        xs = self.group.exchange(self.rank, x)
        return torch.cat(xs), [t.shape[0] for t in xs]

    def scatter_sum(self, y, counts):
        total = functools.reduce(torch.add, self.group.exchange(self.rank, y))
        start = sum(counts[: self.rank])
        return total[start : start + counts[self.rank]]


def prefill(model, tokens: list[int]) -> torch.Tensor:
    """One sequence's prompt through the model over a fresh KV cache -> final hidden states [n, dim]."""
    n, args = len(tokens), model.args
    positions = torch.arange(n)
    mask = positions.unsqueeze(0) <= positions.unsqueeze(1)
    meta = AttentionMetadata(positions, 0, 16, None, None, [PrefillChunk(0, n, positions, mask)])
    kv = [(torch.zeros(args.n_kv_heads, 64, args.head_dim), torch.zeros(args.n_kv_heads, 64, args.head_dim))
          for _ in range(args.n_layers)]  # fmt: skip
    with torch.inference_mode():
        return model(torch.tensor(tokens), positions, meta, kv)


def run_ranks(world_size: int, work) -> list:
    """work(rank) on `world_size` threads -> their results; a rank's exception is raised here."""
    results, errors = [None] * world_size, []

    def target(rank):
        try:
            results[rank] = work(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,), name=f"rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    if errors:
        raise errors[0]
    return results
