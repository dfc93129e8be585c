"""Structured outputs, the frontend's part: a request's constraint as one llguidance grammar, checked against the
model's tokenizer before the request is routed.

The engine holds what changes with every token (a matcher per sequence: dpserve_engine/grammar.py); the frontend
does what needs no per-token state. `request_constraint` turns OpenAI's `response_format`, vLLM's
`structured_outputs` or its older `guided_*` fields into a `Constraint` (pure; tools.py builds tool calling's).
`GrammarChecker.grammar` then compiles it against the served model's tokenizer on a thread, within a size and a
time limit. Whatever llguidance cannot serve (an invalid type, a dangling `$ref`, a keyword it does not implement:
it names it) is a 400 naming the request field: no grammar reaches an engine unchecked, and no request is served
unconstrained instead.

JSON is compact by default (no whitespace between its tokens): a small model given the choice can pad an object
with newlines until max_tokens. --structured-output-whitespace flexible allows it, and so does a request's
`structured_outputs.disable_any_whitespace: false` (vLLM's field; true asks for compact).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
from typing import Any

import llguidance
import msgspec
from llguidance import LLMatcher

from dpserve_shared.schema import ModelInfo

from dpserve_frontend.errors import BadRequest
from dpserve_frontend.protocol import ResponseFormat, SamplingFields, StructuredOutputs

CHECKED_CACHE_SIZE = 256  # grammars whose check is remembered (a digest and the error, if any, each)
CHECK_THREADS = 2  # compiles take ~1 ms (llguidance's fuel limits bound them); the event loop keeps its core


@dataclasses.dataclass(frozen=True)
class JsonOptions:
    """How JSON under a grammar may be spaced."""

    is_whitespace_flexible: bool = False
    whitespace_pattern: str | None = None  # a regex for the whitespace allowed between JSON tokens

    def compile_options(self) -> dict[str, Any]:
        """llguidance's JSON options. They override a schema's own `x-guidance` options, so that a schema cannot
        ask llguidance to ignore what it does not implement (`lenient`) or to weaken oneOf to anyOf."""
        options: dict[str, Any] = {"whitespace_flexible": self.is_whitespace_flexible, "lenient": False,
                                   "coerce_one_of": False}
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        return options


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One request's constraint on its output."""

    grammar: str  # llguidance's grammar (SamplingParams.grammar)
    param: str  # the request field it came from: a 400 about it names that field
    parts: tuple[Constraint, ...] = ()  # compiled one by one when the whole fails, to name the part at fault


def json_options(req: SamplingFields, is_whitespace_flexible: bool) -> JsonOptions:
    """The request's JSON spacing: the server's default unless structured_outputs or guided_whitespace_pattern
    says otherwise."""
    pattern = req.guided_whitespace_pattern
    so = req.structured_outputs
    if so is not None:
        if so.whitespace_pattern is not None:
            if so.disable_any_whitespace:
                raise BadRequest("structured_outputs: whitespace_pattern and disable_any_whitespace contradict each "
                                 "other; give one", param="structured_outputs.whitespace_pattern")
            pattern = so.whitespace_pattern
        if so.disable_any_whitespace is not None:
            is_whitespace_flexible = not so.disable_any_whitespace
    return JsonOptions(is_whitespace_flexible, pattern)


def has_constraint_fields(req: SamplingFields) -> bool:
    """Whether the request sets a field that may constrain its output (then `request_constraint` has work to do)."""
    return (req.response_format is not None or req.structured_outputs is not None or req.guided_json is not None
            or req.guided_regex is not None or req.guided_choice is not None or req.guided_grammar is not None)


def request_constraint(req: SamplingFields, options: JsonOptions) -> Constraint | None:
    """The constraint that response_format, structured_outputs or a guided_* field asks for (None: none does);
    BadRequest for more than one, or for one this server does not support."""
    so = req.structured_outputs or StructuredOutputs()
    if so.structural_tag is not None:
        raise BadRequest("structured_outputs.structural_tag is not supported by this server; use json, regex, "
                         "choice or grammar", param="structured_outputs.structural_tag")
    close = so.disable_additional_properties  # for every JSON Schema of the request
    found = [
        constraint for constraint in (
            _response_format(req.response_format, options, close),
            _schema(so.json, "structured_outputs.json", options, close),
            _regex(so.regex, "structured_outputs.regex"),
            _choice(so.choice, "structured_outputs.choice"),
            _grammar(so.grammar, "structured_outputs.grammar"),
            _schema({"type": "object"} if so.json_object else None, "structured_outputs.json_object", options, close),
            _schema(req.guided_json, "guided_json", options, close),
            _regex(req.guided_regex, "guided_regex"),
            _choice(req.guided_choice, "guided_choice"),
            _grammar(req.guided_grammar, "guided_grammar"),
        ) if constraint is not None
    ]  # fmt: skip
    if len(found) > 1:
        raise BadRequest(f"give one structured-output constraint: {found[0].param} and {found[1].param} both "
                         "constrain the output", param=found[1].param)
    return found[0] if found else None


