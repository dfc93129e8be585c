"""OpenAI request bodies as msgspec Structs, and their validation. Pure: no I/O.

Decoding checks JSON syntax and types (vLLM's extensions such as `top_k`, `min_p`, `ignore_eos` are known
here). Unknown fields, at any depth, are ignored and named once in the log, as vLLM does (SDKs and frameworks send
vendor fields); with `strict=True` (`--strict-request-fields`) they are a 400, as OpenAI answers. `check_*`
functions then check values and ranges. Every failure is a `BadRequest` naming the parameter, raised before
anything reaches an engine.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any

import msgspec

from dpserve_frontend.errors import BadRequest

log = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
MAX_N = 128

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]


class _Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(_Request):
    """Parameters both endpoints share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    request_id: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]: checked by `prompt_inputs`
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ContentPart(msgspec.Struct):
    """One part of a message's content; fields other than `type` and `text` are tolerated."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    """A chat message; extra fields (e.g. `tool_calls: []`, `refusal`) are tolerated."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None  # accepted; the model has no reasoning mode
    modalities: list[str] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    tokens: list[int]
    model: str | None = None


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
    return _decode_ignoring_unknown(body, struct)


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
    match = _PATH.search(text)
    return match.group(1) if match else None


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
    if text.startswith("Expected `object`") and param is None:
        return BadRequest("the request body must be a JSON object")
    return BadRequest(f"invalid request: {text}", param=param or None)


# ------------------------------------------------------------------------------------------------------------
# Value checks shared by both endpoints
# ------------------------------------------------------------------------------------------------------------


def _check_range(value, name: str, low=None, high=None, low_open=False) -> None:
    if value is None:
        return
    if low is not None and (value < low or (low_open and value == low)):
        op = ">" if low_open else ">="
        raise BadRequest(f"{name} must be {op} {low}, got {value}", param=name)
    if high is not None and value > high:
        raise BadRequest(f"{name} must be <= {high}, got {value}", param=name)


def check_sampling_fields(req: _SamplingFields, vocab_size: int) -> None:
    _check_range(req.temperature, "temperature", 0.0, 2.0)
    _check_range(req.top_p, "top_p", 0.0, 1.0, low_open=True)
    _check_range(req.min_p, "min_p", 0.0, 1.0)
    if req.top_k is not None and req.top_k < -1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 0, got {req.top_k}", param="top_k")
    _check_range(req.n, "n", 1, MAX_N)
    _check_range(req.min_tokens, "min_tokens", 0)
    _check_range(req.prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        _check_range(value, name, -2.0, 2.0)
        if value:
            raise BadRequest(f"{name} is not supported by this server; send 0 or leave it out", param=name)
    if req.repetition_penalty not in (None, 1.0):
        raise BadRequest("repetition_penalty is not supported by this server; send 1.0 or leave it out",
                         param="repetition_penalty")
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported by this server", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed when stream is true", param="stream_options")
    for token_id in req.stop_token_ids or ():
        check_token_id(token_id, vocab_size, "stop_token_ids")


def check_token_id(token_id: int, vocab_size: int, param: str) -> None:
    if not 0 <= token_id < vocab_size:
        raise BadRequest(f"token id {token_id} is out of vocabulary (vocab size {vocab_size})", param=param)


def check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise BadRequest(f"{param} must be at least 1, got {value}", param=param)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    return [s for s in items if s]


def prompt_inputs(prompt: Any) -> list[str | list[int]]:
    """`prompt` as a list of texts or token-id lists (OpenAI allows str, [str], [int], [[int]])."""
    error = BadRequest(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        param="prompt",
    )
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            items = list(prompt)
        elif all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            items = [prompt]
        elif all(isinstance(p, list) for p in prompt):
            items = prompt
            for ids in items:
                if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise error
        else:
            raise error
    elif prompt is None:
        raise BadRequest("prompt is required", param="prompt")
    else:
        raise error
    return items


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: content flattened to text."""
    if not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text":
                    raise BadRequest(
                        f"messages[{i}]: content part type {part.type!r} is not supported (only 'text')",
                        param=f"messages[{i}].content",
                    )
                if part.text is None:
                    raise BadRequest(f"messages[{i}]: a text content part needs 'text'",
                                     param=f"messages[{i}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        item: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
        if message.name is not None:
            item["name"] = message.name
        out.append(item)
    return out
