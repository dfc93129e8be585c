"""POST /v1/completions: OpenAI's legacy completions, with vLLM's extensions."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from dpserve_shared.schema import TokenLogprob

from dpserve_frontend.errors import BadRequest
from dpserve_frontend.generation import Generation, SeqDelta, Sequence, new_request_id
from dpserve_frontend.logprobs import completion_logprobs
from dpserve_frontend.parsing import pinned_rank, read_request, session_id
from dpserve_frontend.protocol import CompletionRequest, check_completion_request, check_token_id, prompt_inputs
from dpserve_frontend.responses import ResponseView, respond, usage
from dpserve_frontend.spec import PromptInput, build_spec
from dpserve_frontend.sse import sse_event
from dpserve_frontend.state import FrontendState
from dpserve_frontend.structured import has_constraint_fields, request_constraint
from dpserve_frontend.tokenizer import ModelTokenizer


def read_prompts(req: CompletionRequest, tok: ModelTokenizer) -> list[PromptInput]:
    """The prompt(s) as token ids: texts encoded, token ids checked against the vocabulary."""
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
    return prompts


class _Completion(ResponseView):
    """Formats one generation as OpenAI completion objects."""

    chunk_object = "text_completion"

    def __init__(self, req: CompletionRequest, generation: Generation, tok: ModelTokenizer, model: str):
        # fast: plain text deltas (no echo, no logprobs)
        super().__init__(req, generation, tok, model, is_fast=not req.echo and req.logprobs is None)
        self._num_sent_chars: dict[int, int] = {}  # per choice, characters streamed so far (for text_offset)

    def echo_prefix(self, seq: Sequence) -> tuple[str, list[int], list[TokenLogprob | None]]:
        prompt = self.generation.spec.prompts[seq.prompt_index]
        text = prompt.text if prompt.text is not None else self.tok.decode(prompt.token_ids, skip_special_tokens=False)
        logprobs = list(seq.prompt_logprobs or [])
        return text, prompt.token_ids, logprobs

    def choice(self, seq: Sequence, text: str, token_ids: list[int], logprobs: list, finish_reason, initial_offset):
        choice = {"index": seq.index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.req.logprobs is not None:
            choice["logprobs"] = completion_logprobs(self.tok, token_ids, logprobs, self.req.logprobs, initial_offset)
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
            return self.template_event(b'{"index":%d,"text":' % delta.seq.index, orjson.dumps(delta.text),
                                       b',"logprobs":null,"finish_reason":null}')
        choice = self.delta_choice(delta)
        return None if choice is None else sse_event(self.chunk([choice]))

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
    req = await read_request(request, CompletionRequest, state.settings.strict_request_fields)
    rank = pinned_rank(request)
    info, tok = state.require_model(req.model)
    check_completion_request(req, tok.vocab_size)
    prompts = read_prompts(req, tok)
    options = state.grammars.json_options(req)
    constraint = None
    if has_constraint_fields(req):
        constraint = await state.grammars.off_loop(request_constraint, req, options)
    grammar = await state.grammars.grammar(req, constraint)
    spec = build_spec(req, prompts, info.max_model_len, rank, grammar)
    spec.session_id = session_id(request)
    generation = Generation(state.pool, tok, state.metrics, spec, new_request_id("cmpl"), arrival_s)
    completion = _Completion(req, generation, tok, info.name)
    try:
        state.check_can_serve(spec.pinned_rank)
        generation.start()
        return await respond(request, generation, completion, req.stream)
    finally:
        generation.close()
