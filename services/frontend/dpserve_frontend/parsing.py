"""Parsing what an HTTP request carries: its JSON body into a request Struct (`protocol.py`), and the pinned-rank
header.

Decoding checks the content type, JSON syntax and types. Unknown fields, at any depth, are ignored and named once
in the log, as vLLM does (SDKs and frameworks send vendor fields); with `strict=True` (`--strict-request-fields`)
they are a 400, as OpenAI answers. Every failure is a `BadRequest` (or 415) naming the parameter.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec
from aiohttp import web

from dpserve_frontend.errors import BadRequest, UnsupportedMediaType

log = logging.getLogger(__name__)

RANK_HEADER = "X-data-parallel-rank"


async def read_request(request: web.Request, struct: type, strict: bool) -> Any:
    """The request's JSON body as `struct` (the content type is checked before the body is read)."""
    if request.content_type != "application/json":
        raise UnsupportedMediaType(
            f"Unsupported Media Type: only 'application/json' is allowed, got {request.content_type!r}"
        )
    return decode_body(await request.read(), struct, strict=strict)


def pinned_rank(request: web.Request) -> int | None:
    """The rank the `X-data-parallel-rank` header pins the request to; None without one."""
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


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")
_PATH_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")
_MAX_IGNORED_FIELDS = 64
_reported_ignored: set[tuple[str, ...]] = set()


def decode_body(body: bytes, struct: type, strict: bool = False) -> Any:
    """JSON bytes -> a request Struct, or BadRequest with OpenAI's wording and the offending parameter.
    Unknown fields are dropped (logged once per set of names) unless `strict`."""
    if not body.strip():
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=struct)
    except msgspec.ValidationError as e:
        if strict or not _UNKNOWN.match(str(e)):
            raise _bad_request(e) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"We could not parse the JSON body of your request: {e}") from None
    except RecursionError:
        raise _too_deep() from None
    try:  # the typed decode stopped at an unknown field: what follows it may be malformed or too deep
        return _decode_ignoring_unknown(body, struct)
    except msgspec.DecodeError as e:
        raise BadRequest(f"We could not parse the JSON body of your request: {e}") from None
    except RecursionError:
        raise _too_deep() from None


def _too_deep() -> BadRequest:
    """msgspec stops at Python's recursion limit (about 1,000 levels) with a RecursionError, after reading no more
    than that many bytes: refusing 100,000 nested '[' costs microseconds."""
    return BadRequest("We could not parse the JSON body of your request: it is nested too deeply",
                      code="json_too_deep")


def _decode_ignoring_unknown(body: bytes, struct: type) -> Any:
    """The slow path, for a body with unknown fields: drop each one where msgspec finds it, and decode again."""
    data = msgspec.json.decode(body)
    ignored: list[str] = []
    while True:
        try:
            result = msgspec.convert(data, struct)
            break
        except msgspec.ValidationError as e:
            text = str(e)
            unknown = _UNKNOWN.match(text)
            container = _at_path(data, _param(text)) if unknown else None
            if not isinstance(container, dict) or len(ignored) >= _MAX_IGNORED_FIELDS:
                raise _bad_request(e) from None
            field = unknown.group(1)
            container.pop(field, None)
            at = _param(text)
            ignored.append(f"{at}.{field}" if at else field)
    names = tuple(sorted(ignored))
    if names not in _reported_ignored:
        _reported_ignored.add(names)
        log.warning("ignored request fields this server does not know: %s (logged once for this set; "
                    "--strict-request-fields makes them a 400)", ", ".join(names))
    return result


def _param(text: str) -> str | None:
    """The parameter at a msgspec error path: `messages[0].content`; a map's value (`metadata[...]`, msgspec does
    not say which key) is named by its map (`metadata`)."""
    match = _PATH.search(text)
    return match.group(1).replace("[...]", "") if match else None


def _at_path(data: Any, path: str | None) -> Any:
    """The value at a msgspec error path such as `messages[0].content` (the whole body for None)."""
    for name, index in _PATH_PART.findall(path or ""):
        try:
            data = data[int(index)] if index else data[name]
        except (KeyError, IndexError, TypeError):
            return None
    return data


def _bad_request(e: msgspec.ValidationError) -> BadRequest:
    text = str(e)
    param = _param(text)
    unknown = _UNKNOWN.match(text)
    if unknown:
        field = unknown.group(1)
        at = f"{param}." if param else ""
        return BadRequest(f"Unrecognized request argument supplied: {at}{field}", param=f"{at}{field}")
    if "missing required field" in text:
        missing = re.search(r"missing required field `([^`]*)`", text)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
            return BadRequest(f"Missing required parameter: '{param}'", param=param)
    if text.startswith("Expected `object`") and param is None:
        return BadRequest("the request body must be a JSON object")
    if not param:
        return BadRequest(f"invalid request: {text}")
    detail = _PATH.sub("", text).rstrip(" -")
    return BadRequest(f"Invalid value for '{param}': {detail}", param=param)


SESSION_HEADER = "X-Session-Id"
_MAX_SESSION_ID_LEN = 256


def session_id(request: web.Request) -> str | None:
    """The conversation the opt-in `X-Session-Id` header names (its requests stay on one rank until it
    saturates: router.py); None without one."""
    value = request.headers.get(SESSION_HEADER, "").strip()
    if not value:
        return None
    if len(value) > _MAX_SESSION_ID_LEN:
        raise BadRequest(f"{SESSION_HEADER} is longer than {_MAX_SESSION_ID_LEN} characters", param=SESSION_HEADER)
    return value