def json_schema_grammar(schema: dict[str, Any], param: str, options: JsonOptions) -> Constraint:
    return _converted(param, LLMatcher.grammar_from_json_schema, schema, overrides=options.compile_options())


def _converted(param: str, convert, *args, **kwargs) -> Constraint:
    """A constraint from one of llguidance's converters; what they cannot take (a GBNF grammar that does not
    convert, an integer too large for its JSON) is a 400."""
    try:
        return Constraint(convert(*args, **kwargs), param)
    except ValueError as e:
        raise BadRequest(f"{param} cannot be used as a constraint: {e}", param=param) from None
    except BaseException as e:
        if not _is_panic(e):
            raise
        raise BadRequest(f"{param} cannot be used as a constraint: llguidance failed on it ({e})",
                         param=param) from None


def _is_panic(error: BaseException) -> bool:
    """llguidance's Rust panics reach Python as pyo3's PanicException, a BaseException: on input it cannot take
    they are the request's fault (a 400), never a reason to drop the connection."""
    return type(error).__name__ == "PanicException"


def _response_format(fmt: ResponseFormat | None, options: JsonOptions, close: bool) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_grammar({"type": "object"}, "response_format", options)
    if fmt.type != "json_schema":
        raise BadRequest(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {fmt.type!r}",
                         param="response_format.type")
    if fmt.json_schema is None:
        raise BadRequest("response_format of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': ...}",
                         param="response_format.json_schema")
    if fmt.json_schema.schema is None:
        raise BadRequest("response_format.json_schema needs a 'schema' (a JSON Schema object)",
                         param="response_format.json_schema.schema")
    schema = fmt.json_schema.schema
    return json_schema_grammar(closed_objects(schema) if close else schema, "response_format.json_schema.schema",
                               options)


def _schema(schema: dict[str, Any] | str | None, param: str, options: JsonOptions, close: bool) -> Constraint | None:
    """A JSON Schema given as an object or as its JSON text (vLLM accepts both)."""
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except (msgspec.DecodeError, RecursionError):
            raise BadRequest(f"{param} must be a JSON Schema (an object, or its JSON text)", param=param) from None
        if not isinstance(schema, dict):
            raise BadRequest(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param=param)
    return json_schema_grammar(closed_objects(schema) if close else schema, param, options)


def _regex(regex: str | None, param: str) -> Constraint | None:
    return None if regex is None else _converted(param, LLMatcher.grammar_from_regex, regex)


def _choice(choices: list[str] | None, param: str) -> Constraint | None:
    if choices is None:
        return None
    if not choices:
        raise BadRequest(f"{param} must list at least one string", param=param)
    return _converted(param, llguidance.grammar_from, "choice", choices)


def _grammar(text: str | None, param: str) -> Constraint | None:
    """A Lark grammar, or a GBNF (llama.cpp) one, which llguidance converts."""
    return None if text is None else _converted(param, llguidance.grammar_from, "grammar", text)


