"""The expert-parallel process group: the collectives that tie the data-parallel ranks of an MoE model together.

With `--enable-expert-parallel` each of the N ranks holds E/N experts; attention stays per rank. In every MoE
layer a rank's tokens must reach the experts on the other ranks and come back weighted and summed. The ranks form
one torch.distributed group (gloo on CPU, nccl on CUDA) whose address comes from the coordinator (`ExpertGroup`:
rank 0's node address and a port the coordinator picked, the world size, this rank); `ExpertGroup.join` fails
with `ExpertGroupJoinFailed` naming that address, the port and the timeout when the group does not form.

`ExpertComm` (the protocol the MoE layer calls, defined by moe.py) is implemented by `ExpertParallelComm` as
all-gather + reduce-scatter rather than all-to-all:

- `gather(x)`: each rank's rows `x` [T_r, dim] to every rank, in rank order: [sum T_r, dim] plus the counts T_r.
  One all-gather of the counts (N int64; once per forward: `begin_forward` says how many layers share
  them), then one all-gather of the rows padded to max T_r.
- `scatter_sum(y, counts)`: every rank computed its experts' share `y` [sum T_r, dim] for all rows (zero where a
  row chose none of its experts); the elementwise sum over ranks is taken and each rank keeps its own rows. One
  reduce-scatter of the padded [N * max T_r, dim] tensor where the backend has it (nccl), else (gloo) an
  all-reduce of it and a slice.

Message sizes per MoE layer, with T = max T_r, d = hidden size, b = bytes per element: the counts (8 N bytes,
first layer only), then N * T * d * b bytes received by each rank for the gather, and N * T * d * b for the
reduction (gloo's ring all-reduce moves about twice that over the wire; a reduce-scatter moves (N - 1) * T * d *
b). When every rank has 0 rows (all of them are running dummy steps) only the counts travel. Why not all-to-all:
with top-k routing over E experts on N ranks a token usually needs several ranks, the gather needs no routing metadata
exchanged first (the router runs on every rank over the gathered rows, so its choice needs no message), and the
two collectives have fixed shapes per step, which is what a compiled or graph-captured step wants. All-to-all
would send each row only to the ranks holding its chosen experts: less traffic for large N and small k, at the
cost of a counts exchange per destination and variable shapes. At DP=2..8 on one node the difference is small.

Measured (DP=2, gloo, 2 local processes, a 2-core machine under load 10, so upper bounds): a layer with 0 rows on
every rank (the counts only) 0.77 ms; 32 rows of 576 fp32 per rank (SmolLM2's hidden size; 74 KB gathered,
147 KB reduced) 14 ms.

`all_reduce_has_unfinished(flag)`: the lock-step protocol's "does any rank still have requests" (a MAX
all-reduce of one int, on a CPU gloo group even when the experts' group is nccl, so it never waits on the GPU).

Every collective is timed: `collective_time_s` (cumulative, waiting for the other ranks included) feeds the rank's
/metrics. On CUDA that is the host's time: an nccl call returns once queued, and its wait shows in the next sync
(the counts' `.tolist()`, in the first MoE layer of each forward). Untested on CUDA so far: no multi-GPU machine
was at hand.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time

import torch
import torch.distributed as dist

log = logging.getLogger("dpserve.engine")

# torch 2.13 renamed the fixed-shape collectives (the old names warn); older torch has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ExpertGroupJoinFailed(RuntimeError):
    """A rank could not join the expert-parallel group (a peer missing, the port taken, a timeout)."""


@dataclasses.dataclass(frozen=True)
class GroupAddress:
    """Where the group forms: rank 0's node and a port the coordinator picked."""

    host: str
    port: int
    world_size: int
    rank: int
    timeout_s: float

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class ExpertGroup:
    """This process's membership in the expert-parallel group (torch.distributed's default group)."""

    def __init__(self, address: GroupAddress, backend: str):
        self.address = address
        self.backend = backend
        self.rank = address.rank
        self.world_size = address.world_size
        self.collective_time_s = 0.0
        self.num_collectives = 0
        self._cpu_group = None  # gloo, for the has-unfinished flag when `backend` is nccl

    @classmethod
    def join(cls, address: GroupAddress, device: torch.device | str = "cpu") -> ExpertGroup:
        """Form the group (blocks until every rank joined). Raises ExpertGroupJoinFailed after the timeout."""
        group = cls(address, backend_for(device))
        started = time.monotonic()
        try:
            dist.init_process_group(
                group.backend, init_method=address.init_method, rank=address.rank,
                world_size=address.world_size, timeout=datetime.timedelta(seconds=address.timeout_s),
            )  # fmt: skip
            if group.backend != "gloo":
                group._cpu_group = dist.new_group(backend="gloo")
            dist.barrier(group=group._cpu_group)  # every rank is in, not only the store's
        except Exception as e:  # noqa: BLE001 - torch raises several kinds; the user needs the address
            if dist.is_initialized():
                dist.destroy_process_group()
            raise ExpertGroupJoinFailed(
                f"rank {address.rank} could not join the expert-parallel group at {address.init_method} "
                f"(rank 0's node and the port the coordinator picked; world size {address.world_size}) within "
                f"{address.timeout_s:g} s: {type(e).__name__}: {e}"
            ) from None
        log.info("joined the expert-parallel group at %s as rank %d of %d (%s) in %.1f s", address.init_method,
                 address.rank, address.world_size, group.backend, time.monotonic() - started)  # fmt: skip
        return group

    def timed(self, work):
        """Run one collective (a callable), adding its time to collective_time_s."""
        started = time.perf_counter()
        try:
            return work()
        finally:
            self.collective_time_s += time.perf_counter() - started
            self.num_collectives += 1

    def all_reduce_has_unfinished(self, has_unfinished: bool) -> bool:
        """True when any rank has unfinished requests (MAX all-reduce of one int on the CPU group)."""
        flag = torch.tensor([1 if has_unfinished else 0], dtype=torch.int32)
        self.timed(lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group))
        return bool(flag.item())

    def all_reduce_sync(self, has_unfinished: bool, generation: int) -> tuple[bool, int]:
        """The lock-step sync: (does any rank have unfinished requests, the newest group generation any rank was
        sent) in one MAX all-reduce of two ints (group_membership.py: leaving for a re-formed group)."""
        values = torch.tensor([1 if has_unfinished else 0, generation], dtype=torch.int64)
        self.timed(lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._cpu_group))
        return bool(values[0].item()), int(values[1].item())

    def close(self) -> None:
        """Leave the group (torch.distributed's default group is free for the next one). After a peer died the
        pending collectives have failed already (its sockets closed), so this does not wait."""
        if dist.is_initialized():
            dist.destroy_process_group()


