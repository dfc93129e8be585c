"""Pieces every endpoint uses: reading JSON bodies, SSE framing, usage, max_tokens, the pinned rank header."""

from __future__ import annotations

import math

import orjson
from aiohttp import web

from dpserve_frontend.errors import APIError, BadRequest, UnsupportedMediaType
from dpserve_frontend.generation import Generation
from dpserve_frontend.protocol import decode_body

RANK_HEADER = "X-data-parallel-rank"
MIN_LOGPROB = -9999.0  # JSON has no -inf


STRICT_FIELDS_KEY = web.AppKey("strict_request_fields", bool)


async def read_request(request: web.Request, struct: type):
    if request.content_type != "application/json":
        raise UnsupportedMediaType(
            f"Unsupported Media Type: only 'application/json' is allowed, got {request.content_type!r}"
        )
    return decode_body(await request.read(), struct, strict=request.app.get(STRICT_FIELDS_KEY, False))


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def pinned_rank(request: web.Request) -> int | None:
    value = request.headers.get(RANK_HEADER)
    if value is None or value.strip() == "":
        return None
    try:
        rank = int(value)
    except ValueError:
        raise BadRequest(f"{RANK_HEADER} must be an integer rank, got {value!r}", param=RANK_HEADER) from None
    if rank < 0:
        raise BadRequest(f"{RANK_HEADER} must be >= 0, got {rank}", param=RANK_HEADER)
    return rank


def resolve_max_tokens(requested: int | None, default: int | None, prompt_len: int, max_model_len: int,
                       param: str, prompt_param: str) -> int:
    """vLLM's rule: an explicit max_tokens that does not fit is an error; a default is clamped to what fits."""
    if prompt_len >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input.",
            param=prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the input, {requested} in the completion). "
            "Please reduce the length of the input or completion.",
            param=param,
        )
    return requested


def usage(generation: Generation) -> dict:
    prompt = generation.num_prompt_tokens
    completion = generation.num_completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": generation.num_cached_tokens},
    }


def sse_event(obj) -> bytes:
    """One server-sent event: `data: {json}\n\n`."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk_template(head: dict) -> tuple[bytes, bytes]:
    """The bytes of a streamed chunk's event before and after its `choices` list (the per-token fast path).

    `head` is the chunk object with `choices` last but for `usage`; `prefix + b",".join(encoded choices) +
    suffix` is byte for byte `sse_event` of it with those choices: orjson writes compact JSON in insertion order.
    """
    keys = list(head)
    if keys[-1] == "usage":
        keys.pop()
    if keys[-1] != "choices":
        raise ValueError("a chunk template needs `choices` last (before `usage`)")
    fields = {k: head[k] for k in keys[:-1]}
    prefix = b"data: " + orjson.dumps(fields)[:-1] + b',"choices":['
    usage = b',"usage":' + orjson.dumps(head["usage"]) if "usage" in head else b""
    return prefix, b"]" + usage + b"}\n\n"


def usage_suffix(generation: Generation) -> bytes:
    """The end of a chunk template's event with the running usage (`continuous_usage_stats`)."""
    return b'],"usage":' + orjson.dumps(usage(generation)) + b"}\n\n"


def clean_logprob(value: float) -> float:
    if math.isnan(value):
        return MIN_LOGPROB
    return max(value, MIN_LOGPROB)


class SSEStream:
    """Server-sent events exactly as OpenAI frames them: `data: {json}\\n\\n`, then `data: [DONE]\\n\\n`."""

    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"},
        )

    async def prepare(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, obj) -> None:
        await self.response.write(sse_event(obj))

    async def send_events(self, events: list[bytes]) -> None:
        """Several encoded events (one engine step's deltas) in one write."""
        await self.response.write(events[0] if len(events) == 1 else b"".join(events))

    async def send_error(self, error: APIError) -> None:
        await self.send(error.to_dict())

    async def done(self, last_events: tuple[bytes, ...] = ()) -> web.StreamResponse:
        """`last_events` (the usage chunk), `data: [DONE]` and the end of the body, in one write."""
        await self.response.write_eof(b"".join((*last_events, b"data: [DONE]\n\n")))
        return self.response


async def respond(
    request: web.Request, generation: Generation, view, is_stream: bool, leading: tuple[dict, ...] = ()
) -> web.StreamResponse:
    """Run a started generation and answer with `view`'s JSON body, or stream it as SSE.

    `view` is the endpoint's response builder: `final()`, `delta_event(delta) -> bytes | None`, `chunk(choices)`
    and `include_usage`. `leading` chunks (chat's role chunks) go out before the first delta.
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
        await stream.send_error(e)
        return await stream.done()
    # the usage chunk (if asked) goes out with [DONE]
    last = (sse_event({**view.chunk([]), "usage": usage(generation)}),) if view.include_usage else ()
    return await stream.done(last)
