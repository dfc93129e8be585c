"""OpenAI compatibility (issue 4) through `dpserve serve` (mp backend, DP=2, 2 API servers): the official `openai`
client with strict response validation, raw HTTP for SSE framing, validation errors, /metrics.

Runs against the null engine (quick: the serving path alone) and the real model (slow).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SERVERS = [
    pytest.param(True, id="mp-null"),
    pytest.param(False, id="mp-model"),
]


@pytest.fixture(scope="module", params=SERVERS)
def server(request, serve_factory):
    started = serve_factory(backend="mp", data_parallel_size=2, api_server_count=2, null_engine=request.param)
    started.null_engine = request.param
    return started


@pytest.fixture(autouse=True)
def _print_log_on_failure(request, server, server_log_on_failure):
    request.node.serve = server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def http(server, method, path, body=None, headers=None):
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def sse(raw: bytes) -> list[dict]:
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [json.loads(e[6:]) for e in events[:-1]]


def tokenize(server, **body) -> int:
    status, _, raw = http(server, "POST", "/tokenize", body)
    assert status == 200, raw
    return json.loads(raw)["count"]


def metrics(server) -> dict[tuple, float]:
    status, _, raw = http(server, "GET", "/metrics")
    assert status == 200
    values = {}
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def total(values, name, **labels) -> float:
    return sum(v for (n, ls), v in values.items() if n == name and all((k, val) in ls for k, val in labels.items()))


# ----------------------------------------------------------------------------------------------------------------


def test_completions_prompt_forms_n_and_usage(client, model, server):
    response = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                         temperature=0, user="tester", best_of=1)
    assert len(response.choices) == 1 and response.choices[0].finish_reason in ("length", "stop")
    assert response.usage.prompt_tokens == tokenize(server, prompt="The capital of France is")
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    response = client.completions.create(model=model, prompt=["One", "Two three"], max_tokens=3, n=2,
                                         temperature=0)
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    ids = json.loads(http(server, "POST", "/tokenize", {"prompt": "Hello there"})[2])["tokens"]
    response = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    assert response.usage.prompt_tokens == len(ids)
    response = client.completions.create(model=model, prompt=[ids, ids[:1]], max_tokens=3, temperature=0)
    assert len(response.choices) == 2 and response.usage.prompt_tokens == len(ids) + 1


def test_completion_stream_equals_non_stream_and_usage_chunk(client, model, server):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs)
    # The client's Completion model types finish_reason as non-null, yet OpenAI (and vLLM) stream null until the
    # last chunk: strict validation cannot accept a real completions stream, so this one client is lenient.
    lenient = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(lenient.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in content if c.choices[0].finish_reason] == [
        full.choices[0].finish_reason]
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens


def test_completion_sampling_params_logprobs_echo_stop(client, model, server):
    kwargs = dict(model=model, prompt="Count: 1, 2, 3,", max_tokens=6, temperature=0.7, top_p=0.9,
                  seed=2**63 - 1, extra_body={"top_k": 20, "min_p": 0.05, "min_tokens": 2, "ignore_eos": True})
    response = client.completions.create(**kwargs, echo=True)
    assert response.choices[0].text.startswith("Count: 1, 2, 3,")
    assert response.usage.completion_tokens == 6
    if not server.null_engine:  # the null engine computes no logprobs
        choice = client.completions.create(**kwargs, logprobs=3).choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) == 6
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
        # echo + logprobs: the first prompt token has a null logprob (as OpenAI sends it), which the client's
        # strict model rejects, so this request goes through a lenient client.
        lenient = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        lp = lenient.completions.create(**kwargs, logprobs=2, echo=True).choices[0].logprobs
        assert lp.text_offset[0] == 0 and lp.token_logprobs[0] is None and lp.token_logprobs[-1] is not None
        assert len(lp.tokens) == tokenize(server, prompt="Count: 1, 2, 3,") + 6
    full = client.completions.create(model=model, prompt="Hello", max_tokens=10, temperature=0)
    text = full.choices[0].text
    if len(text) > 3:
        stop = text[1:3]
        cut = client.completions.create(model=model, prompt="Hello", max_tokens=10, temperature=0, stop=[stop])
        assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
        kept = client.completions.create(model=model, prompt="Hello", max_tokens=10, temperature=0, stop=stop,
                                         extra_body={"include_stop_str_in_output": True})
        assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_chat_forms_and_stream_equals_non_stream(client, model, server):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?", "name": "bob"},
    ]
    kwargs = dict(model=model, messages=messages, max_completion_tokens=10, temperature=0, seed=1)
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == tokenize(server, messages=messages)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        full.choices[0].finish_reason]
    response = client.chat.completions.create(model=model, messages=messages[-1:], max_tokens=4, n=2,
                                              logprobs=True, top_logprobs=2)
    assert [c.index for c in response.choices] == [0, 1]
    if not server.null_engine:
        content = response.choices[0].logprobs.content
        assert content and all(len(c.top_logprobs) == 2 for c in content)


def test_sse_framing_raw(server, model):
    status, headers, raw = http(server, "POST", "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse(raw)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] > 0
    assert sum(1 for e in events for c in e["choices"] if c["finish_reason"]) == 1


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ({"prompt": "x", "seed": 2**64}, 400, "seed"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": [10**8]}, 400, "prompt"),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "word " * 3000}, 400, "prompt"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
])
def test_validation_errors(server, model, body, status, param):
    got, _, raw = http(server, "POST", "/v1/completions", body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    got, _, raw = http(server, "POST", "/v1/completions", b"{broken")
    assert got == 400
    got, _, raw = http(server, "POST", "/v1/completions", b"prompt=x", {"Content-Type": "text/plain"})
    assert got == 415
    assert http(server, "GET", "/health")[0] == 200  # still serving


def test_unknown_request_fields_are_ignored(client, model):
    """Vendor fields an SDK sends (`extra_body`) are ignored, as vLLM does, not a 400."""
    completion = client.completions.create(model=model, prompt="x", max_tokens=1,
                                           extra_body={"vendor_field": {"a": 1}, "priority": 0})
    assert completion.usage.completion_tokens == 1


def test_openai_client_errors(client, model):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], top_logprobs=3)


def test_other_endpoints(server, model):
    status, _, raw = http(server, "GET", "/v1/models")
    (entry,) = json.loads(raw)["data"]
    assert entry["id"] == model and entry["root"] and entry["max_model_len"] == 1024
    status, _, raw = http(server, "POST", "/tokenize", {"prompt": "Hello 🤖"})
    tokens = json.loads(raw)["tokens"]
    status, _, raw = http(server, "POST", "/detokenize", {"tokens": tokens})
    assert json.loads(raw)["prompt"] == "Hello 🤖"
    assert http(server, "GET", "/version")[0] == 200
    status, _, raw = http(server, "GET", "/health")
    assert status == 200 and json.loads(raw)["serving_ranks"] == [0, 1]


def test_metrics_move_by_exactly_usage(client, model, server):
    before = metrics(server)
    prompt_tokens = completion_tokens = 0
    for i in range(10):
        response = client.completions.create(model=model, prompt=f"Request number {i}", max_tokens=10,
                                             temperature=0, extra_body={"ignore_eos": True})
        prompt_tokens += response.usage.prompt_tokens
        completion_tokens += response.usage.completion_tokens
    assert completion_tokens == 100
    after = metrics(server)
    assert total(after, "vllm:prompt_tokens_total") - total(before, "vllm:prompt_tokens_total") == prompt_tokens
    assert (total(after, "vllm:generation_tokens_total") - total(before, "vllm:generation_tokens_total")
            == completion_tokens)
    assert (total(after, "vllm:request_success_total", finished_reason="length")
            - total(before, "vllm:request_success_total", finished_reason="length")) == 10
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert total(after, name) - total(before, name) == 10
    engines = {dict(labels).get("engine") for (name, labels) in after if name == "vllm:num_requests_running"}
    assert engines == {"0", "1"}


def test_aborted_streams_leave_nothing_running(server, model):
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": "Tell me a long story", "max_tokens": 500, "stream": True}).encode()
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert b"200" in sock.recv(4096)  # headers (and maybe a first event), then hang up
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        values = metrics(server)
        if total(values, "vllm:num_requests_running") == 0 and total(values, "vllm:num_requests_waiting") == 0:
            break
        time.sleep(0.3)
    assert total(values, "vllm:num_requests_running") == 0 and total(values, "vllm:num_requests_waiting") == 0


def test_cached_prompt_tokens_and_pinned_rank(client, model, server):
    """The second identical prompt on a pinned rank reports its cached prompt tokens (the real engine's prefix
    cache; the null engine keeps one of block hashes too)."""
    prompt = "Here is a list of animals: " + ", ".join(["cat", "dog", "horse", "cow", "sheep", "goat"] * 12)
    usages = []
    for _ in range(2):
        response = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                             extra_headers={"X-data-parallel-rank": "1"})
        usages.append(response.usage)
    assert usages[0].prompt_tokens == tokenize(server, prompt=prompt) > 64
    assert usages[1].prompt_tokens_details.cached_tokens >= 32
    with pytest.raises(openai.BadRequestError, match="not a serving rank"):
        client.completions.create(model=model, prompt="x", max_tokens=1, extra_headers={"X-data-parallel-rank": "7"})


# -- structured outputs and tool calls (issue 37), on every rank and through both API servers ------------------

def _forecast_model():
    from typing import Literal

    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        days: int = Field(ge=1, le=7)
        is_sunny: bool
        note: str = Field(max_length=12)

    return Forecast


def _weather_tool():
    from typing import Literal

    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: Literal["Paris", "Rome", "Oslo"]
        days: int = Field(ge=1, le=7)

    return GetWeather, openai.pydantic_function_tool(GetWeather)


ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]


def test_structured_outputs_hold_on_every_rank(client, model, server):
    """parse() returns the pydantic model; json_object, regex, choice and a Lark grammar hold; on each rank."""
    import jsonschema

    forecast = _forecast_model()
    for rank in ("0", "1"):
        pin = {"X-data-parallel-rank": rank}
        for seed, temperature in ((1, 0.0), (2, 1.0)):
            parsed = client.chat.completions.parse(model=model, messages=ASK, response_format=forecast, seed=seed,
                                                   temperature=temperature, max_tokens=200, extra_headers=pin)
            choice = parsed.choices[0]
            assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, forecast), choice
        obj = client.chat.completions.create(model=model, messages=ASK, response_format={"type": "json_object"},
                                             max_tokens=200, seed=3, extra_headers=pin)
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
        regex = client.completions.create(model=model, prompt="Today's date is", max_tokens=20, temperature=0,
                                          extra_body={"structured_outputs": {"regex": r" 20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
                                          extra_headers=pin)  # fmt: skip
        assert regex.choices[0].finish_reason == "stop"
        jsonschema.validate(regex.choices[0].text, {"type": "string", "pattern": r"^ 20\d\d-[01]\d-[0-3]\d$"})
        choice = client.completions.create(model=model, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                           extra_body={"guided_choice": [" yes", " no"]}, extra_headers=pin)
        assert choice.choices[0].text in (" yes", " no") and choice.choices[0].finish_reason == "stop"
        grammar = client.completions.create(
            model=model, prompt="2 + 3 =", max_tokens=10, temperature=0, extra_headers=pin,
            extra_body={"structured_outputs": {"grammar": 'start: " " NUM "."\nNUM: /[0-9]{1,3}/'}})
        text = grammar.choices[0].text
        assert grammar.choices[0].finish_reason == "stop" and text[0] == " " and text[1:-1].isdigit() and text[-1] == "."


def test_tool_calls_required_named_streamed_and_a_multi_turn_exchange(client, model, server):
    """tool_choice required and named parse and validate, streamed arguments equal the whole response's for the same
    seed, and a conversation carrying a call and its result renders and answers."""
    import jsonschema

    weather, tool = _weather_tool()
    # top_p: a seeded draw among the long tail of tokens would change with the logits' last bits, which differ
    # between the eager decode step and the compiled one (a rank may load it between two requests: compiled.py)
    kwargs = dict(model=model, messages=ASK, tools=[tool], seed=4, temperature=1.0, top_p=0.9, max_tokens=200,
                  parallel_tool_calls=False)
    whole = client.chat.completions.parse(tool_choice="required", **kwargs)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, weather)
    with client.chat.completions.stream(tool_choice="required", **kwargs) as stream:
        streamed = stream.get_final_completion()
    (streamed_call,) = streamed.choices[0].message.tool_calls
    assert streamed_call.function.arguments == call.function.arguments
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "GetWeather"}},
                                           **kwargs)
    assert named.choices[0].finish_reason == "stop"
    (named_call,) = named.choices[0].message.tool_calls
    jsonschema.validate(json.loads(named_call.function.arguments), tool["function"]["parameters"])
    turns = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "GetWeather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny, 24 C"}'},
    ]  # fmt: skip
    answer = client.chat.completions.create(model=model, messages=turns, tools=[tool], max_tokens=30, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert answer.usage.prompt_tokens == tokenize(server, messages=turns, tools=[tool])
    assert answer.usage.prompt_tokens > tokenize(server, messages=ASK)  # the call and its result were rendered


def test_a_seeded_constrained_request_is_the_same_alone_and_in_a_mixed_batch_of_32(model, server):
    """The same tokens alone and among 31 others, constrained and not, spread over both ranks."""
    import concurrent.futures

    forecast = _forecast_model()
    schema = {"type": "json_schema", "json_schema": {"name": "Forecast", "schema": forecast.model_json_schema()}}

    def body(i: int) -> dict:
        messages = [{"role": "user", "content": f"Forecast number {i} for a city, please."}]
        request = {"model": model, "messages": messages, "max_tokens": 40, "seed": 100 + i, "temperature": 1.0,
                   "top_p": 0.9}  # (top_p: see the tool-calls test above)
        if i % 2 == 0:
            request["response_format"] = schema
        elif i % 4 == 1:
            request["structured_outputs"] = {"regex": r"[A-Z][a-z]{2,8}( [a-z]{2,8}){3,6}\."}
        return request

    def text(i: int, rank: str) -> tuple[str, str]:
        status, _, raw = http(server, "POST", "/v1/chat/completions", body(i), {"X-data-parallel-rank": rank})
        assert status == 200, raw
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    alone = {i: text(i, str(i % 2)) for i in (0, 1)}
    for content, finish in alone.values():
        if finish == "stop":
            assert content
    if alone[0][1] == "stop":
        forecast.model_validate_json(alone[0][0])
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        batch = list(pool.map(lambda i: text(i, str(i % 2)), range(32)))
    assert batch[0] == alone[0] and batch[1] == alone[1]
    for i, (content, finish) in enumerate(batch):
        if i % 2 == 0 and finish == "stop":
            forecast.model_validate_json(content)
