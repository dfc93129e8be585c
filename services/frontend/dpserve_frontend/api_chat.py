"""POST /v1/chat/completions: OpenAI's chat completions over the model's chat template."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from dpserve_shared.schema import SamplingParams, TokenLogprob

from dpserve_frontend.errors import BadRequest
from dpserve_frontend.generation import Generation, GenerationSpec, PromptInput, SeqDelta, new_request_id
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
    ChatCompletionRequest,
    check_max_tokens,
    check_sampling_fields,
    message_dicts,
    stop_strings,
)
from dpserve_frontend.state import FrontendState
from dpserve_frontend.tokenizer import ModelTokenizer


def render_chat_prompt(tok: ModelTokenizer, messages, add_generation_prompt: bool, continue_final_message: bool,
                       add_special_tokens: bool, chat_template_kwargs: dict | None) -> tuple[str, list[int]]:
    """The prompt text and ids for a conversation (shared with /tokenize so the counts agree)."""
    dicts = message_dicts(messages)
    if continue_final_message and add_generation_prompt:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true",
                         param="continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("messages", "add_generation_prompt", "bos_token", "eos_token"):
        kwargs.pop(reserved, None)
    text = tok.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:
        # Leave the last message open: cut the rendered text right after its content.
        last = dicts[-1]["content"]
        end = text.rfind(last) if last else -1
        if end < 0:
            raise BadRequest("continue_final_message: the final message's content is not in the rendered prompt",
                             param="continue_final_message")
        text = text[: end + len(last)]
    return text, tok.encode(text, add_special_tokens=add_special_tokens)


def build_spec(req: ChatCompletionRequest, state: FrontendState, rank: int | None) -> GenerationSpec:
    info, tok = state.require_model(req.model)
    check_sampling_fields(req, tok.vocab_size)
    check_max_tokens(req.max_tokens, "max_tokens")
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                             param="top_logprobs")
        if not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    for name in ("tools", "functions", "audio", "prediction", "web_search_options"):
        if getattr(req, name):
            raise BadRequest(f"{name} is not supported by this server", param=name)
    for name in ("tool_choice", "function_call"):
        if getattr(req, name) not in (None, "none", "auto"):
            raise BadRequest(f"{name} is not supported by this server", param=name)
    if req.modalities not in (None, [], ["text"]):
        raise BadRequest("only the 'text' modality is supported", param="modalities")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise BadRequest("only response_format {'type': 'text'} is supported", param="response_format")
    _, prompt_ids = render_chat_prompt(tok, req.messages, req.add_generation_prompt, req.continue_final_message,
                                       req.add_special_tokens, req.chat_template_kwargs)
    requested, param = req.max_completion_tokens, "max_completion_tokens"
    if requested is None:
        requested, param = req.max_tokens, "max_tokens"
    max_tokens = resolve_max_tokens(requested, None, len(prompt_ids), info.max_model_len, param,
                                    "messages")
    if req.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
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
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
    )
    return GenerationSpec(
        prompts=[PromptInput(prompt_ids)],
        sampling=sampling,
        n=req.n or 1,
        stop=stop_strings(req.stop),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        pinned_rank=rank,
    )


def chat_logprobs(tok: ModelTokenizer, token_ids: list[int], logprobs: list[TokenLogprob], num_top: int) -> dict:
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
            "logprob": clean_logprob(entry.logprob) if entry is not None else MIN_CHAT_LOGPROB,
            "bytes": list(text.encode()),
            "top_logprobs": top,
        })
    return {"content": content}


MIN_CHAT_LOGPROB = -9999.0


class _ChatCompletion:
    def __init__(self, state: FrontendState, req: ChatCompletionRequest, generation: Generation):
        self.req = req
        self.generation = generation
        self.tok = state.tokenizer
        self.model = state.model_info.name
        self.id = generation.request_id
        self.created = int(time.time())
        # Plain content deltas (no logprobs) are written from byte templates.
        self._fast = not req.logprobs
        self._running_usage = self.include_usage and req.stream_options.continuous_usage_stats
        self._prefix, self._suffix = chunk_template(self.chunk([])) if self._fast else (b"", b"")

    @property
    def include_usage(self) -> bool:
        options = self.req.stream_options
        return bool(options and options.include_usage)

    def _logprobs(self, token_ids, logprobs):
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.tok, token_ids, logprobs, self.req.top_logprobs or 0)

    def chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            # null on content chunks (the totals come last), or the running totals with continuous_usage_stats
            options = self.req.stream_options
            chunk["usage"] = usage(self.generation) if options.continuous_usage_stats and choices else None
        return chunk

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
            suffix = usage_suffix(self.generation) if self._running_usage else self._suffix
            return b"".join((self._prefix, b'{"index":%d,"delta":{"content":' % delta.seq.index,
                             orjson.dumps(delta.text), b'},"logprobs":null,"finish_reason":null}', suffix))
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
    req = await read_request(request, ChatCompletionRequest)
    spec = build_spec(req, state, pinned_rank(request))
    generation = Generation(state, spec, new_request_id("chatcmpl"), arrival_s)
    chat = _ChatCompletion(state, req, generation)
    try:
        generation.start()
        return await respond(request, generation, chat, req.stream, tuple(chat.role_chunk(q.index) for q in generation.seqs))
    finally:
        generation.close()
