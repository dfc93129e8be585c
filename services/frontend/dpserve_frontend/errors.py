"""Typed API errors and the one place that turns them into OpenAI error objects with an HTTP status."""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error shown to the client as `{"error": {"message", "type", "param", "code"}}`."""

    status = 500
    error_type = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class BadRequest(APIError):
    status = 400
    error_type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFound(APIError):
    status = 404
    error_type = "invalid_request_error"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class MethodNotAllowed(APIError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class RequestTimeout(APIError):
    """The client sent its body too slowly (--request-body-timeout)."""

    status = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class RequestTooLarge(APIError):
    """The body is over --max-request-body-bytes."""

    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


def request_too_large(max_bytes: int | None) -> RequestTooLarge:
    limit = f" ({max_bytes} bytes)" if max_bytes is not None else ""
    return RequestTooLarge(
        f"The request body is larger than this server accepts{limit}. Send a smaller request, or start the server "
        "with a larger --max-request-body-bytes."
    )


class UnsupportedMediaType(APIError):
    status = 415
    error_type = "invalid_request_error"


class ServiceUnavailable(APIError):
    status = 503
    error_type = "server_error"


class RetryLater(ServiceUnavailable):
    """503 with `Retry-After`: the request was refused (admission control, a drain) or given up in an engine's
    queue (--max-queue-time-s), and the same request may succeed later or on another server. `code` is the
    reason: queued_requests, queued_tokens, queue_time or shutting_down."""

    error_type = "server_overloaded"
    retry_after_s = 1

    def __init__(self, message: str, reason: str):
        super().__init__(message, code=reason)
        if reason == "shutting_down":
            self.error_type = "server_error"
        self.headers = {"Retry-After": str(self.retry_after_s)}


class EngineError(APIError):
    """An engine failed or went away while serving the request."""

    status = 500
    error_type = "server_error"


def error_response(error: APIError, headers: dict[str, str] | None = None) -> web.Response:
    headers = headers or getattr(error, "headers", None)  # RetryLater's Retry-After
    try:
        body = orjson.dumps(error.to_dict())
    except TypeError:  # a message quoting what the client sent, with a character JSON cannot carry (a lone surrogate)
        body = orjson.dumps({"error": {**error.to_dict()["error"], "message": ascii(error.message)}})
    return web.Response(body=body, status=error.status, content_type="application/json", headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every APIError (and every unexpected exception) leaves as an OpenAI error object."""
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPRequestEntityTooLarge:  # aiohttp's own cap (client_max_size = --max-request-body-bytes)
        return error_response(request_too_large(None))  # app.read_body names the limit; this is a safety net
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(_from_http_exception(request, e), headers=_allow_header(e))
    except ConnectionResetError:
        raise  # the client went away; nobody to answer
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(APIError("internal server error"))


def _from_http_exception(request: web.Request, e: web.HTTPException) -> APIError:
    """aiohttp's own errors (no route: 404, wrong method: 405, ...) as OpenAI error objects."""
    if isinstance(e, web.HTTPNotFound):
        return NotFound(f"Invalid URL ({request.method} {request.path})", code="unknown_url")
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path} (allowed: {allowed})")
    error = APIError(e.text if e.text and not e.text.startswith(f"{e.status}:") else (e.reason or "error"))
    error.status = e.status
    if e.status < 500:
        error.error_type = "invalid_request_error"
    return error


def _allow_header(e: web.HTTPException) -> dict[str, str] | None:
    allow = e.headers.get("Allow")
    return {"Allow": allow} if allow else None


# -- errors aiohttp's HTTP parser raises before the app sees a request ------------------------------------------


def parser_error(exc: BaseException | None, status: int, message: str | None) -> APIError | None:
    """What a request the HTTP parser refused gets, as an OpenAI error object: a request line over the parser's
    limit 414, a header 431 (aiohttp says 400 for both), any other malformed head its own 4xx. None for the 5xx
    aiohttp's handler gives a handler that failed (504, 500: the app's middleware has answered those it could)."""
    from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

    if not isinstance(exc, HttpProcessingError) or status >= 500:
        return None
    text = (message or getattr(exc, "message", "") or "malformed HTTP request").strip()
    error = APIError(f"The HTTP request could not be parsed: {text}")
    error.error_type = "invalid_request_error"
    error.status, error.code = status, "bad_http_request"
    if isinstance(exc, LineTooLong):  # args[0]: the first bytes of the URL, or of the header name or value
        line = exc.args[0] if exc.args else b""
        line = line.encode("latin-1", "replace") if isinstance(line, str) else bytes(line)
        is_request_line = line.startswith((b"/", b"*")) or b"://" in line[:16]
        error.status = 414 if is_request_line else 431
        error.code = "uri_too_long" if is_request_line else "request_header_fields_too_large"
    return error


class OpenAIErrorRequestHandler(web.RequestHandler):
    """aiohttp's per-connection handler, with the answer to an unparseable request as an OpenAI error object (its own
    is a plain-text 400: `Got more than 8190 bytes when reading ...`, `Invalid method encountered`). Its limits stay
    as they are; the connection is closed after the answer, as aiohttp does."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:  # fmt: skip
        error = parser_error(exc, status, message)
        if error is None or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        self.logger.debug("unparseable request from %s: %s", request.remote, exc)
        response = error_response(error)
        response.force_close()
        return response


class OpenAIErrorServer(web.Server):
    """web.Server whose connections run OpenAIErrorRequestHandler."""

    def __call__(self) -> OpenAIErrorRequestHandler:
        return OpenAIErrorRequestHandler(self, loop=self._loop, **self._kwargs)
