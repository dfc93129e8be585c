"""OpenAI request bodies as msgspec Structs, and their validation. Pure: no I/O.

The Structs give the types (vLLM's extensions such as `top_k`, `min_p`, `ignore_eos` are known here);
`parsing.py` decodes bodies into them. The `check_*` functions then check values and ranges, and
`check_output_fits` the output length against the context. Every failure is a `BadRequest` naming the
parameter, raised before anything reaches an engine. Where the two generation endpoints differ in what they ask
of the engine, their request types say it (`requested_max_tokens`, `engine_logprobs`, ...), so that one builder
(`spec.build_spec`) serves both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from dpserve_shared.timing import MAX_LOGPROBS  # noqa: F401 - re-exported for the handlers

from dpserve_frontend.errors import BadRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]


class _Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# OpenAI's rule for the names of response formats and functions
Name = Annotated[str, msgspec.Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]


class JsonSchemaFormat(_Request):
    name: Name
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # the schema is enforced either way (as vLLM does)


class ResponseFormat(_Request):
    type: str  # text, json_object or json_schema (structured.py)
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: one constraint (json, regex, choice, grammar or json_object) and how its JSON
    may be spaced."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None  # vLLM's; not supported: a 400, never dropped (the output would be unconstrained)
    disable_any_whitespace: bool | None = None  # None: the server's --structured-output-whitespace
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # vLLM's: no other backend to fall back to here


class SamplingFields(_Request):
    """Parameters both endpoints share (OpenAI's plus vLLM's extensions)."""

    # Not fields (no annotation): how the endpoint names its prompt, and its max_tokens when none is given (None:
    # what fits).
    prompt_param = "prompt"
    default_max_tokens = None

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
    top_k: Int64 | None = None  # the engine clamps it to the vocabulary; bounded so that it fits the wire
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
    # structured outputs (structured.py): OpenAI's response_format, vLLM's structured_outputs and its older aliases
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: llguidance is the only backend

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output length asked for, and the parameter that asked."""
        return self.max_tokens, "max_tokens"

    def engine_logprobs(self) -> int | None:
        """`SamplingParams.logprobs`: how many top alternatives per sampled token, None for no logprobs."""
        raise NotImplementedError

    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


class CompletionRequest(SamplingFields):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]]: checked by `prompt_inputs`
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    default_max_tokens = 16  # OpenAI's default for completions

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs  # echo shows the prompt's logprobs too
        return self.prompt_logprobs


class ContentPart(msgspec.Struct):
    """One part of a message's content; fields other than `type` and `text` are tolerated."""

    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON, as the server returned it


class ToolCall(msgspec.Struct):
    """A call in an assistant message's `tool_calls`; extra fields are tolerated."""

    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct):
    """A chat message; extra fields (e.g. `refusal`) are tolerated."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's ("role": "tool")


class FunctionDefinition(_Request):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: the function takes no arguments
    strict: bool | None = None  # the parameters are enforced either way


class Tool(_Request):
    function: FunctionDefinition
    type: str = "function"


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    function: ToolChoiceFunction
    type: str = "function"


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # tools.py
    parallel_tool_calls: bool | None = None  # None: true
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

    prompt_param = "messages"

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # rendered as chat completions render them, so that the counts agree
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    tokens: list[int]
    model: str | None = None


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


def check_sampling_fields(req: SamplingFields, vocab_size: int) -> None:
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


def check_completion_request(req: CompletionRequest, vocab_size: int) -> None:
    """Values of a completions request, before its prompt is read (`prompt_inputs`)."""
    check_sampling_fields(req, vocab_size)
    check_max_tokens(req.max_tokens, "max_tokens")
    if req.best_of not in (None, 1):
        raise BadRequest("best_of is only supported as 1 or null", param="best_of")
    if req.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}", param="logprobs")


def check_chat_request(req: ChatCompletionRequest, vocab_size: int) -> None:
    """Values of a chat request, before its messages are rendered; unsupported features are a 400."""
    check_sampling_fields(req, vocab_size)
    check_max_tokens(req.max_tokens, "max_tokens")
    check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                             param="top_logprobs")
        if not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(req, name):
            raise BadRequest(f"{name} is not supported by this server", param=name)
    if req.functions:
        raise BadRequest("functions (deprecated by OpenAI) is not supported by this server; use tools",
                         param="functions")
    if req.function_call not in (None, "none", "auto"):
        raise BadRequest("function_call (deprecated by OpenAI) is not supported by this server; use tool_choice",
                         param="function_call")
    if req.modalities not in (None, [], ["text"]):
        raise BadRequest("only the 'text' modality is supported", param="modalities")


def check_output_fits(req: SamplingFields, prompt_len: int, max_model_len: int) -> int:
    """The request's max_tokens for a prompt of `prompt_len` tokens. vLLM's rule: an explicit max_tokens that
    does not fit is an error; a default is clamped to what fits. min_tokens must not exceed it."""
    requested, param = req.requested_max_tokens()
    if prompt_len >= max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input.",
            param=req.prompt_param,
        )
    room = max_model_len - prompt_len
    if requested is None:
        default = req.default_max_tokens
        max_tokens = room if default is None else min(default, room)
    elif requested > room:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the input, {requested} in the completion). "
            "Please reduce the length of the input or completion.",
            param=param,
        )
    else:
        max_tokens = requested
    if req.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    return max_tokens


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
    """Messages as the chat template sees them: content flattened to text; an assistant's tool calls with their
    arguments decoded (Hugging Face templates write them with `tojson`), a tool result's `tool_call_id`."""
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
        if message.tool_calls:
            item["tool_calls"] = [_tool_call_dict(call, f"messages[{i}].tool_calls[{j}]")
                                  for j, call in enumerate(message.tool_calls)]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def _tool_call_dict(call: ToolCall, param: str) -> dict[str, Any]:
    try:
        arguments = msgspec.json.decode(call.function.arguments)
    except (msgspec.DecodeError, RecursionError):
        raise BadRequest(f"{param}.function.arguments must be JSON (the arguments as the server returned them)",
                         param=f"{param}.function.arguments") from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}
