"""The frontend app with no engines: health, models, tokenize, and validation errors (nothing reaches an engine)."""

import orjson
import pytest
from tests.integration._frontend_helpers import NullEngine, frontend_client, run

pytestmark = pytest.mark.timeout(60)


def post(client, path, body, **kwargs):
    data = body if isinstance(body, (bytes, str)) else orjson.dumps(body)
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return client.post(path, data=data, headers=headers, **kwargs)


async def _json(response):
    return response.status, orjson.loads(await response.read())


def test_health_503_without_engines_and_models_listed(model_info):
    async def scenario():
        async with frontend_client(model_info) as client:
            status, body = await _json(await client.get("/health"))
            assert status == 503 and body["status"] == "unavailable"
            status, body = await _json(await client.get("/v1/models"))
            assert status == 200
            (model,) = body["data"]
            assert model["id"] == model_info.name and model["root"] == model_info.root
            assert model["max_model_len"] == model_info.max_model_len and model["object"] == "model"
            status, body = await _json(await client.get("/version"))
            assert status == 200 and body["version"]
            # a well-formed request with nowhere to go: 503 with an OpenAI error object
            status, body = await _json(await post(client, "/v1/completions", {"prompt": "hi"}))
            assert status == 503 and body["error"]["type"] == "server_error"

    run(scenario())


def test_tokenize_detokenize_prompt_and_messages(model_info):
    async def scenario():
        async with frontend_client(model_info) as client:
            status, body = await _json(await post(client, "/tokenize", {"prompt": "Hello 🤖 world"}))
            assert status == 200
            assert body["count"] == len(body["tokens"]) and body["max_model_len"] == model_info.max_model_len
            status, detok = await _json(await post(client, "/detokenize", {"tokens": body["tokens"]}))
            assert status == 200 and detok == {"prompt": "Hello 🤖 world"}
            messages = [{"role": "user", "content": "What is 2+2?"}]
            status, chat = await _json(await post(client, "/tokenize", {"messages": messages}))
            assert status == 200
            status, text = await _json(await post(client, "/detokenize", {"tokens": chat["tokens"]}))
            assert text["prompt"].startswith("<|im_start|>system\n")
            assert text["prompt"].endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
            status, body = await _json(await post(client, "/tokenize", {"prompt": "x", "messages": messages}))
            assert status == 400
            status, body = await _json(await post(client, "/detokenize", {"tokens": [10**9]}))
            assert status == 400 and "out of vocabulary" in body["error"]["message"]

    run(scenario())


LONG = "word " * 5000

BAD_REQUESTS = [
    # (path, body, status, param or None, text in message)
    ("/v1/completions", b"{not json", 400, None, "parse the JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "int"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens", "4096"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "4096"),
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "prompt", "out of vocabulary"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt", "prompt must be"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt", "prompt must be"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**63}, 400, "seed", "9223372036854775807"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "20"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of", "best_of"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream"),
    ("/v1/completions", {"prompt": "hi", "temperature": 3}, 400, "temperature", "<= 2"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", ">= 1"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "bool"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400,
     "top_logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 30}, 400, "top_logprobs", "20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "4096"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     400, "max_completion_tokens", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model",
     "does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice.function.name", "not one of the tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                  "type": "object", "not": {}}}}}, 400, "response_format.json_schema.schema",
     "Unimplemented keys"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0.5}, 400,
     "frequency_penalty", "not supported"),
]


@pytest.mark.parametrize("path,body,status,param,text", BAD_REQUESTS,
                         ids=[f"{i}-{r[3]}" for i, r in enumerate(BAD_REQUESTS)])
def test_validation_errors_are_openai_error_objects(model_info, path, body, status, param, text):
    engine = NullEngine(0, model_info)
    try:
        async def scenario():
            async with frontend_client(model_info, [engine]) as client:
                got_status, got = await _json(await post(client, path, body))
                assert got_status == status, got
                error = got["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert error["type"] == "invalid_request_error"
                assert error["param"] == param
                assert text in error["message"]
                # the server keeps serving
                ok_status, _ = await _json(await client.get("/v1/models"))
                assert ok_status == 200

        run(scenario())
        assert engine.requests() == []  # nothing reached the engine
    finally:
        engine.close()


UNKNOWN_FIELDS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "bogus_field": 1}, "bogus_field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "vendor": {"x": 1}}], "max_tokens": 2,
                              "stream_options": {"include_usage": True, "x": 1}, "stream": True},
     "stream_options.x"),
]


