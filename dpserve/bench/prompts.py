"""`dpserve bench serve`'s synthetic prompts: exactly `--input-len` tokens of the model's tokenizer, built from
whole-word tokens that re-tokenize to themselves, so the server sees exactly that many prompt tokens (completions
endpoint; the chat endpoint adds the chat template's tokens around them). No downloads: the default tokenizer is
the bundled model's."""

from __future__ import annotations

import os
import random


def load_tokenizer(spec: str | None):
    """A `tokenizers.Tokenizer`: a tokenizer.json file, a directory holding one, a .gguf / model name
    (through dpserve_engine), or by default the bundled model's."""
    from tokenizers import Tokenizer

    if spec and os.path.isfile(spec) and spec.endswith(".json"):
        return Tokenizer.from_file(spec)
    if spec and os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return Tokenizer.from_file(os.path.join(spec, "tokenizer.json"))
    from dpserve_engine.model_info import load_model_info
    from dpserve_engine.settings import EngineConfig

    config = EngineConfig(model=spec) if spec else EngineConfig()
    return Tokenizer.from_str(load_model_info(config).tokenizer_json)


def word_token_pool(tokenizer, limit: int = 50000) -> list[int]:
    """Ids of tokens that are ' ' + lowercase ASCII letters and encode back to exactly themselves.

    A prompt made of such words re-tokenizes to exactly the chosen ids: every word is its own pre-token
    (byte-level pre-tokenizers split before spaces) and the whole word is one token.
    """
    pool = []
    vocab = tokenizer.get_vocab()
    for token, idx in sorted(vocab.items(), key=lambda kv: kv[1])[:limit]:
        text = tokenizer.decode([idx])
        word = text[1:]
        if len(text) < 3 or text[0] != " " or not (word.isascii() and word.isalpha() and word.islower()):
            continue
        if tokenizer.encode(text, add_special_tokens=False).ids == [idx]:
            pool.append(idx)
    if len(pool) < 100:
        raise ValueError(f"the tokenizer has only {len(pool)} plain word tokens; cannot build synthetic prompts")
    return pool


def make_prompts(
    tokenizer,
    num: int,
    input_len: int,
    seed: int = 0,
    identical: bool = False,
    shared_prefix_len: int = 0,
    pool: list[int] | None = None,
    prefix_seed: int | None = None,
) -> list[str]:
    """`num` prompts of exactly `input_len` tokens each: distinct random word sequences by default; all equal
    with `identical`; or sharing their first `shared_prefix_len` tokens. The shared part is drawn from
    `prefix_seed` (default `seed`), so warm-up and measured prompts can share it."""
    if input_len < 1:
        raise ValueError("--input-len must be at least 1")
    pool = pool or word_token_pool(tokenizer)
    shared_prefix_len = min(max(shared_prefix_len, 0), input_len)
    prefix_rng = random.Random(seed if prefix_seed is None else prefix_seed)
    prefix = [prefix_rng.choice(pool) for _ in range(input_len if identical else shared_prefix_len)]
    rng = random.Random(seed + 7919 if prefix_seed is None else seed)
    prompts = []
    for _ in range(num):
        ids = prefix + [rng.choice(pool) for _ in range(input_len - len(prefix))]
        text = tokenizer.decode(ids)
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if len(got) != input_len:  # cannot happen with word_token_pool; kept as a guard
            raise AssertionError(f"synthetic prompt re-tokenized to {len(got)} tokens, not {input_len}")
        prompts.append(text)
    return prompts
