"""POST /v1/chat/completions: OpenAI's chat completions over the model's chat template, with structured outputs
(structured.py) and tool calls (tools.py for the request, tool_calls.py for the response)."""

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
from dpserve_frontend.structured import Constraint, JsonOptions, has_constraint_fields, request_constraint
from dpserve_frontend.tokenizer import ModelTokenizer
from dpserve_frontend.tool_calls import ToolCallStream, tool_message
from dpserve_frontend.tools import ToolChoice, ToolPlan, plan_tools


class _ChatCompletion(ResponseView):
    """Formats one generation as OpenAI chat completion objects."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, req: ChatCompletionRequest, generation: Generation, tok: ModelTokenizer, model: str,
                 tool_choice: ToolChoice | None):
        # fast: plain content deltas (no logprobs, no tool calls to read out of the text)
        super().__init__(req, generation, tok, model, is_fast=not req.logprobs and tool_choice is None)
        self._tool_choice = tool_choice  # set: the output is read for tool calls
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice index

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

    def tool_choices(self, delta: SeqDelta) -> list[dict]:
        """A delta's chunk choices when the output is read for tool calls: content and tool-call deltas as the
        parser decides them (text that may start a tag waits), the delta's logprobs on the first, then the
        finish_reason in a choice with an empty delta."""
        index = delta.seq.index
        stream = self._tool_streams.get(index)
        if stream is None:
            stream = self._tool_streams[index] = ToolCallStream(self._tool_choice)
        is_finished = delta.finish_reason is not None
        choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None}
                   for d in stream.deltas(delta.text, is_finished)]
        if is_finished:
            choices.append({"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": stream.finish_reason(delta.finish_reason),
                            "stop_reason": delta.seq.stop_reason})  # fmt: skip
        if self.req.logprobs and delta.num_tokens:
            if not choices:
                choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": None})
            choices[0]["logprobs"] = self._logprobs(delta.token_ids(), delta.logprobs())
        return choices

    def delta_event(self, delta: SeqDelta) -> bytes | None:
        """The SSE event(s) for one delta, or None when it has nothing to send."""
        if self._tool_choice is not None:
            return b"".join(sse_event(self.chunk([choice])) for choice in self.tool_choices(delta)) or None
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
            if self._tool_choice is not None:
                message, finish_reason = tool_message(seq.text, self._tool_choice, seq.finish_reason)
            else:
                message, finish_reason = {"role": "assistant", "content": seq.text, "refusal": None}, seq.finish_reason
            choices.append({
                "index": seq.index,
                "message": message,
                "logprobs": self._logprobs(seq.token_ids, seq.logprobs),
                "finish_reason": finish_reason,
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


def _constraint_and_tools(req: ChatCompletionRequest, options: JsonOptions) -> tuple[Constraint | None,
                                                                                     ToolPlan | None]:
    """The request's constraint (its own, or its tool calls' when the output is read for calls) and its tools."""
    constraint = request_constraint(req, options)
    tools = plan_tools(req, constraint)
    if tools is not None and tools.is_parsed:
        constraint = tools.constraint(options)
    return constraint, tools


async def create_chat_completion(request: web.Request, state: FrontendState) -> web.StreamResponse:
    arrival_s = time.perf_counter()
    req = await read_request(request, ChatCompletionRequest, state.settings.strict_request_fields)
    rank = pinned_rank(request)
    info, tok = state.require_model(req.model)
    check_chat_request(req, tok.vocab_size)
    options = state.grammars.json_options(req)
    constraint, tools = None, None
    if has_constraint_fields(req) or req.tools or req.tool_choice is not None:
        constraint, tools = await state.grammars.off_loop(_constraint_and_tools, req, options)
    _, prompt_ids = tok.encode_chat(message_dicts(req.messages), req.add_generation_prompt,
                                    req.continue_final_message, req.add_special_tokens, req.chat_template_kwargs,
                                    tools.template_tools() if tools is not None else None)  # fmt: skip
    grammar = await state.grammars.grammar(req, constraint)
    spec = build_spec(req, [PromptInput(prompt_ids)], info.max_model_len, rank, grammar)
    spec.session_id = session_id(request)
    generation = Generation(state.pool, tok, state.metrics, spec, new_request_id("chatcmpl"), arrival_s)
    tool_choice = tools.choice if tools is not None and tools.is_parsed else None
    chat = _ChatCompletion(req, generation, tok, info.name, tool_choice)
    try:
        state.check_can_serve(spec.pinned_rank)
        generation.start()
        roles = tuple(chat.role_chunk(seq.index) for seq in generation.seqs)
        return await respond(request, generation, chat, req.stream, roles)
    finally:
        generation.close()
