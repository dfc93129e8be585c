"""Server-sent events exactly as OpenAI frames them: `data: {json}\n\n` per event, then `data: [DONE]\n\n`.

Plain per-token chunks are built from byte templates (`chunk_template`), which give the same bytes as
`sse_event` of the chunk dict: orjson writes compact JSON in insertion order.
"""

from __future__ import annotations

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"


def sse_event(obj) -> bytes:
    """One server-sent event: `data: {json}\n\n`."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk_template(head: dict) -> tuple[bytes, bytes]:
    """The bytes of a streamed chunk's event before and after its `choices` list (the per-token fast path).

    `head` is the chunk object with `choices` last but for `usage`; `prefix + b",".join(encoded choices) +
    suffix` is byte for byte `sse_event` of it with those choices.
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


def usage_suffix(usage: dict) -> bytes:
    """The end of a chunk template's event with the running usage (`continuous_usage_stats`)."""
    return b'],"usage":' + orjson.dumps(usage) + b"}\n\n"


class SSEStream:
    """One streamed response: the event-stream headers, events, then `[DONE]` with the end of the body."""

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

    async def done(self, last_events: tuple[bytes, ...] = ()) -> web.StreamResponse:
        """`last_events` (the usage chunk), `data: [DONE]` and the end of the body, in one write."""
        await self.response.write_eof(b"".join((*last_events, DONE)))
        return self.response
