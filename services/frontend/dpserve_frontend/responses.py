"""Answering with a generation: one JSON body at the end, or the deltas streamed as SSE; the `usage` object and
the chunk scaffolding both endpoints' response builders share (`ResponseView`)."""

from __future__ import annotations

import time

import orjson
from aiohttp import web

from dpserve_frontend.errors import APIError
from dpserve_frontend.generation import Generation
from dpserve_frontend.sse import SSEStream, chunk_template, sse_event, usage_suffix
from dpserve_frontend.tokenizer import ModelTokenizer


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def usage(generation: Generation) -> dict:
    prompt = generation.num_prompt_tokens
    completion = generation.num_completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": generation.num_cached_tokens},
    }


class ResponseView:
    """The base of an endpoint's response builder: id, creation time, model, the streamed chunk object (with
    `usage` null, or running with `continuous_usage_stats`) and its byte template for plain per-token chunks.
    Endpoints add `final()`, `delta_event(delta)` and their choice objects."""

    chunk_object = ""  # the streamed chunk's "object"

    def __init__(self, req, generation: Generation, tok: ModelTokenizer, model: str, is_fast: bool):
        self.req = req
        self.generation = generation
        self.tok = tok
        self.model = model
        self.id = generation.request_id
        self.created = int(time.time())
        self._fast = is_fast  # plain deltas are written from the byte template
        self._running_usage = self.include_usage and req.stream_options.continuous_usage_stats
        self._prefix, self._suffix = chunk_template(self.chunk([])) if is_fast else (b"", b"")

    @property
    def include_usage(self) -> bool:
        options = self.req.stream_options
        return bool(options and options.include_usage)

    def chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage:
            # null on content chunks (the totals come last), or the running totals with continuous_usage_stats
            options = self.req.stream_options
            chunk["usage"] = usage(self.generation) if options.continuous_usage_stats and choices else None
        return chunk

    def template_event(self, *choice: bytes) -> bytes:
        """The event of a chunk with one choice given as encoded JSON parts (`sse_event` of it, byte for byte)."""
        suffix = usage_suffix(usage(self.generation)) if self._running_usage else self._suffix
        return b"".join((self._prefix, *choice, suffix))


async def respond(
    request: web.Request, generation: Generation, view, is_stream: bool, leading: tuple[dict, ...] = ()
) -> web.StreamResponse:
    """Run a started generation and answer with `view`'s JSON body, or stream it as SSE.

    `view` is the endpoint's response builder: `final()`, `delta_event(delta) -> bytes | None`, `chunk(choices)`
    and `include_usage`. `leading` chunks (chat's role chunks) go out before the first delta. An error after the
    stream started is an error event, then `[DONE]`.
    """
    if not is_stream:
        async for _ in generation.deltas():
            pass
        return json_response(view.final())
    stream = SSEStream(request)
    await stream.prepare()
    try:
        for chunk in leading:
            await stream.send(chunk)
        async for batch in generation.deltas():
            events = [event for event in map(view.delta_event, batch) if event is not None]
            if events:
                await stream.send_events(events)
    except APIError as e:
        await stream.send(e.to_dict())
        return await stream.done()
    # the usage chunk (if asked) goes out with [DONE]
    last = (sse_event({**view.chunk([]), "usage": usage(generation)}),) if view.include_usage else ()
    return await stream.done(last)
