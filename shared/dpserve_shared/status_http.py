"""The status routes, served by every API server and by the coordinator's `--status-port` (aiohttp; only those
two services import this module, and both depend on aiohttp):

- `GET /status`: the page (static/status.html: plain HTML and one small script, nothing fetched from elsewhere);
- `GET /status.json[?history=1]`: the document of dpserve_shared.status (with the charts' history if asked);
- `GET /status/events`: the same document as server-sent events, every `EVENT_INTERVAL_S`, until the client
  leaves or the server stops.

All three are read-only. With an API key they need it, as `Authorization: Bearer KEY` or `?key=KEY` (a browser's
EventSource cannot send headers); the key is compared in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.resources
import logging
from collections.abc import AsyncIterator, Callable

import msgspec
from aiohttp import web

from dpserve_shared.status import SAMPLE_INTERVAL_S, StatusTracker

log = logging.getLogger(__name__)

EVENT_INTERVAL_S = 0.5  # SSE updates: a few a second at most
STATUS_PATHS = ("/status", "/status.json", "/status/events")

_PAGE = importlib.resources.files("dpserve_shared").joinpath("static/status.html").read_bytes()
_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; form-action 'self'",
}  # fmt: skip
_KEY_FORM = b"""<!doctype html><meta charset="utf-8"><title>dpserve status: API key</title>
<body style="font-family:sans-serif;margin:3em"><h1>dpserve status</h1><p>This server needs its API key.</p>
<form method="get" action="status"><input type="password" name="key" placeholder="API key" autofocus>
<button>Open</button></form></body>"""


class StatusRoutes:
    """The three routes over one tracker. `closing()` ends open event streams (an API server that drains)."""

    def __init__(
        self,
        tracker: StatusTracker,
        api_key: str | None = None,
        closing: Callable[[], bool] = lambda: False,
    ):
        self.tracker = tracker
        self._expected = api_key.encode() if api_key else None
        self._closing = closing
        self._encoder = msgspec.json.Encoder()

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/status", self.page)
        app.router.add_get("/status.json", self.document)
        app.router.add_get("/status/events", self.events)
        app.cleanup_ctx.append(self._sampling)

    async def _sampling(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(self._sample_forever(), name="status-sampling")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.tracker.sample()
            except Exception:  # a bad figure must not end the sampling
                log.exception("status sampling failed")
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def _authorized(self, request: web.Request) -> bool:
        if self._expected is None:
            return True
        given = request.query.get("key", "").encode("utf-8", "surrogateescape")
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            given = header[len("Bearer "):].encode("utf-8", "surrogateescape")  # non-UTF-8 bytes as sent
        return hmac.compare_digest(given, self._expected)

    @staticmethod
    def _unauthorized_json() -> web.Response:
        body = {"error": {"message": "Incorrect API key provided. Send it as 'Authorization: Bearer <key>' or "
                                     "'?key=<key>'.", "type": "invalid_request_error", "param": None,
                          "code": "invalid_api_key"}}  # fmt: skip
        return web.json_response(body, status=401, headers=_HEADERS)

    async def page(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.Response(body=_KEY_FORM, status=401, content_type="text/html", charset="utf-8",
                                headers=_HEADERS)  # fmt: skip
        return web.Response(body=_PAGE, content_type="text/html", charset="utf-8", headers=_HEADERS)

    async def document(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized_json()
        with_history = request.query.get("history", "") not in ("", "0", "false")
        body = self._encoder.encode(self.tracker.status(with_history=with_history))
        return web.Response(body=body, content_type="application/json", headers=_HEADERS)

    async def events(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return self._unauthorized_json()
        response = web.StreamResponse(headers={**_HEADERS, "Content-Type": "text/event-stream",
                                               "X-Accel-Buffering": "no"})  # fmt: skip
        await response.prepare(request)
        try:
            await response.write(b"retry: 2000\n\n")
            while not self._closing():
                data = self._encoder.encode(self.tracker.status())
                await response.write(b"data: " + data + b"\n\n")
                await asyncio.sleep(EVENT_INTERVAL_S)
        except ConnectionResetError:
            pass  # the client left
        return response
