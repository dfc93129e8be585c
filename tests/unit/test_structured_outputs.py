"""Structured outputs in the frontend (structured.py): each request field becomes one llguidance grammar, and
`GrammarChecker` compiles it against the bundled model's tokenizer; what cannot be served is a 400 naming the
field. The grammars' behaviour is checked by feeding texts to a matcher."""

import asyncio
import threading

import msgspec
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from dpserve_frontend import structured
from dpserve_frontend.errors import BadRequest
from dpserve_frontend.parsing import decode_body
from dpserve_frontend.protocol import ChatCompletionRequest, CompletionRequest
from dpserve_frontend.structured import GrammarChecker, JsonOptions, closed_objects, json_options, request_constraint

pytestmark = pytest.mark.timeout(60)

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def completion(**fields) -> CompletionRequest:
    return msgspec.convert({"prompt": "hi", **fields}, CompletionRequest)


def constraint_of(**fields):
    req = completion(**fields)
    return request_constraint(req, json_options(req, is_whitespace_flexible=False))


def check(model_info, req, constraint, **checker_kwargs) -> str | None:
    checker = GrammarChecker(checker_kwargs.pop("timeout_s", 5.0), checker_kwargs.pop("max_bytes", 64 * 1024))
    checker.set_model(model_info)
    try:
        return asyncio.run(checker.grammar(req, constraint))
    finally:
        checker.close()


SCHEMA_FIELDS = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    {"structured_outputs": {"json": PERSON}},
    {"structured_outputs": {"json": msgspec.json.encode(PERSON).decode()}},  # vLLM takes the schema's JSON text too
    {"guided_json": PERSON},
]


@pytest.mark.parametrize("fields", SCHEMA_FIELDS, ids=["response_format", "structured_outputs", "as-text", "guided"])
def test_a_json_schema_from_any_field_holds_the_output_to_compact_json(fields, accepts):
    constraint = constraint_of(**fields)
    assert accepts(constraint.grammar, '{"name":"Bob","age":42}')
    assert not accepts(constraint.grammar, '{"name": "Bob", "age": 42}')  # compact by default
    assert not accepts(constraint.grammar, '{"name":"Bob"}')
    assert not accepts(constraint.grammar, '{"age":42,"name":"Bob"}')  # properties in order


def test_other_constraints_and_their_params(accepts):
    cases = [
        ({"response_format": {"type": "json_object"}}, "response_format", '{"x":[1]}', "[1]"),
        ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object", "{}", '"a"'),
        ({"structured_outputs": {"regex": "[a-c]{2}"}}, "structured_outputs.regex", "ab", "abc"),
        ({"guided_regex": "[0-9]+"}, "guided_regex", "42", "4a"),
        ({"structured_outputs": {"choice": ["yes", 'a "b"']}}, "structured_outputs.choice", 'a "b"', "maybe"),
        ({"guided_choice": ["x"]}, "guided_choice", "x", "y"),
        ({"structured_outputs": {"grammar": 'start: "a"+'}}, "structured_outputs.grammar", "aaa", "b"),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, "guided_grammar", "no", "yes!"),  # GBNF is converted
    ]
    for fields, param, good, bad in cases:
        constraint = constraint_of(**fields)
        assert constraint.param == param
        assert accepts(constraint.grammar, good), fields
        assert not accepts(constraint.grammar, bad), fields
    assert constraint_of(response_format={"type": "text"}) is None
    assert constraint_of(guided_decoding_backend="xgrammar") is None  # accepted, ignored


def test_whitespace_follows_the_server_then_the_request(accepts):
    flexible, compact = '{"name": "Bob", "age": 42}', '{"name":"Bob","age":42}'

    def grammar(is_server_flexible: bool, **fields) -> str:
        req = completion(**fields)
        return request_constraint(req, json_options(req, is_server_flexible)).grammar

    assert accepts(grammar(True, guided_json=PERSON), flexible)
    assert not accepts(grammar(True, structured_outputs={"json": PERSON, "disable_any_whitespace": True}), flexible)
    assert accepts(grammar(False, structured_outputs={"json": PERSON, "disable_any_whitespace": False}), flexible)
    patterned = grammar(False, structured_outputs={"json": PERSON, "whitespace_pattern": "[ ]?"})
    assert accepts(patterned, flexible) and accepts(patterned, compact)
    assert not accepts(patterned, '{"name":  "Bob","age":42}')
    assert accepts(grammar(False, guided_json=PERSON, guided_whitespace_pattern=" "), flexible)


