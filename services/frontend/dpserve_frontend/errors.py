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
    return web.Response(
        body=orjson.dumps(error.to_dict()), status=error.status, content_type="application/json", headers=headers
    )


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every APIError (and every unexpected exception) leaves as an OpenAI error object."""
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = APIError(e.text if e.text and not e.text.startswith(f"{e.status}:") else (e.reason or "error"))
        error.status = e.status
        if e.status < 500:
            error.error_type = "invalid_request_error"
        return error_response(error)
    except ConnectionResetError:
        raise  # the client went away; nobody to answer
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(APIError("internal server error"))
