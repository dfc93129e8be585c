"""POST /v1/chat/completions: OpenAI's chat completions over the model's chat template."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from dpserve_frontend.generation import Generation, SeqDelta, new_request_id
from dpserve_frontend.logprobs import chat_logprobs
from dpserve_frontend.parsing import pinned_rank, read_request, session_id
from dpserve_frontend.protocol import ChatCompletionRequest, check_chat_request, message_dicts
from dpserve_frontend.responses import ResponseView, respond, usage
from dpserve_frontend.spec import PromptInput, build_spec
from dpserve_frontend.sse import sse_event
from dpserve_frontend.state import FrontendState
from dpserve_frontend.tokenizer import ModelTokenizer


class _ChatCompletion(ResponseView):
    """Formats one generation as OpenAI chat completion objects."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, generation: Generation, tok: ModelTokenizer, model: str):
        super().__init__(req, generation, tok, model, is_fast=not req.logprobs)  # fast: no logprobs

    def _logprobs(self, token_ids, logprobs):
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.tok, token_ids, logprobs, self.req.top_logprobs or 0)

    def role_chunk(self, index: int) -> dict:
        delta = {"role": "assistant", "content": ""}
        return self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])

    def delta_choice(self, delta: SeqDelta) -> dict | None:
        if not delta.text and delta.finish_reason is None and not (self.req.logprobs and delta.num_tokens):
            return None
        choice = {
            "index": delta.seq.index,
            "delta": {"content": delta.text} if delta.text or delta.finish_reason is None else {},
            "logprobs": self._logprobs(delta.token_ids(), delta.logprobs()),
            "finish_reason": delta.finish_reason,
        }
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.seq.stop_reason
        return choice

    def delta_event(self, delta: SeqDelta) -> bytes | None:
        """The SSE event for one delta, or None when it has nothing to send."""
        if self._fast and delta.finish_reason is None:
            if not delta.text:
                return None  # as `delta_choice`: nothing to say without logprobs
            # {"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
            return self.template_event(b'{"index":%d,"delta":{"content":' % delta.seq.index, orjson.dumps(delta.text),
                                       b'},"logprobs":null,"finish_reason":null}')
        choice = self.delta_choice(delta)
        return None if choice is None else sse_event(self.chunk([choice]))

    def final(self) -> dict:
        choices = []
        for seq in self.generation.seqs:
            choices.append({
                "index": seq.index,
                "message": {"role": "assistant", "content": seq.text},
                "logprobs": self._logprobs(seq.token_ids, seq.logprobs),
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
            })
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.generation),
        }


async def create_chat_completion(request: web.Request, state: FrontendState) -> web.StreamResponse:
    arrival_s = time.perf_counter()
    req = await read_request(request, ChatCompletionRequest, state.settings.strict_request_fields)
    rank = pinned_rank(request)
    info, tok = state.require_model(req.model)
    check_chat_request(req, tok.vocab_size)
    _, prompt_ids = tok.encode_chat(message_dicts(req.messages), req.add_generation_prompt,
                                    req.continue_final_message, req.add_special_tokens, req.chat_template_kwargs)
    spec = build_spec(req, [PromptInput(prompt_ids)], info.max_model_len, rank)
    spec.session_id = session_id(request)
    generation = Generation(state.pool, tok, state.metrics, spec, new_request_id("chatcmpl"), arrival_s)
    chat = _ChatCompletion(req, generation, tok, info.name)
    try:
        state.check_can_serve(spec.pinned_rank)
        generation.start()
        roles = tuple(chat.role_chunk(seq.index) for seq in generation.seqs)
        return await respond(request, generation, chat, req.stream, roles)
    finally:
        generation.close()