def test_disable_additional_properties_closes_every_listed_object(accepts):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "properties": {"type": "integer"}},
              "$defs": {"d": {"properties": {}}}, "anyOf": [{"properties": {}, "additionalProperties": True}]}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]  # a property named "properties"
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is True  # said: kept
    assert "additionalProperties" not in schema  # a copy
    open_grammar = constraint_of(structured_outputs={"json": PERSON}).grammar
    closed_grammar = constraint_of(structured_outputs={"json": PERSON, "disable_additional_properties": True}).grammar
    extra = '{"name":"Bob","age":42,"x":1}'
    assert accepts(open_grammar, extra) and not accepts(closed_grammar, extra)


REQUEST_ERRORS = [
    # (fields, param, text in the message)
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
     "response_format.json_schema.name", "Missing required parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": PERSON}}},
     "response_format.json_schema.name", "a-zA-Z0-9_-"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": PERSON}}},
     "response_format.json_schema.name", "a-zA-Z0-9_-"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema", "needs a 'schema'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs 'json_schema'"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}},
     "response_format.json_schema.schema", "Expected `object | null`, got `array`"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "give one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "give one"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON Schema"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "JSON Schema object"),
    ({"structured_outputs": {"json": PERSON, "whitespace_pattern": " ", "disable_any_whitespace": True}},
     "structured_outputs.whitespace_pattern", "contradict"),
    ({"guided_grammar": 'root ::= ("yes"'}, "guided_grammar", "GBNF"),
    ({"guided_json": {"type": "integer", "maximum": 10**33}}, "guided_json", "not JSON serializable"),
]


@pytest.mark.parametrize("fields,param,text", REQUEST_ERRORS, ids=[f"{i}-{r[1]}" for i, r in enumerate(REQUEST_ERRORS)])
def test_request_errors_name_the_field(fields, param, text):
    with pytest.raises(BadRequest) as caught:
        req = decode_body(msgspec.json.encode({"prompt": "hi", **fields}), CompletionRequest, strict=True)
        request_constraint(req, json_options(req, is_whitespace_flexible=False))
    assert caught.value.param == param
    assert text in caught.value.message


COMPILE_ERRORS = [
    # (fields, param, llguidance's words in the message)
    ({"guided_json": {"type": "frobnicate"}}, "guided_json", "Invalid type: frobnicate"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", "/$defs/missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"not": {"type": "null"}}}}},
     "response_format.json_schema.schema", 'Unimplemented keys: ["not"]'),
    ({"guided_json": {"type": "string", "format": "bogus"}}, "guided_json", "bogus"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
    ({"guided_json": {"type": "object", "x-guidance": {"lenient": True}, "not": {}}}, "guided_json",
     "Unimplemented"),  # a schema cannot ask llguidance to drop what it does not implement
]


@pytest.mark.parametrize("fields,param,text", COMPILE_ERRORS, ids=[f"{i}-{r[1]}" for i, r in enumerate(COMPILE_ERRORS)])
def test_what_does_not_compile_is_a_400_with_llguidances_reason(model_info, fields, param, text):
    req = completion(**fields)
    with pytest.raises(BadRequest) as caught:
        check(model_info, req, request_constraint(req, JsonOptions()))
    assert caught.value.param == param
    assert text in caught.value.message


def test_limits_and_combinations_the_engine_refuses(model_info, monkeypatch):
    req = completion(guided_json=PERSON)
    constraint = request_constraint(req, JsonOptions())
    assert check(model_info, req, constraint) == constraint.grammar
    assert check(model_info, req, None) is None
    with pytest.raises(BadRequest, match="--structured-output-max-bytes") as caught:
        check(model_info, req, constraint, max_bytes=len(constraint.grammar) - 1)
    assert caught.value.param == "guided_json"
    for fields in ({"min_tokens": 2}, {"ignore_eos": True}):
        with pytest.raises(BadRequest, match="cannot be combined with guided_json") as caught:
            check(model_info, completion(guided_json=PERSON, **fields), constraint)
        assert caught.value.param == next(iter(fields))
    # a compile that takes longer than the limit: answered, whatever the thread still does
    release = threading.Event()
    monkeypatch.setattr(structured, "_first_error", lambda *_: release.wait(30) and None)
    try:
        with pytest.raises(BadRequest, match="--structured-output-compile-timeout") as caught:
            check(model_info, req, constraint, timeout_s=0.05)
        assert caught.value.param == "guided_json"
    finally:
        release.set()


