"""Token logprobs as OpenAI shows them: completions' four parallel lists, chat's `content` list. JSON has no
-inf or NaN, so a logprob is clamped to MIN_LOGPROB."""

from __future__ import annotations

import math

from dpserve_shared.schema import TokenLogprob

from dpserve_frontend.tokenizer import ModelTokenizer

MIN_LOGPROB = -9999.0


def clean_logprob(value: float) -> float:
    if math.isnan(value):
        return MIN_LOGPROB
    return max(value, MIN_LOGPROB)


def completion_logprobs(
    tok: ModelTokenizer,
    token_ids: list[int],
    logprobs: list[TokenLogprob | None],
    num_top: int,
    initial_offset: int,
) -> dict:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset (vLLM's offsets)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = initial_offset
    for i, token_id in enumerate(token_ids):
        text = tok.token_text(token_id)
        entry = logprobs[i] if i < len(logprobs) else None
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(clean_logprob(entry.logprob))
        top = {text: clean_logprob(entry.logprob)}  # the sampled token first, then the top alternatives (vLLM)
        for top_id, value in zip(entry.top_ids[:num_top], entry.top_logprobs[:num_top]):
            top.setdefault(tok.token_text(top_id), clean_logprob(value))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }


def chat_logprobs(tok: ModelTokenizer, token_ids: list[int], logprobs: list[TokenLogprob], num_top: int) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    content = []
    for i, token_id in enumerate(token_ids):
        text = tok.token_text(token_id)
        entry = logprobs[i] if i < len(logprobs) else None
        top = []
        if entry is not None:
            for top_id, value in zip(entry.top_ids[:num_top], entry.top_logprobs[:num_top]):
                top_text = tok.token_text(top_id)
                top.append({"token": top_text, "logprob": clean_logprob(value), "bytes": list(top_text.encode())})
        content.append({
            "token": text,
            "logprob": clean_logprob(entry.logprob) if entry is not None else MIN_LOGPROB,
            "bytes": list(text.encode()),
            "top_logprobs": top,
        })
    return {"content": content}
