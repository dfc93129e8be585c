"""`dpserve bench routing`'s workload and its oracle. Pure: no sockets, no clock.

The workload is a list of conversations, the same for every routing policy given the same seed:

- most are multi-turn sessions of a tenant: a system prompt chosen with Zipf popularity among
  `num_system_prompts` (rank r drawn with weight 1 / r**zipf_s), then 1..max_turns turns; turn 1's prompt is the
  system prompt + the user's text, turn k's is turn k-1's prompt + its answer + new user text, sent with
  `X-Session-Id: <conversation id>`;
- a `no_reuse_share` of them is one request with a prompt of its own (no system prompt, no session): traffic
  that no cache helps.

Prompts are token ids (the completions API takes them as they are), so the block hashes computed here are the
ones the engines compute: nothing is re-tokenized. The answer appended to the next turn's prompt is the null
engine's answer (its fixed cycle of `ANSWER_CYCLE` token ids, `max_tokens` of them: `ignore_eos`), so every
turn's prompt is known before the run and is the same under every policy.

The oracle (`oracle_cached_tokens`) is the hit rate of a router that always sends a request to the rank holding
its longest cached prefix, with caches that never evict: a request's cached tokens are its leading full blocks
seen in any earlier request (in the order the requests were sent), capped at all but its last token, as the
null engine's prefix cache counts them (null_prefix_cache.py). Requests that overlap in time count as if the
earlier one had been admitted first, so the oracle is a little above what any router could do.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from array import array
from collections.abc import Iterable, Sequence

from dpserve_shared.block_hash import block_hashes

# The null engine's output cycle (null_core.py: `min(1000 + i, vocab_size - 1)` for i in 0..7; the bundled
# model's vocabulary is larger than 1008).
ANSWER_CYCLE = tuple(1000 + i for i in range(8))
# Prompt token ids are drawn from here: ordinary ids of the bundled model's vocabulary (49152), no special tokens.
TOKEN_ID_RANGE = (1000, 40000)


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    num_conversations: int = 2000
    num_system_prompts: int = 300
    zipf_s: float = 1.1
    system_prompt_tokens: tuple[int, int] = (256, 1024)  # uniform in [lo, hi]
    max_turns: int = 6  # each session has 1..max_turns turns, uniform
    user_tokens: tuple[int, int] = (16, 128)  # each turn's new text
    no_reuse_share: float = 0.2
    no_reuse_tokens: tuple[int, int] = (256, 1024)
    max_tokens: int = 16  # each answer
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One session's turns (or one no-reuse request). Turn k's prompt is the concatenation of the first k+1
    `segments` (the system prompt, the first user text, then answer + user text per turn): built when asked for,
    so that a long workload holds each token once."""

    conversation_id: str
    session: bool  # sent with X-Session-Id
    system_prompt: int | None  # its index, None for a no-reuse request
    segments: tuple[array, ...]  # of token ids (array("l"): a long workload's tokens take 8 bytes each)

    @property
    def num_turns(self) -> int:
        return len(self.segments) - 1 if self.system_prompt is not None else 1

    def prompt(self, turn: int) -> list[int]:
        end = turn + 2 if self.system_prompt is not None else 1
        return [token for segment in self.segments[:end] for token in segment]

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt(turn) for turn in range(self.num_turns)]


def _tokens(rng: random.Random, bounds: tuple[int, int]) -> array:
    lo, hi = TOKEN_ID_RANGE
    return array("l", [rng.randrange(lo, hi) for _ in range(rng.randint(*bounds))])


def answer_tokens(max_tokens: int) -> array:
    return array("l", [ANSWER_CYCLE[i % len(ANSWER_CYCLE)] for i in range(max_tokens)])


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (rank**s) for rank in range(1, n + 1)]


def build_workload(config: WorkloadConfig) -> list[Conversation]:
    """The conversations, in the order clients take them; a function of `config` alone."""
    rng = random.Random(config.seed)
    system_prompts = [_tokens(rng, config.system_prompt_tokens) for _ in range(config.num_system_prompts)]
    popularity = list(range(config.num_system_prompts))
    rng.shuffle(popularity)  # which prompt is the most popular: not the first one drawn
    weights = zipf_weights(config.num_system_prompts, config.zipf_s)
    answer = answer_tokens(config.max_tokens)
    conversations = []
    for i in range(config.num_conversations):
        if rng.random() < config.no_reuse_share:
            conversations.append(Conversation(f"c{i}", False, None, (_tokens(rng, config.no_reuse_tokens),)))
            continue
        system = popularity[rng.choices(range(config.num_system_prompts), weights)[0]]
        segments = [system_prompts[system], _tokens(rng, config.user_tokens)]
        for _ in range(rng.randint(1, config.max_turns) - 1):
            segments.append(answer + _tokens(rng, config.user_tokens))
        conversations.append(Conversation(f"c{i}", True, system, tuple(segments)))
    return conversations


def num_requests(conversations: Iterable[Conversation]) -> int:
    return sum(c.num_turns for c in conversations)


def oracle_cached_tokens(prompts: Iterable[Sequence[int]], block_size: int) -> list[int]:
    """Per prompt, in the order given (the order they were sent): the tokens an oracle router would find cached
    (see the module docstring)."""
    seen: set[int] = set()
    cached = []
    for prompt in prompts:
        hashes = block_hashes(prompt, block_size)
        num_hit = sum(1 for _ in itertools.takewhile(seen.__contains__, hashes))
        cached.append(min(num_hit * block_size, len(prompt) - 1))
        seen.update(hashes)
    return cached
