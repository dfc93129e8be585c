"""The aiohttp application: routes, middlewares, and the background work opened in cleanup contexts."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from dpserve_shared.schema import ModelInfo
from dpserve_shared.status import StatusInputs, StatusTracker, counter_delta
from dpserve_shared.status_http import StatusRoutes

from dpserve_frontend import api_admin, api_chat, api_completions, api_misc
from dpserve_frontend.coordinator_client import CoordinatorClient
from dpserve_frontend.errors import (
    APIError,
    BadRequest,
    RequestTimeout,
    Unauthorized,
    UnsupportedMediaType,
    error_middleware,
    error_response,
    request_too_large,
)
from dpserve_frontend.settings import FrontendSettings
from dpserve_frontend.state import FrontendState

log = logging.getLogger(__name__)

STATE_KEY = web.AppKey("state", FrontendState)
COORDINATOR_KEY = web.AppKey("coordinator", CoordinatorClient)
LINGER_S = 2.0  # see server_options

Handler = Callable[[web.Request, FrontendState], Awaitable[web.StreamResponse]]


def _bind(handler: Handler):
    async def handle(request: web.Request) -> web.StreamResponse:
        return await handler(request, request.app[STATE_KEY])

    return handle


@web.middleware
async def count_requests(request: web.Request, handler):
    """Frontend counters by endpoint and status; tracks in-flight requests for the drain on SIGTERM."""
    state = request.app[STATE_KEY]
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "other"
    state.num_http_in_flight += 1
    status = 499  # the client went away before an answer
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        state.num_http_in_flight -= 1
        state.metrics.count_http(endpoint, status)


def _auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        guarded = request.path.startswith("/v1/") or request.path in api_admin.ADMIN_PATHS
        if guarded and request.method != "OPTIONS":
            # surrogateescape: aiohttp keeps a header's non-UTF-8 bytes as lone surrogates; compare the bytes sent
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                raise Unauthorized("Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.")
        return await handler(request)

    return check_api_key


def _read_body_middleware(max_bytes: int, timeout_s: float):
    """Reads every request body before its handler (and after the API key check), within --max-request-body-bytes
    and --request-body-timeout: no handler waits on a slow or endless body, and none sees one over the limit.
    aiohttp keeps the bytes; the handler's `request.read()` returns them."""

    @web.middleware
    async def read_body(request: web.Request, handler):
        if request.body_exists and request.match_info.http_exception is None:
            try:
                await _read_bounded(request, max_bytes, timeout_s)
            except APIError as e:
                # The body may be partly unread: this connection carries no further request.
                response = error_response(e)
                response.force_close()
                return response
        return await handler(request)

    return read_body


async def _read_bounded(request: web.Request, max_bytes: int, timeout_s: float) -> None:
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # server_options: aiohttp does not decompress (no decompression bombs)
        raise UnsupportedMediaType(f"Content-Encoding {encoding!r} is not supported; send the body uncompressed",
                                   param="Content-Encoding", code="unsupported_content_encoding")
    if request.content_length is not None and request.content_length > max_bytes:
        raise request_too_large(max_bytes)  # before reading a byte of it
    try:
        async with asyncio.timeout(timeout_s):
            await request.read()  # a chunked body that grows past client_max_size (= max_bytes) raises
    except TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive within {timeout_s:g} s; send it faster, or start the server with a "
            "larger --request-body-timeout."
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise request_too_large(max_bytes) from None
    except web.RequestPayloadError as e:  # broken chunked framing, a body cut short of its Content-Length
        raise BadRequest(f"The request body could not be read: {e}") from None


def server_options(settings: FrontendSettings) -> dict:
    """aiohttp's per-connection options (AppRunner / TestServer keyword arguments).

    aiohttp has no timeout of its own for reading a request head. Its keep-alive timer is one: armed when a
    connection opens and after each response, it closes the connection if by then the handler is still waiting for
    a complete request head, whether none came (idle) or one is trickling in (slowloris); it does nothing while a
    handler runs. So `keepalive_timeout` = --request-header-timeout bounds both. The body has its own timeout
    (`_read_body_middleware`).

    After an answer given before the body was read (a 408, a 413, a 401), aiohttp reads and drops the rest of the
    body for up to `lingering_time` before it closes, so that the client sees the answer rather than a reset; its
    10 s default would let each slow client hold its connection 10 s past --request-body-timeout.

    Compressed request bodies are refused (415), not decompressed: OpenAI clients do not compress requests, and
    aiohttp's own answer to an encoding it cannot decode is a plain-text 400 before the app sees the request."""
    return {"keepalive_timeout": settings.request_header_timeout_s, "auto_decompress": False,
            "lingering_time": LINGER_S}


