"""Hostile HTTP input against the frontend app in-process (aiohttp test server, real sockets): the body cap (413),
slow clients (header and body timeouts), deeply nested JSON, and a 400 naming the parameter for every malformed
field. tests/integration/test_http_fuzz.py sends thousands of such requests to a whole `dpserve serve`."""

import asyncio
import json

import orjson
import pytest
from tests.integration._frontend_helpers import NullEngine, frontend_client, run

pytestmark = pytest.mark.timeout(90)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


async def _json(response):
    return response.status, orjson.loads(await response.read())


def _assert_error_object(body: dict, status: int) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert error["message"]
    return error


async def _raw_connection(client):
    return await asyncio.open_connection(client.host, client.port)


async def _read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection (fails the test after `timeout_s`)."""
    data = b""
    async with asyncio.timeout(timeout_s):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def _trickle(writer: asyncio.StreamWriter, byte: bytes, interval_s: float) -> None:
    """A slowloris: one byte every `interval_s`, until the server closes the connection."""
    try:
        while True:
            writer.write(byte)
            await writer.drain()
            await asyncio.sleep(interval_s)
    except (ConnectionError, OSError):
        return


async def _no_connections_left(client, timeout_s: float = 20.0) -> None:
    """The server holds no connection (and so no handler task) once the slow clients are gone."""
    server = client.server.runner.server
    async with asyncio.timeout(timeout_s):
        while server.connections:
            await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------------------------------------
# --max-request-body-bytes
# ------------------------------------------------------------------------------------------------------------


def test_body_over_the_cap_is_a_413_by_content_length_and_by_chunks(model_info):
    cap = 4096

    async def chunks():
        for _ in range(100):
            yield b" " * 1024  # JSON whitespace: the body is valid until it is too long

    async def scenario():
        async with frontend_client(model_info, max_request_body_bytes=cap) as client:
            body = orjson.dumps({"prompt": "x" * (cap + 1)})
            response = await client.post(COMPLETIONS, data=body, headers={"Content-Type": "application/json"})
            status, got = await _json(response)
            assert status == 413
            error = _assert_error_object(got, status)
            assert error["code"] == "request_too_large" and "--max-request-body-bytes" in error["message"]
            assert str(cap) in error["message"]

            response = await client.post(CHAT, data=chunks(), headers={"Content-Type": "application/json"})
            status, got = await _json(response)  # chunked: no Content-Length, it grows past the cap
            assert status == 413 and _assert_error_object(got, status)["code"] == "request_too_large"

            # just under the cap is read and parsed (here: a 400 for the empty prompt, not a 413)
            body = orjson.dumps({"prompt": ""}).ljust(cap, b" ")
            status, got = await _json(await client.post(COMPLETIONS, data=body,
                                                        headers={"Content-Type": "application/json"}))
            assert status == 400 and got["error"]["param"] == "prompt"

    run(scenario())


# ------------------------------------------------------------------------------------------------------------
# Slow clients: --request-header-timeout and --request-body-timeout
# ------------------------------------------------------------------------------------------------------------


def test_a_client_trickling_its_headers_is_disconnected(model_info):
    async def scenario():
        async with frontend_client(model_info, request_header_timeout_s=1.0) as client:
            reader, writer = await _raw_connection(client)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            trickle = asyncio.create_task(_trickle(writer, b"a", 0.1))
            try:
                data = await _read_until_closed(reader, timeout_s=20)
            finally:
                trickle.cancel()
                writer.close()
            assert data == b""  # no request head ever completed: closed without an answer
            await _no_connections_left(client)
            # an idle connection that never sends anything is closed the same way
            reader, writer = await _raw_connection(client)
            assert await _read_until_closed(reader, timeout_s=20) == b""
            writer.close()
            # the server still answers
            assert (await client.get("/v1/models")).status == 200

    run(scenario())


def test_a_client_trickling_its_body_gets_a_408(model_info):
    async def scenario():
        async with frontend_client(model_info, request_body_timeout_s=1.0) as client:
            reader, writer = await _raw_connection(client)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{")
            trickle = asyncio.create_task(_trickle(writer, b" ", 0.1))
            try:
                data = await _read_until_closed(reader, timeout_s=30)
            finally:
                trickle.cancel()
                writer.close()
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), data[:200]
            error = _assert_error_object(orjson.loads(body), 408)
            assert error["code"] == "request_timeout" and "--request-body-timeout" in error["message"]
            await _no_connections_left(client)
            assert (await client.get("/v1/models")).status == 200

    run(scenario())


# ------------------------------------------------------------------------------------------------------------
# Deep nesting and malformed input
# ------------------------------------------------------------------------------------------------------------

DEEP = 100_000
DEEP_BODIES = [
    b"[" * DEEP,
    b"{\"prompt\": " + b"[" * DEEP,
    b"{\"prompt\": \"hi\", \"x\": " + b"[" * DEEP + b"]" * DEEP + b"}",  # behind an unknown field (slow path)
    b"{\"prompt\": \"hi\", \"x\": " + b"{\"a\": " * DEEP + b"1" + b"}" * DEEP + b"}",
]


@pytest.mark.parametrize("body", DEEP_BODIES, ids=["array", "in-prompt", "after-unknown-field", "objects"])
def test_deeply_nested_json_is_a_400(model_info, body):
    async def scenario():
        async with frontend_client(model_info) as client:
            response = await client.post(COMPLETIONS, data=body, headers={"Content-Type": "application/json"})
            status, got = await _json(response)
            assert status == 400, got
            _assert_error_object(got, status)

    run(scenario())


def _chat(**fields):
    return {"messages": MESSAGES, **fields}


def _completion(**fields):
    return {"prompt": "hi", **fields}


# (path, body, status, param); body bytes are sent as they are
MALFORMED = [
    (COMPLETIONS, _completion(max_tokens=[1]), 400, "max_tokens"),
    (COMPLETIONS, _completion(temperature="hot"), 400, "temperature"),
    (COMPLETIONS, b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature"),  # Infinity
    (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400, None),  # not JSON: no field to name
    (COMPLETIONS, b'{"prompt": "hi", "top_p": -Infinity}', 400, None),
    (COMPLETIONS, _completion(top_k=10**30), 400, "top_k"),
    (COMPLETIONS, _completion(seed=-(2**64)), 400, "seed"),
    (COMPLETIONS, _completion(max_tokens=10**40), 400, "max_tokens"),
    (COMPLETIONS, _completion(min_tokens=10**40), 400, "min_tokens"),
    (COMPLETIONS, _completion(n=10**20), 400, "n"),
    (COMPLETIONS, _completion(stop=[1, 2]), 400, "stop[0]"),
    (COMPLETIONS, _completion(stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    (COMPLETIONS, _completion(logit_bias={"1": "x"}), 400, "logit_bias"),
    (COMPLETIONS, _completion(prompt={"text": "hi"}), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[[1, 2], [3, -5]]), 400, "prompt"),
    (COMPLETIONS, _completion(echo=1), 400, "echo"),
    (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
    (COMPLETIONS, b'{"prompt": "\\ud800"}', 400, None),  # a lone surrogate
    (COMPLETIONS, b"", 400, None),
    (COMPLETIONS, b"null", 400, None),
    (COMPLETIONS, b'"hi"', 400, None),
    (COMPLETIONS, b"{", 400, None),
    (COMPLETIONS, b'{"prompt": "hi", "bogus": 1, "n": tru}', 400, None),  # malformed after an unknown field
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"text": "hi"}]}]}, 400, "messages[0].content[0].type"),
    (CHAT, {"messages": [MESSAGES[0], {"content": "x"}]}, 400, "messages[1].role"),
    (CHAT, _chat(top_logprobs=-1, logprobs=True), 400, "top_logprobs"),
    (CHAT, _chat(metadata={"a": 1}), 400, "metadata"),
    (CHAT, _chat(max_completion_tokens=1.5), 400, "max_completion_tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
    ("/detokenize", {}, 400, "tokens"),
    ("/scale_elastic_ep", {"new_data_parallel_size": "two"}, 400, "new_data_parallel_size"),
]


@pytest.mark.parametrize("path,body,status,param", MALFORMED, ids=[f"{i}-{m[3]}" for i, m in enumerate(MALFORMED)])
def test_every_malformed_field_is_a_400_naming_it(model_info, path, body, status, param):
    engine = NullEngine(0, model_info)
    try:
        async def scenario():
            async with frontend_client(model_info, [engine]) as client:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()  # (orjson: 64-bit ints only)
                response = await client.post(path, data=data, headers={"Content-Type": "application/json"})
                got_status, got = await _json(response)
                assert got_status == status, got
                assert _assert_error_object(got, got_status)["param"] == param, got

        run(scenario())
        assert engine.requests() == []
    finally:
        engine.close()


def test_wrong_content_type_unknown_url_and_wrong_method(model_info):
    async def scenario():
        async with frontend_client(model_info) as client:
            for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=1"):
                response = await client.post(COMPLETIONS, data=b'{"prompt": "hi"}',
                                             headers={"Content-Type": content_type})
                status, got = await _json(response)
                assert status == 415 and _assert_error_object(got, status)
            for encoding in ("gzip", "br", "x"):  # not decompressed (no decompression bombs): refused
                response = await client.post(COMPLETIONS, data=b'{"prompt": "hi"}',
                                             headers={"Content-Type": "application/json", "Content-Encoding": encoding})
                status, got = await _json(response)
                assert status == 415 and _assert_error_object(got, status)["param"] == "Content-Encoding"
            status, got = await _json(await client.get("/v1/nope"))
            assert status == 404 and _assert_error_object(got, status)["code"] == "unknown_url"
            assert "/v1/nope" in got["error"]["message"]
            status, got = await _json(await client.post("/v1/nope", data=b"{}"))  # its body is not read
            assert status == 404
            response = await client.get(COMPLETIONS)
            status, got = await _json(response)
            assert status == 405 and _assert_error_object(got, status)["code"] == "method_not_allowed"
            assert response.headers["Allow"] == "POST"
            status, got = await _json(await client.request("PURGE", "/v1/models"))
            assert status == 405

    run(scenario())


def test_a_non_utf8_api_key_is_a_401(model_info):
    """aiohttp keeps a header's non-UTF-8 bytes as lone surrogates; the key check compares the bytes (in constant
    time) instead of failing to encode them."""

    async def scenario():
        async with frontend_client(model_info, api_key="sekret") as client:
            for path in ("/v1/models", "/status.json"):
                reader, writer = await _raw_connection(client)
                writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
                             + b"Authorization: Bearer \xff\xfe\r\n\r\n")
                data = await _read_until_closed(reader, timeout_s=10)
                writer.close()
                head, _, body = data.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 401"), data[:300]
                assert _assert_error_object(orjson.loads(body), 401)["code"] == "invalid_api_key"

    run(scenario())