class ExpertParallelComm:
    """ExpertComm over an ExpertGroup: all-gather of variable row counts, then reduce-scatter (see the module
    docstring for the choice and the message sizes)."""

    def __init__(self, group: ExpertGroup):
        self.group = group
        self.rank = group.rank
        self.world_size = group.world_size
        # The row counts of the current forward (begin_forward): exchanged in its first layer's gather, reused by
        # the rest, which have the same rows on every rank. Without begin_forward each gather exchanges them.
        self._forward_counts: list[int] | None = None
        self._layers_left = 0

    def begin_forward(self, num_layers: int) -> None:
        self._forward_counts = None
        self._layers_left = num_layers

    def all_reduce_has_unfinished(self, has_unfinished: bool) -> bool:
        return self.group.all_reduce_has_unfinished(has_unfinished)

    def _counts(self, num_rows: int, device: torch.device) -> list[int]:
        mine = torch.tensor([num_rows], dtype=torch.int64, device=device)
        counts = torch.zeros(self.world_size, dtype=torch.int64, device=device)
        self.group.timed(lambda: _all_gather(counts, mine))
        return counts.tolist()

    def gather(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """x [T_r, dim] -> (every rank's rows [sum T_r, dim] in rank order, [T_0, ..., T_{N-1}])."""
        if self._layers_left > 0:
            self._layers_left -= 1
            if self._forward_counts is None:
                self._forward_counts = self._counts(x.shape[0], x.device)
            counts = self._forward_counts
            if counts[self.rank] != x.shape[0]:
                raise RuntimeError(f"a layer of this forward has {x.shape[0]} rows, its first had {counts[self.rank]}")
        else:
            counts = self._counts(x.shape[0], x.device)
        max_rows = max(counts)
        if max_rows == 0:  # every rank is idle: nothing but the counts travels
            return x.new_zeros((0, *x.shape[1:])), counts
        padded = x.new_zeros((max_rows, *x.shape[1:]))
        padded[: x.shape[0]] = x
        gathered = x.new_empty((self.world_size * max_rows, *x.shape[1:]))
        self.group.timed(lambda: _all_gather(gathered, padded))
        gathered = gathered.view(self.world_size, max_rows, *x.shape[1:])
        return torch.cat([gathered[r, :n] for r, n in enumerate(counts)]), counts

    def scatter_sum(self, y: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """y [sum T_r, dim] on every rank -> this rank's rows of the sum over ranks [T_rank, dim]."""
        max_rows = max(counts)
        if max_rows == 0:
            return y.new_zeros((0, *y.shape[1:]))
        padded = y.new_zeros((self.world_size, max_rows, *y.shape[1:]))
        for r, (start, n) in enumerate(zip(_offsets(counts), counts)):
            padded[r, :n] = y[start : start + n]
        if self.group.backend == "nccl":
            mine = y.new_empty((max_rows, *y.shape[1:]))
            self.group.timed(lambda: _reduce_scatter(mine, padded.view(-1, *y.shape[1:])))
        else:  # gloo has no reduce-scatter
            self.group.timed(lambda: dist.all_reduce(padded))
            mine = padded[self.rank]
        return mine[: counts[self.rank]].contiguous()


def _offsets(counts: list[int]) -> list[int]:
    offsets, total = [], 0
    for n in counts:
        offsets.append(total)
        total += n
    return offsets
