"""One request's state inside the engine: its tokens, how many of them have KV in the cache, and its blocks."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
from dpserve_shared.schema import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from dpserve_engine.grammar import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request as the scheduler sees it.

    `token_ids` is prompt + generated tokens. `num_computed_tokens` of them have their K/V in the cache (blocks in
    `block_table`); the rest are computed by the next steps, a chunk at a time. A preempted sequence drops its
    blocks and its computed count and recomputes prompt + generated tokens later, so nothing is lost.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_index: int,
                 num_generated: int = 0):  # fmt: skip
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival_index = arrival_index
        self.is_continuation = num_generated > 0  # a moved request's rest: exempt from --max-queue-time-s
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        # Leading tokens whose K/V lie in shared prefix-cache blocks (the block manager's hits). Usually equal to
        # num_computed_tokens at admission; one more when every token was cached: the last one is computed again
        # for its logits, and its K/V, already in a shared block, is not written again.
        self.num_reused_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids, in order
        self.is_first_output = True
        self.was_admitted = False
        self.arrival_s: float | None = None  # time.monotonic() when the engine got it
        self.first_scheduled_s: float | None = None  # when it was first admitted (queue time = the difference)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        # Prompt logprobs need every prompt position computed here, so such requests skip the prefix cache.
        self.wants_prompt_logprobs = params.prompt_logprobs is not None
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if self.wants_prompt_logprobs else None
        self.matcher: GrammarMatcher | None = None  # params.grammar's, once compiled (grammar.py)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
            for _ in range(num_generated):  # a continuation (migrated request): the draws its earlier tokens took
                torch.rand(1, generator=self.generator)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