def test_a_grammar_that_comes_again_is_not_compiled_again_until_the_model_changes(model_info, monkeypatch):
    calls = []
    first_error = structured._first_error
    monkeypatch.setattr(structured, "_first_error", lambda *a: calls.append(a[0].param) or first_error(*a))
    good, bad = completion(guided_json=PERSON), completion(guided_json={"type": "frobnicate"})
    checker = GrammarChecker(5.0, 64 * 1024)
    checker.set_model(model_info)

    async def twice(req, constraint):
        answers = []
        for _ in range(2):
            try:
                answers.append(await checker.grammar(req, constraint))
            except BadRequest as e:
                answers.append((e.param, e.message))
        return answers

    try:
        good_constraint = request_constraint(good, JsonOptions())
        assert asyncio.run(twice(good, good_constraint)) == [good_constraint.grammar] * 2
        first, again = asyncio.run(twice(bad, request_constraint(bad, JsonOptions())))
        assert first == again and first[0] == "guided_json" and "frobnicate" in first[1]
        # the same schema from another field is its own entry: the error names that field
        other = completion(structured_outputs={"json": {"type": "frobnicate"}})
        (param, _), _ = asyncio.run(twice(other, request_constraint(other, JsonOptions())))
        assert param == "structured_outputs.json"
        assert calls == ["guided_json", "guided_json", "structured_outputs.json"]
        checker.set_model(model_info)
        asyncio.run(twice(good, good_constraint))
        assert calls[-1] == "guided_json" and len(calls) == 4
    finally:
        checker.close()


def test_the_openai_clients_strict_pydantic_schemas_compile(model_info, accepts):
    """What `client.chat.completions.parse(response_format=Model)` sends: all properties required, no others,
    $defs/$ref for nested models, anyOf for Optional."""

    class Address(BaseModel):
        city: str = Field(max_length=20)
        zip_code: str | None

    class Person(BaseModel):
        name: str
        age: int = Field(ge=0, le=150)
        addresses: list[Address]
        nickname: str | None = None

    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "Person", "schema": to_strict_json_schema(Person),
                                                "strict": True}}}  # fmt: skip
    req = decode_body(msgspec.json.encode(body), ChatCompletionRequest, strict=True)
    grammar = check(model_info, req, request_constraint(req, JsonOptions()))
    text = '{"name":"A","age":3,"addresses":[{"city":"P","zip_code":null}],"nickname":null}'
    assert accepts(grammar, text)
    Person.model_validate_json(text)
    assert not accepts(grammar, '{"name":"A","age":-1,"addresses":[],"nickname":null}')


def test_the_flags_reach_the_api_servers_through_dpserve_serve(tmp_path):
    from dpserve import cli, serve
    from dpserve_frontend.settings import FrontendSettings, settings_from_args

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}")
    args = cli.build_parser().parse_args([
        "serve", "--chat-template", str(template), "--tool-call-parser", "hermes", "--structured-output-whitespace",
        "flexible", "--structured-output-compile-timeout", "2.5", "--structured-output-max-bytes", "1000",
    ])  # fmt: skip
    settings = settings_from_args(serve.frontend_command(args, "/tmp/ready")[3:])
    assert settings.chat_template == template.read_text() and settings.is_json_whitespace_flexible
    assert (settings.structured_output_compile_timeout_s, settings.structured_output_max_bytes) == (2.5, 1000)
    default = settings_from_args(serve.frontend_command(cli.build_parser().parse_args(["serve"]))[3:])
    assert not default.is_json_whitespace_flexible
    assert default.structured_output_compile_timeout_s == FrontendSettings.structured_output_compile_timeout_s
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--tool-call-parser", "pythonic"])


def test_a_tokenizer_llguidance_cannot_load_makes_every_constraint_a_400(model_info):
    placeholder = msgspec.structs.replace(model_info, tokenizer_json="{}")
    req = completion(guided_regex="a")
    with pytest.raises(BadRequest, match="structured outputs are not available for this model"):
        check(placeholder, req, request_constraint(req, JsonOptions()))
