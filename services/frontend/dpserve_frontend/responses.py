"""Answering with a generation: one JSON body at the end, or the deltas streamed as SSE; the `usage` object both
endpoints report."""

from __future__ import annotations

import orjson
from aiohttp import web

from dpserve_frontend.errors import APIError
from dpserve_frontend.generation import Generation
from dpserve_frontend.sse import SSEStream, sse_event


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
