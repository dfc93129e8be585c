"""Token sampling for a whole batch in one pass.

Rows carry their own settings as tensors (SamplingTensors, built once per step by the model runner). Random rows
sample by inverse CDF: one uniform number per row, located in the row's cumulative distribution (searchsorted).
A seeded request draws its number from its own torch.Generator, so its tokens depend only on its seed and its
logits, never on which other requests share the batch. (One number per row, not one per vocabulary entry as
the exponential race needs: drawing [64, 49152] exponentials costs ~150 ms per step on this CPU.)
A structured-output row's grammar mask (grammar.py) comes first: its forbidden tokens are -inf before the banned
ids, the greedy argmax and the filters, so top-k/top-p/min-p choose among the allowed tokens only.
Logprobs come from the raw model distribution (before the grammar mask, temperature and filters).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


@dataclasses.dataclass
class SamplingTensors:
    temperature: Tensor | None  # [N] (1.0 for greedy rows); None when every row has temperature 0 or 1
    is_greedy: Tensor  # [N] bool
    top_k: Tensor | None  # [N] long, vocab size where disabled; None when no row uses it
    top_p: Tensor | None  # [N]; None when no row uses it
    min_p: Tensor | None  # [N]; None when no row uses it
    disallowed: Tensor | None  # [N, V] bool: the tokens the rows' grammars forbid; None when no row has one
    banned: tuple[Tensor, Tensor] | None  # (rows, token ids) set to -inf: EOS/stop ids before min_tokens
    generators: list[tuple[int, torch.Generator]]  # (row, generator) of seeded random rows
    all_greedy: bool
    any_greedy: bool
    num_logprobs: int | None  # max top-k alternatives asked by any row; None: no row wants logprobs


@dataclasses.dataclass
class SamplerOutput:
    token_ids: Tensor  # [N]
    logprobs: Tensor | None  # [N] logprob of the sampled token
    ranks: Tensor | None  # [N] its rank in the raw distribution (1 = best)
    top_ids: Tensor | None  # [N, k]
    top_logprobs: Tensor | None  # [N, k]


def apply_filters(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Temperature, then top-k, top-p and min-p masks (-inf), in place. logits: [N, V] fp32."""
    if t.temperature is not None:
        logits.div_(t.temperature.unsqueeze(1))
    if t.top_k is not None or t.top_p is not None:
        sorted_logits, _ = logits.sort(dim=-1, descending=True)  # [N, V]
        cutoff = torch.full((logits.shape[0], 1), float("-inf"), device=logits.device)  # smallest logit kept
        if t.top_k is not None:
            cutoff = torch.maximum(cutoff, sorted_logits.gather(1, (t.top_k - 1).unsqueeze(1)))
        if t.top_p is not None:
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs  # probability mass strictly above each position
            num_kept = (mass_before < t.top_p.unsqueeze(1)).sum(dim=1, keepdim=True).clamp(min=1)
            cutoff = torch.maximum(cutoff, sorted_logits.gather(1, num_kept - 1))
        logits.masked_fill_(logits < cutoff, float("-inf"))
    if t.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * t.min_p.unsqueeze(1)
        logits.masked_fill_(probs < threshold, float("-inf"))
    return logits


def uniform(num_rows: int, t: SamplingTensors, device: torch.device) -> Tensor:
    """[N] uniform numbers in (0, 1]; seeded rows from their own generator (on CPU, where generators live)."""
    u = torch.rand(num_rows)
    for row, generator in t.generators:
        u[row] = torch.rand(1, generator=generator)
    return (1.0 - u).to(device)


def sample_from(weights: Tensor, t: SamplingTensors, chunk: int = 256) -> Tensor:
    """Inverse-CDF sampling of every row at once. weights: [N, V] unnormalized probabilities -> [N] token ids.

    Two levels (a chunk of `chunk` tokens, then the token inside it) replace a sequential cumsum over the whole
    vocabulary with one vectorized sum and two short cumsums.
    """
    N, V = weights.shape
    chunk = chunk if V % chunk == 0 else V
    chunks = weights.view(N, V // chunk, chunk)
    chunk_cdf = chunks.sum(dim=-1).cumsum_(dim=-1)  # [N, V / chunk]
    target = (uniform(N, t, weights.device) * chunk_cdf[:, -1]).unsqueeze(1)  # (0, total]
    c = torch.searchsorted(chunk_cdf, target).clamp_(max=V // chunk - 1)  # [N, 1]; never an empty chunk
    before = torch.where(c > 0, chunk_cdf.gather(1, (c - 1).clamp(min=0)), 0.0)
    inner_cdf = chunks[torch.arange(N, device=weights.device), c.squeeze(1)].cumsum_(dim=-1)  # [N, chunk]
    rest = torch.minimum(target - before, inner_cdf[:, -1:]).clamp_(min=1e-30)  # rounding stays in the chunk
    i = torch.searchsorted(inner_cdf, rest).clamp_(max=chunk - 1)
    return (c * chunk + i).squeeze(1)


def sample(logits: Tensor, t: SamplingTensors) -> SamplerOutput:
    """logits: [N, V] raw fp32 model logits (consumed: modified in place) -> one token per row (+ logprobs)."""
    raw = logits.clone() if t.num_logprobs is not None else None  # logprobs: the unfiltered distribution
    if t.disallowed is not None:
        logits.masked_fill_(t.disallowed, float("-inf"))
    if t.banned is not None:
        logits.index_put_(t.banned, torch.tensor(float("-inf"), device=logits.device))
    greedy_ids = logits.argmax(dim=-1) if t.any_greedy else None
    if t.all_greedy:
        token_ids = greedy_ids
    else:
        x = apply_filters(logits, t)
        x.sub_(x.max(dim=-1, keepdim=True).values).exp_()  # unnormalized probabilities
        token_ids = sample_from(x, t)
        if t.any_greedy:
            token_ids = torch.where(t.is_greedy, greedy_ids, token_ids)
    if raw is None:
        return SamplerOutput(token_ids, None, None, None, None)
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(t.num_logprobs, dim=-1) if t.num_logprobs else (None, None)
    return SamplerOutput(token_ids, chosen.squeeze(1), ranks, top_ids, top_logprobs)