async def _coordinator_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    settings = state.settings
    if settings.coordinator_addr is None:
        yield
        return
    client = CoordinatorClient(settings, state.apply_topology, state.apply_snapshot, stats=state.frontend_stats,
                               prefix_index=state.pool.prefix_index, routed=state.pool)  # fmt: skip
    state.pool.on_start_wave = client.request_start_wave
    state.pool.is_coordinator_away = client.is_away
    app[COORDINATOR_KEY] = client
    try:
        await client.register()
    except BaseException:
        await client.close("registration failed")
        raise
    client.start()
    yield
    await client.close()


async def _engines_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[STATE_KEY].pool.close()


async def _grammars_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    app[STATE_KEY].grammars.close()  # its threads: a compile still running finishes on its own


async def _stats_log_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    interval_s = state.settings.stats_interval_s
    task = asyncio.get_running_loop().create_task(_log_stats(state, interval_s)) if interval_s > 0 else None
    yield
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _log_stats(state: FrontendState, interval_s: float) -> None:
    """vLLM-style periodic line per rank: throughput, running, waiting, KV use, prefix hit rate."""
    previous: dict[int, tuple[float, object]] = {}
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        for rank, load in sorted(state.engine_loads.items()):
            before = previous.get(rank)
            previous[rank] = (now, load)
            if before is None:
                continue
            then, old = before
            dt = max(now - then, 1e-6)
            prompt_tps = counter_delta(load.prompt_tokens, old.prompt_tokens) / dt  # (a replaced rank starts at 0)
            gen_tps = counter_delta(load.generation_tokens, old.generation_tokens) / dt
            queries = counter_delta(load.prefix_queries, old.prefix_queries)
            hits = counter_delta(load.prefix_hits, old.prefix_hits)
            hit_rate = 100.0 * hits / queries if queries > 0 else 0.0
            if not (prompt_tps or gen_tps or load.num_running or load.num_waiting):
                continue
            kv = 100.0 * load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0
            log.info(
                "engine %d: prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d, "
                "waiting %d, KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
                rank, prompt_tps, gen_tps, load.num_running, load.num_waiting, kv, hit_rate,
            )


def init_app(settings: FrontendSettings, model_info: ModelInfo | None = None) -> web.Application:
    """The frontend app. Without `settings.coordinator_addr` it talks to no coordinator (tests give
    `model_info` and feed topologies to the state directly)."""
    middlewares = [count_requests, error_middleware]
    if settings.api_key:
        middlewares.append(_auth_middleware(settings.api_key))
    middlewares.append(_read_body_middleware(settings.max_request_body_bytes, settings.request_body_timeout_s))
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_request_body_bytes)
    app[STATE_KEY] = FrontendState(settings, model_info)
    app.cleanup_ctx.append(_coordinator_ctx)
    app.cleanup_ctx.append(_engines_ctx)  # closed before the coordinator link: aborts go out, then Unregister
    app.cleanup_ctx.append(_stats_log_ctx)
    app.cleanup_ctx.append(_grammars_ctx)
    app.router.add_post("/v1/completions", _bind(api_completions.create_completion))
    app.router.add_post("/v1/chat/completions", _bind(api_chat.create_chat_completion))
    app.router.add_get("/v1/models", _bind(api_misc.list_models))
    app.router.add_get("/health", _bind(api_misc.health))
    app.router.add_get("/ping", _bind(api_misc.ping))  # vLLM's (SageMaker's) liveness probe
    app.router.add_post("/ping", _bind(api_misc.ping))
    app.router.add_get("/load", _bind(api_misc.load))
    app.router.add_post("/tokenize", _bind(api_misc.tokenize))
    app.router.add_post("/detokenize", _bind(api_misc.detokenize))
    app.router.add_get("/version", _bind(api_misc.version))
    app.router.add_get("/metrics", _bind(api_misc.metrics))
    app.router.add_post("/scale_elastic_ep", _bind(api_admin.scale_elastic_ep))
    app.router.add_post("/is_scaling_elastic_ep", _bind(api_admin.is_scaling_elastic_ep))
    _status_routes(app).add_to(app)
    return app


def _status_routes(app: web.Application) -> StatusRoutes:
    """/status, /status.json, /status/events: the coordinator's view as this API server last heard it."""
    state = app[STATE_KEY]

    def read() -> StatusInputs:
        snapshot = state.snapshot
        client = app.get(COORDINATOR_KEY)
        heard = None if client is None or client.last_heard_s is None else time.monotonic() - client.last_heard_s
        return StatusInputs(
            topology=state.pool.topology,
            loads=state.engine_loads,
            wave=snapshot.wave if snapshot is not None else 0,
            engines_running=snapshot.engines_running if snapshot is not None else False,
            frontends=list(snapshot.frontends) if snapshot is not None else [state.frontend_stats()],
            coordinator_last_heard_s=heard,
        )

    tracker = StatusTracker(f"api-server {state.settings.frontend_id}", read)
    return StatusRoutes(tracker, state.settings.api_key, closing=lambda: state.is_draining)
