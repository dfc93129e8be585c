"""POST /v1/completions: OpenAI's legacy completions, with vLLM's extensions."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from dpserve_shared.schema import SamplingParams, TokenLogprob

from dpserve_frontend.errors import BadRequest
from dpserve_frontend.generation import Generation, GenerationSpec, PromptInput, SeqDelta, Sequence, new_request_id
from dpserve_frontend.http_util import (
    respond,
    chunk_template,
    clean_logprob,
    pinned_rank,
    read_request,
    resolve_max_tokens,
    sse_event,
    usage,
    usage_suffix,
)
from dpserve_frontend.protocol import (
    MAX_LOGPROBS,
    CompletionRequest,
    check_max_tokens,
    check_sampling_fields,
    check_token_id,
    prompt_inputs,
    stop_strings,
)
from dpserve_frontend.state import FrontendState
from dpserve_frontend.tokenizer import ModelTokenizer

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def build_spec(req: CompletionRequest, state: FrontendState, rank: int | None) -> GenerationSpec:
    info, tok = state.require_model(req.model)
    check_sampling_fields(req, tok.vocab_size)
    check_max_tokens(req.max_tokens, "max_tokens")
    if req.best_of not in (None, 1):
        raise BadRequest("best_of is only supported as 1 or null", param="best_of")
    if req.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}", param="logprobs")
    prompts = []
    for item in prompt_inputs(req.prompt):
        if isinstance(item, str):
            prompts.append(PromptInput(tok.encode(item, add_special_tokens=req.add_special_tokens), item))
        else:
            for token_id in item:
                check_token_id(token_id, tok.vocab_size, "prompt")
            prompts.append(PromptInput(list(item)))
        if not prompts[-1].token_ids:
            raise BadRequest("the prompt is empty", param="prompt")
    longest = max(len(p.token_ids) for p in prompts)
    max_tokens = resolve_max_tokens(req.max_tokens, DEFAULT_MAX_TOKENS, longest, info.max_model_len, "max_tokens",
                                    "prompt")
    if req.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    sampling = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    return GenerationSpec(
        prompts=prompts,
        sampling=sampling,
        n=req.n or 1,
        stop=stop_strings(req.stop),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        pinned_rank=rank,
    )


def logprobs_object(
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


class _Completion:
    """Formats one generation as OpenAI completion objects."""

    def __init__(self, state: FrontendState, req: CompletionRequest, generation: Generation):
        self.req = req
        self.generation = generation
        self.tok = state.tokenizer
        self.model = state.model_info.name
        self.id = generation.request_id
        self.created = int(time.time())
        self._num_sent_chars: dict[int, int] = {}  # per choice, characters streamed so far (for text_offset)
        # Plain text deltas (no echo, no logprobs) are written from byte templates.
        self._fast = not req.echo and req.logprobs is None
        self._running_usage = self.include_usage and req.stream_options.continuous_usage_stats
        self._prefix, self._suffix = chunk_template(self.chunk([])) if self._fast else (b"", b"")

    def echo_prefix(self, seq: Sequence) -> tuple[str, list[int], list[TokenLogprob | None]]:
        prompt = self.generation.spec.prompts[seq.prompt_index]
        text = prompt.text if prompt.text is not None else self.tok.decode(prompt.token_ids, skip_special_tokens=False)
        logprobs = list(seq.prompt_logprobs or [])
        return text, prompt.token_ids, logprobs

    def choice(self, seq: Sequence, text: str, token_ids: list[int], logprobs: list, finish_reason, initial_offset):
        choice = {"index": seq.index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.req.logprobs is not None:
            choice["logprobs"] = logprobs_object(self.tok, token_ids, logprobs, self.req.logprobs, initial_offset)
        if finish_reason is not None:
            choice["stop_reason"] = seq.stop_reason
        return choice

    def full_choice(self, seq: Sequence) -> dict:
        text, token_ids, logprobs = seq.text, seq.token_ids, list(seq.logprobs)
        if self.req.echo:
            prefix, prompt_ids, prompt_logprobs = self.echo_prefix(seq)
            text = prefix + text
            token_ids = list(prompt_ids) + list(token_ids)
            logprobs = _pad(prompt_logprobs, len(prompt_ids)) + logprobs
        return self.choice(seq, text, token_ids, logprobs, seq.finish_reason, 0)

    def delta_choice(self, delta: SeqDelta) -> dict | None:
        seq = delta.seq
        text, token_ids, logprobs = delta.text, delta.token_ids(), list(delta.logprobs())
        first = seq.index not in self._num_sent_chars
        if first and self.req.echo:
            prefix, prompt_ids, prompt_logprobs = self.echo_prefix(seq)
            text = prefix + text
            token_ids = list(prompt_ids) + token_ids
            logprobs = _pad(prompt_logprobs, len(prompt_ids)) + logprobs
        if not text and not token_ids and delta.finish_reason is None:
            return None
        offset = self._num_sent_chars.get(seq.index, 0)
        self._num_sent_chars[seq.index] = offset + len(text)
        return self.choice(seq, text, token_ids, logprobs, delta.finish_reason, offset)

    def delta_event(self, delta: SeqDelta) -> bytes | None:
        """The SSE event for one delta, or None when it has nothing to send."""
        if self._fast and delta.finish_reason is None:
            if not delta.text and not delta.num_tokens:
                return None
            # {"index": i, "text": text, "logprobs": None, "finish_reason": None}, as `delta_choice` builds it
            suffix = usage_suffix(self.generation) if self._running_usage else self._suffix
            return b"".join((self._prefix, b'{"index":%d,"text":' % delta.seq.index, orjson.dumps(delta.text),
                             b',"logprobs":null,"finish_reason":null}', suffix))
        choice = self.delta_choice(delta)
        return None if choice is None else sse_event(self.chunk([choice]))

    def chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            # null on content chunks (the totals come last), or the running totals with continuous_usage_stats
            options = self.req.stream_options
            chunk["usage"] = usage(self.generation) if options.continuous_usage_stats and choices else None
        return chunk

    @property
    def include_usage(self) -> bool:
        options = self.req.stream_options
        return bool(options and options.include_usage)

    def final(self) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.full_choice(seq) for seq in self.generation.seqs],
            "usage": usage(self.generation),
        }


def _pad(values: list, length: int) -> list:
    return (values + [None] * length)[:length]


async def create_completion(request: web.Request, state: FrontendState) -> web.StreamResponse:
    arrival_s = time.perf_counter()
    req = await read_request(request, CompletionRequest)
    spec = build_spec(req, state, pinned_rank(request))
    generation = Generation(state, spec, new_request_id("cmpl"), arrival_s)
    completion = _Completion(state, req, generation)
    try:
        generation.start()
        return await respond(request, generation, completion, req.stream)
    finally:
        generation.close()