# JSON Schema keywords whose values are subschemas: maps of them, lists of them, one of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames")


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's disable_additional_properties: a copy of `schema` where each object schema that lists properties and
    says nothing of others allows no others (JSON Schema's default allows any). Walked without recursion: a
    schema may be nested as deep as the request body."""
    schema = msgspec.json.decode(msgspec.json.encode(schema))  # a deep copy
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        stack.extend(node.get(key) for key in _SCHEMA_VALUES)
    return schema


class GrammarChecker:
    """Compiles each constrained request's grammar against the served model's tokenizer before it is routed.

    The llguidance tokenizer is built from ModelInfo's tokenizer.json at the first constrained request (~0.2 s, on
    a thread: the event loop never waits on it) and again only when the model's tokenizer changes (`set_model`).
    A compile that runs past the time limit is answered 400; its thread finishes on its own (llguidance's fuel
    limits bound it).
    """

    def __init__(self, timeout_s: float, max_bytes: int, is_whitespace_flexible: bool = False):
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.is_whitespace_flexible = is_whitespace_flexible
        self._executor = concurrent.futures.ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="grammar-check")
        self._info: ModelInfo | None = None
        self._tokenizer: concurrent.futures.Future[llguidance.LLTokenizer] | None = None
        # what the last CHECKED_CACHE_SIZE grammars' checks said (None: it compiled), by the sha256 of the field and
        # the grammar (an error names the field): a schema that comes again (an API's structured outputs mostly
        # repeat) is not compiled again here
        self._checked: collections.OrderedDict[bytes, tuple[str, str] | None] = collections.OrderedDict()

    def set_model(self, info: ModelInfo) -> None:
        """A new model (or tokenizer): its llguidance tokenizer is built when a request first needs it."""
        self._info = info
        self._tokenizer = None
        self._checked.clear()

    def json_options(self, req: SamplingFields) -> JsonOptions:
        return json_options(req, self.is_whitespace_flexible)

    async def off_loop(self, fn, *args):
        """fn(*args) on the checker's threads: llguidance's conversions (a schema into a grammar) take milliseconds
        for a large schema, time that every stream of this API server would otherwise wait."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def grammar(self, req: SamplingFields, constraint: Constraint | None) -> str | None:
        """SamplingParams.grammar for `constraint` (None: unconstrained), once it compiled for this model;
        BadRequest naming the field at fault otherwise."""
        if constraint is None:
            return None
        for name in ("min_tokens", "ignore_eos"):
            if getattr(req, name):
                raise BadRequest(f"{name} cannot be combined with {constraint.param}: under a grammar, the grammar "
                                 "decides where the output may end", param=name)
        size = len(constraint.grammar.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            raise BadRequest(f"{constraint.param} is too large: its grammar takes {size} bytes, more than the "
                             f"{self.max_bytes} this server compiles (--structured-output-max-bytes)",
                             param=constraint.param)
        key = hashlib.sha256(f"{constraint.param}\0{constraint.grammar}".encode("utf-8", "surrogatepass")).digest()
        if key in self._checked:
            self._checked.move_to_end(key)
            error = self._checked[key]
        else:
            tokenizer = await asyncio.shield(asyncio.wrap_future(self._load_tokenizer()))
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self.timeout_s):
                    error = await loop.run_in_executor(self._executor, _first_error, constraint, tokenizer)
            except TimeoutError:
                raise BadRequest(f"{constraint.param} did not compile within {self.timeout_s:g} s (this server's "
                                 "--structured-output-compile-timeout); simplify it", param=constraint.param) from None
            self._checked[key] = error
            if len(self._checked) > CHECKED_CACHE_SIZE:
                self._checked.popitem(last=False)
        if error is not None:
            param, message = error
            raise BadRequest(f"{param} cannot be used as a constraint: {message}", param=param)
        return constraint.grammar

    def _load_tokenizer(self) -> concurrent.futures.Future[llguidance.LLTokenizer]:
        if self._tokenizer is None:
            if self._info is None:
                raise BadRequest("structured outputs need the model's tokenizer; no model is known yet")
            self._tokenizer = self._executor.submit(_build_tokenizer, self._info)
        return self._tokenizer

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _build_tokenizer(info: ModelInfo) -> llguidance.LLTokenizer:
    try:
        return llguidance.LLTokenizer(info.tokenizer_json, n_vocab=info.vocab_size,
                                      eos_token=info.eos_token_ids or None)  # fmt: skip
    except ValueError as e:
        raise BadRequest(f"structured outputs are not available for this model: llguidance could not load its "
                         f"tokenizer ({e})") from None


def _first_error(constraint: Constraint, tokenizer: llguidance.LLTokenizer) -> tuple[str, str] | None:
    """(param, llguidance's message) when the grammar does not compile: the whole first, then its parts, so that
    the error names the part at fault (one tool's parameters, say)."""
    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(constraint.grammar, tokenizer)
    except BaseException as e:
        if not _is_panic(e):
            raise
        return constraint.param, f"llguidance failed on it ({e})"
    if not is_error:
        return None
    for part in constraint.parts:
        error = _first_error(part, tokenizer)
        if error is not None:
            return error
    return constraint.param, messages[0]
