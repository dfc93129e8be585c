"""Structured outputs and tool calls through HTTP with the official `openai` client, against the frontend app and a
null engine that draws each token at random among those the request's grammar allows: whatever it writes must
parse as the client expects (a pydantic model, tool calls with valid arguments), streamed or not."""

import json
from typing import Literal

import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field
from tests.integration._frontend_helpers import NullEngine, frontend_client, run

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "What is the weather like in Paris this week?"}]
SEEDS = (0, 1, 2)


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)
    is_sunny: bool
    note: str = Field(max_length=6)


class GetWeather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


WEATHER_TOOL = openai.pydantic_function_tool(GetWeather)  # strict: the client parses its arguments
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now", "strict": True,
                                              "parameters": {"type": "object", "properties": {},
                                                             "additionalProperties": False}}}  # fmt: skip
# What parse() sends: every property required, no others (a plain model_json_schema() allows any other property,
# and random draws fill them with text until max_tokens)
FORECAST_SCHEMA = to_strict_json_schema(Forecast)


@pytest.fixture(scope="module")
def engine(model_info):
    engine = NullEngine(0, model_info)
    yield engine
    engine.close()


def scenario(model_info, engine, body):
    """Runs `body(client)` with an AsyncOpenAI client of a frontend app connected to `engine`."""

    async def go():
        async with frontend_client(model_info, [engine]) as http:
            client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="none", max_retries=0)
            try:
                await body(client)
            finally:
                await client.close()

    run(go(), timeout_s=100)


def test_parse_returns_the_pydantic_model_streamed_or_not(model_info, engine):
    async def body(client):
        for seed in SEEDS:
            completion = await client.chat.completions.parse(model=model_info.name, messages=MESSAGES,
                                                             response_format=Forecast, seed=seed, max_tokens=200)
            choice = completion.choices[0]
            assert isinstance(choice.message.parsed, Forecast) and choice.finish_reason == "stop"
            assert choice.message.refusal is None
            chunks = await client.chat.completions.create(
                model=model_info.name, messages=MESSAGES, seed=seed, max_tokens=200, stream=True,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "Forecast", "schema": FORECAST_SCHEMA, "strict": True}},
            )  # fmt: skip
            text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            Forecast.model_validate_json(text)

    scenario(model_info, engine, body)


def test_required_and_named_tool_calls_with_the_clients_helpers(model_info, engine):
    async def body(client):
        for seed in SEEDS:
            kwargs = {"model": model_info.name, "messages": MESSAGES, "tools": [WEATHER_TOOL, TIME_TOOL],
                      "seed": seed, "max_tokens": 300, "parallel_tool_calls": False}
            completion = await client.chat.completions.parse(tool_choice="required", **kwargs)
            choice = completion.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.id.startswith("call_") and call.function.name in ("GetWeather", "get_time")
            if call.function.name == "GetWeather":
                assert isinstance(call.function.parsed_arguments, GetWeather)
            else:
                assert call.function.parsed_arguments == {}
            # the same seed streamed: the client's accumulator puts the same call together from the deltas
            async with client.chat.completions.stream(tool_choice="required", **kwargs) as stream:
                streamed = await stream.get_final_completion()
            (streamed_call,) = streamed.choices[0].message.tool_calls
            assert streamed.choices[0].finish_reason == "tool_calls"
            assert (streamed_call.function.name, streamed_call.function.arguments) == (
                call.function.name, call.function.arguments)
            named = await client.chat.completions.create(
                tool_choice={"type": "function", "function": {"name": "GetWeather"}}, **kwargs)
            assert named.choices[0].finish_reason == "stop"  # OpenAI's answer for a named tool_choice
            (named_call,) = named.choices[0].message.tool_calls
            assert named_call.function.name == "GetWeather"
            jsonschema.validate(json.loads(named_call.function.arguments), WEATHER_TOOL["function"]["parameters"])

    scenario(model_info, engine, body)


def test_auto_tool_choice_streams_no_tag_text_as_content(model_info, engine):
    """Random text under "auto" almost never reaches a `<tool_call>`: the answer is text, and no delta carries a
    piece of a tag."""

    async def body(client):
        chunks = await client.chat.completions.create(model=model_info.name, messages=MESSAGES, tools=[TIME_TOOL],
                                                      seed=5, max_tokens=30, stream=True)
        deltas = [c.choices[0] async for c in chunks if c.choices]
        text = "".join(d.delta.content or "" for d in deltas)
        assert "<tool_call>" not in text and deltas[-1].finish_reason == "length"
        whole = await client.chat.completions.create(model=model_info.name, messages=MESSAGES, tools=[TIME_TOOL],
                                                     seed=5, max_tokens=30)
        assert whole.choices[0].message.content == text and whole.choices[0].message.tool_calls is None

    scenario(model_info, engine, body)


def test_completions_take_structured_outputs_and_the_guided_aliases(model_info, engine):
    async def body(client):
        for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
            completion = await client.completions.create(model=model_info.name, prompt="Is it sunny?", seed=3,
                                                         max_tokens=10, extra_body=extra)
            assert completion.choices[0].text in ("yes", "no") and completion.choices[0].finish_reason == "stop"
        completion = await client.completions.create(model=model_info.name, prompt="A date:", max_tokens=20,
                                                     extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"})
        assert len(completion.choices[0].text) == 7 and completion.choices[0].text.startswith("20")
        completion = await client.completions.create(
            model=model_info.name, prompt="JSON:", max_tokens=200, n=2, seed=9,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "f", "schema": FORECAST_SCHEMA}}},  # on /v1/completions, as vLLM takes it
        )  # fmt: skip
        for choice in completion.choices:
            Forecast.model_validate_json(choice.text)

    scenario(model_info, engine, body)


HTTP_ERRORS = [
    # (extra request fields, param)
    ({"tools": [TIME_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "tools": [TIME_TOOL], "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


def test_what_cannot_be_served_is_a_400_before_any_engine_sees_it(model_info, engine):
    async def body(client):
        before = len(engine.requests())
        for extra, param in HTTP_ERRORS:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=model_info.name, messages=MESSAGES, max_tokens=5,
                                                     extra_body=extra)
            assert caught.value.body["param"] == param, (extra, caught.value.body)
        assert len(engine.requests()) == before

    scenario(model_info, engine, body)