@pytest.mark.parametrize("path,body,first_unknown", UNKNOWN_FIELDS, ids=["top-level", "nested"])
def test_unknown_fields_are_ignored_unless_strict(model_info, caplog, path, body, first_unknown):
    """vLLM's lenience by default (served, the fields named once in the log); OpenAI's 400 with
    --strict-request-fields. A known field of the wrong type stays a 400 either way."""
    engine = NullEngine(0, model_info)
    try:
        async def scenario():
            async with frontend_client(model_info, [engine]) as client:
                for _ in range(2):
                    response = await post(client, path, body)
                    assert response.status == 200, await response.text()
                    await response.read()
                wrong = dict(body, max_tokens="two")
                status, got = await _json(await post(client, path, wrong))
                assert status == 400 and got["error"]["param"] == "max_tokens"
            async with frontend_client(model_info, [engine], strict_request_fields=True) as client:
                status, got = await _json(await post(client, path, body))
                assert status == 400 and got["error"]["param"] == first_unknown
                assert "Unrecognized request argument supplied" in got["error"]["message"]

        run(scenario())
        assert len(engine.requests()) == 2
        ignored = [r.message for r in caplog.records if "ignored request fields" in r.message]
        assert len(ignored) == 1 and first_unknown in ignored[0], ignored
    finally:
        engine.close()


def test_ping_and_load(model_info):
    async def scenario():
        async with frontend_client(model_info) as client:
            assert (await client.get("/ping")).status == 503  # no rank serves yet
        engine = NullEngine(0, model_info)
        try:
            async with frontend_client(model_info, [engine]) as client:
                for method in (client.get, client.post):
                    response = await method("/ping")
                    assert response.status == 200 and await response.read() == b""
                status, got = await _json(await client.get("/load"))
                assert status == 200 and got == {"server_load": 0}
        finally:
            engine.close()

    run(scenario())


def test_wrong_content_type_415_and_api_key(model_info):
    async def scenario():
        async with frontend_client(model_info, api_key="sekret") as client:
            response = await client.post("/v1/completions", data="prompt=hi",
                                         headers={"Authorization": "Bearer sekret"})
            status, body = await _json(response)
            assert status == 415 and "application/json" in body["error"]["message"]
            status, body = await _json(await post(client, "/v1/completions", {"prompt": "hi"}))
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            status, body = await _json(await client.get("/v1/models", headers={"Authorization": "Bearer wrong"}))
            assert status == 401
            status, body = await _json(await client.get("/v1/models", headers={"Authorization": "Bearer sekret"}))
            assert status == 200
            status, _ = await _json(await client.get("/health"))  # not behind the key
            assert status == 503
            for admin in ("/scale_elastic_ep", "/is_scaling_elastic_ep"):  # they change or reveal the deployment
                status, body = await _json(await post(client, admin, {"new_data_parallel_size": 2}))
                assert status == 401, (admin, body)
            status, body = await _json(await client.post("/is_scaling_elastic_ep",
                                                         headers={"Authorization": "Bearer sekret"}))
            assert status == 200 and body == {"is_scaling_elastic_ep": False}

    run(scenario())


def test_pinned_rank_must_be_serving(model_info):
    engine = NullEngine(0, model_info)
    try:
        async def scenario():
            async with frontend_client(model_info, [engine]) as client:
                status, body = await _json(await post(client, "/v1/completions", {"prompt": "hi"},
                                                      headers={"X-data-parallel-rank": "3"}))
                assert status == 400 and "not a serving rank" in body["error"]["message"]
                status, body = await _json(await post(client, "/v1/completions", {"prompt": "hi"},
                                                      headers={"X-data-parallel-rank": "x"}))
                assert status == 400

        run(scenario())
        assert engine.requests() == []
    finally:
        engine.close()
