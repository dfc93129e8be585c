"""The mixture-of-experts feed-forward (Mixtral / Qwen-MoE style) and its hook for expert parallelism.

One MoE layer replaces a block's dense SwiGLU MLP. A router (a linear [E, dim], replicated on every rank) scores
each token; softmax over the E experts in fp32; the top-k experts are kept and their weights renormalized to sum
to 1; the token's output is the weighted sum of those experts' SwiGLU outputs (w1 = gate, w3 = up, w2 = down, as
Mixtral names them). Because the kept weights sum to 1, a model whose experts are all copies of one dense MLP
computes that MLP whatever the router picks (moe_weights.upcycle relies on it).

Batching: the (token, expert) pairs of a step are sorted by expert once (argsort, bincount); each expert then runs
one matmul pair on its tokens (index_select) and adds its weighted rows into the output (index_add_). The Python
loop is over the experts, never over tokens.

Expert parallelism: a layer holds a subset of the experts (`expert_ids`; `expert_range` gives rank r of N the
contiguous block [r*E/N, (r+1)*E/N)) and may be given an `ExpertComm` over the ranks. Then a forward gathers every
rank's tokens (attention stays per rank, so each rank brings its own rows), routes all of them (the router is
replicated, so every rank routes alike), applies only its local experts (a token none of whose top-k is local gets
zeros from this rank), and `scatter_sum` adds the ranks' partial outputs and hands each rank back its own rows.
Every rank must make the same collective calls: one gather and one scatter_sum per MoE layer per forward, so a
rank with no tokens runs `Transformer.dummy_forward()` (model.py): zero rows through every MoE layer.

The decode step of an MoE model runs eagerly (model_runner.py says so in one log line): the per-expert token
counts are data-dependent and the collectives are calls into the communicator, neither of which compiled.py's one
static graph covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@runtime_checkable
class ExpertComm(Protocol):
    """The collectives an expert-parallel MoE layer needs, over the `world_size` ranks of an expert group. Every
    rank calls each of them once per MoE layer per forward, in the same order (implemented over torch.distributed
    by the engine's process group; tests use in-process fakes)."""

    rank: int
    world_size: int

    def gather(self, x: Tensor) -> tuple[Tensor, list[int]]:
        """x: this rank's rows [T_r, dim] -> every rank's rows [sum T_r, dim] in rank order, and each rank's T_r."""
        ...

    def scatter_sum(self, y: Tensor, counts: list[int]) -> Tensor:
        """y: [sum T_r, dim] on every rank -> the elementwise sum of y over the ranks, this rank's rows only
        ([counts[rank], dim]: rows sum(counts[:rank]) onwards)."""
        ...

    # Optional: `begin_forward(num_layers)`, called by Transformer before a forward of `num_layers` MoE layers.
    # Every layer of one forward has the same rows on every rank, so a comm may exchange the row counts once, in
    # the first layer's gather, instead of in each (ExpertParallelComm does).


def expert_range(num_experts: int, rank: int, world_size: int) -> range:
    """The experts rank `rank` of `world_size` holds: the contiguous block [r*E/N, (r+1)*E/N)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of {world_size}")
    if num_experts % world_size:
        raise ValueError(
            f"{num_experts} experts cannot be split evenly over {world_size} expert-parallel ranks: the "
            f"data-parallel size must divide the number of experts"
        )
    per_rank = num_experts // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def checked_expert_ids(expert_ids: Sequence[int], num_experts: int) -> list[int]:
    """`expert_ids` as a list, or ValueError unless distinct, ascending and in [0, num_experts) (empty is fine: an
    expert-parallel rank holds none until it knows its place in the group)."""
    ids = list(expert_ids)
    if ids != sorted(set(ids)) or not all(0 <= e < num_experts for e in ids):
        raise ValueError(f"expert_ids must be distinct, ascending, in [0, {num_experts}); got {ids}")
    return ids


def route(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32 summing to 1 per token, expert ids [T, k]): softmax in fp32,
    top-k, renormalized (Mixtral's routing)."""
    weights, ids = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts; holds the experts `expert_ids` (default: all), stacked:
    w13 [E_local, 2 * ffn_dim, dim] (gate and up, fused as in the dense FeedForward), w2 [E_local, dim, ffn_dim]."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 expert_ids: Sequence[int] | None = None):  # fmt: skip
        super().__init__()
        ids = list(range(num_experts)) if expert_ids is None else checked_expert_ids(expert_ids, num_experts)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.ffn_dim, self.num_experts, self.top_k = ffn_dim, num_experts, top_k
        self.expert_ids = ids
        self.local_slot = {e: slot for slot, e in enumerate(ids)}  # global expert id -> index into the stacks
        param = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)  # noqa: E731
        self.router = param(num_experts, dim)  # replicated on every rank
        self.w13 = param(len(ids), 2 * ffn_dim, dim)
        self.w2 = param(len(ids), dim, ffn_dim)
        self.comm: ExpertComm | None = None  # set by Transformer.set_expert_comm

    def forward(self, x: Tensor) -> Tensor:
        """x: [T, dim] (T may be 0: a dummy forward) -> [T, dim]."""
        if self.comm is None:
            return self.experts(x, *self.route(x))
        everyone, counts = self.comm.gather(x)  # [sum T_r, dim]
        return self.comm.scatter_sum(self.experts(everyone, *self.route(everyone)), counts)

    def decode(self, x: Tensor, rows: int) -> Tensor:
        """Transformer.decode's interface (eager only: MoE models do not compile their decode step)."""
        y = self(x.narrow(0, 0, rows))
        return torch.cat([y, y.new_zeros(x.shape[0] - rows, y.shape[1])])

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [T, dim] -> (weights [T, k] fp32, expert ids [T, k])."""
        return route(F.linear(x.to(self.router.dtype), self.router), self.top_k)

    def experts(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """The local experts' weighted outputs [T, dim]: sum over each token's top-k experts held here (zeros for a
        token with none here)."""
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        flat = ids.reshape(-1)  # [T * k]: pair p is token p // k
        order = flat.argsort(stable=True)  # pairs grouped by expert, tokens ascending within each
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1)[order]
        start = 0
        for expert, n in enumerate(counts):
            slot = self.local_slot.get(expert)
            if n and slot is not None:
                rows = tokens[start : start + n]
                y = self._expert(slot, x.index_select(0, rows))
                out.index_add_(0, rows, y * pair_weights[start : start + n].unsqueeze(1).to(y.dtype))
            start += n
        return out

    def _expert(self, slot: int, x: Tensor) -> Tensor:
        """One expert's SwiGLU on its tokens x: [n, dim] -> [n, dim]: the dense FeedForward's math and casts
        (weights in their dtype, the activation in x's)."""
        w13, w2 = self.w13[slot], self.w2[slot]
        gate, up = F.linear(x.to(w13.dtype), w13).to(x.dtype).split(self.ffn_dim, dim=-1)
        return F.linear((F.silu(gate) * up).to(w2.dtype), w2).to(x.dtype)

    def set_experts(self, expert_ids: Sequence[int], state: dict[str, Tensor], prefix: str) -> None:
        """Hold exactly `expert_ids` from now on (re-sharding): the stacks' rows of experts held already are kept,
        the others copied from `state` (Mixtral names under `prefix`, as `load`; it needs only the new experts),
        and experts no longer wanted are dropped with the old stacks."""
        ids = checked_expert_ids(expert_ids, self.num_experts)
        w13 = self.w13.new_empty((len(ids), *self.w13.shape[1:]))
        w2 = self.w2.new_empty((len(ids), *self.w2.shape[1:]))
        for slot, expert in enumerate(ids):
            held = self.local_slot.get(expert)
            if held is not None:
                w13[slot].copy_(self.w13[held])
                w2[slot].copy_(self.w2[held])
            else:
                _copy_expert(w13[slot], w2[slot], state, f"{prefix}experts.{expert}.")
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.expert_ids = ids
        self.local_slot = {e: slot for slot, e in enumerate(ids)}

    def load(self, state: dict[str, Tensor], prefix: str) -> None:
        """Copy Mixtral-named weights (`{prefix}gate.weight`, `{prefix}experts.{j}.w1/w2/w3.weight`) of the experts
        held here; `prefix` is e.g. 'model.layers.3.block_sparse_moe.'."""
        self.router.copy_(state[prefix + "gate.weight"])
        for slot, expert in enumerate(self.expert_ids):
            _copy_expert(self.w13[slot], self.w2[slot], state, f"{prefix}experts.{expert}.")


def _copy_expert(w13: Tensor, w2: Tensor, state: dict[str, Tensor], prefix: str) -> None:
    """One expert's Mixtral weights (`{prefix}w1/w2/w3.weight`) into its rows of the stacks (w1 and w3 fused)."""
    w13.copy_(torch.cat([state[prefix + "w1.weight"], state[prefix + "w3.weight"]]))
    w2.copy_(state[prefix + "w2.weight"])
