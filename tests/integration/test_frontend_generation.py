"""The frontend against real engine loops (EngineService over NullEngineCore, in threads) over real ZMQ sockets:
completions, chat, SSE, n, stop strings, usage, aborts, routing, a rank that goes away, metrics."""

import asyncio

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpserve_frontend.app import STATE_KEY
from dpserve_shared.schema import EngineLoad, EngineState, LoadSnapshot
from tests.integration._frontend_helpers import NullEngine, frontend_client, run, topology

pytestmark = pytest.mark.timeout(90)

NULL_TEXT = '() loc", return\n\n   ized distled'  # what the null engine's 8 cycling tokens decode to


@pytest.fixture
def engines(model_info):
    started = [NullEngine(0, model_info), NullEngine(1, model_info)]
    yield started
    for engine in started:
        engine.close()


def post(client, path, body, headers=None):
    return client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})


async def post_json(client, path, body, headers=None):
    response = await post(client, path, body, headers)
    return response.status, orjson.loads(await response.read())


async def sse_events(response):
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    raw = (await response.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [orjson.loads(e[6:]) for e in events[:-1]]


def test_completion_non_stream_and_stream_agree_with_exact_usage(model_info, engines):
    async def scenario():
        async with frontend_client(model_info, engines) as client:
            body = {"prompt": "Say something", "max_tokens": 8, "temperature": 0}
            status, full = await post_json(client, "/v1/completions", body)
            assert status == 200, full
            (choice,) = full["choices"]
            assert choice["text"] == NULL_TEXT and choice["finish_reason"] == "length" and choice["index"] == 0
            assert full["object"] == "text_completion" and full["id"].startswith("cmpl-")
            _, tokenized = await post_json(client, "/tokenize", {"prompt": "Say something"})
            assert full["usage"] == {"prompt_tokens": tokenized["count"], "completion_tokens": 8,
                                     "total_tokens": tokenized["count"] + 8,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
            response = await post(client, "/v1/completions",
                                  {**body, "stream": True, "stream_options": {"include_usage": True}})
            events = await sse_events(response)
            *chunks, last = events
            assert "".join(c["choices"][0]["text"] for c in chunks) == NULL_TEXT
            assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert all(c["usage"] is None for c in chunks)
            assert last["choices"] == [] and last["usage"] == full["usage"]

    run(scenario())


def test_batch_prompts_token_ids_and_n(model_info, engines):
    async def scenario():
        async with frontend_client(model_info, engines) as client:
            status, full = await post_json(client, "/v1/completions",
                                           {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 3, "seed": 7})
            assert status == 200, full
            assert [c["index"] for c in full["choices"]] == [0, 1, 2, 3]
            assert full["usage"]["prompt_tokens"] == 5 and full["usage"]["completion_tokens"] == 12
            status, full = await post_json(client, "/v1/completions", {"prompt": ["a b", "c"], "max_tokens": 2})
            assert len(full["choices"]) == 2
        # all sequences of one request went to one rank; seeded children got distinct seeds
        first = [r for e in engines for r in e.requests() if r.prompt_token_ids in ([1, 2, 3], [4, 5])]
        assert len(first) == 4 and len({r.request_id.rsplit("-", 2)[0] for r in first}) == 1
        assert sum(1 for e in engines if any(r in e.requests() for r in first)) == 1
        assert sorted(r.sampling.seed for r in first) == [7, 7, 8, 8]

    run(scenario())


def test_echo_and_logprobs_shapes(model_info, engines):
    async def scenario():
        async with frontend_client(model_info, engines) as client:
            status, full = await post_json(client, "/v1/completions",
                                           {"prompt": "Hi", "max_tokens": 3, "echo": True, "logprobs": 2})
            assert status == 200, full
            choice = full["choices"][0]
            assert choice["text"].startswith("Hi")
            logprobs = choice["logprobs"]
            assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
            n = len(logprobs["tokens"])
            assert n == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == 1 + 3
            assert logprobs["text_offset"][0] == 0

    run(scenario())


def test_stop_string_ends_and_aborts_on_engine(model_info, engines):
    async def scenario():
        async with frontend_client(model_info, engines) as client:
            status, full = await post_json(client, "/v1/completions",
                                           {"prompt": "x", "max_tokens": 50, "stop": [" return"]})
            choice = full["choices"][0]
            assert choice["text"] == '() loc",' and choice["finish_reason"] == "stop"
            assert choice["stop_reason"] == " return"
            assert full["usage"]["completion_tokens"] == 4
            status, full = await post_json(client, "/v1/completions", {"prompt": "x", "max_tokens": 50,
                                           "stop": "return", "include_stop_str_in_output": True})
            assert full["choices"][0]["text"] == '() loc", return'
            response = await post(client, "/v1/completions",
                                  {"prompt": "x", "max_tokens": 50, "stop": ["ized"], "stream": True})
            events = await sse_events(response)
            assert "".join(e["choices"][0]["text"] for e in events) == '() loc", return\n\n   '
            await asyncio.sleep(0.1)
        aborted = [i for e in engines for i in e.aborted_ids()]
        assert len(aborted) == 3
        for engine in engines:
            assert not engine.core.has_unfinished()

    run(scenario())


def test_chat_stream_and_non_stream(model_info, engines):
    async def scenario():
        async with frontend_client(model_info, engines) as client:
            messages = [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hello"}], "extra": 1}]
            body = {"messages": messages, "max_completion_tokens": 5, "temperature": 0, "model": model_info.name}
            extras = {"user": "u", "store": False, "tools": [], "tool_choice": "none", "presence_penalty": 0,
                      "metadata": {"k": "v"}, "response_format": {"type": "text"}, "stop": None}
            status, full = await post_json(client, "/v1/chat/completions", {**body, **extras})
            assert status == 200, full
            (choice,) = full["choices"]
            assert choice["message"] == {"role": "assistant", "content": '() loc", return\n\n   ', "refusal": None}
            _, tokenized = await post_json(client, "/tokenize", {"messages": messages})
            assert full["usage"]["prompt_tokens"] == tokenized["count"]
            response = await post(client, "/v1/chat/completions",
                                  {**body, "stream": True, "n": 2, "stream_options": {"include_usage": True}})
            events = await sse_events(response)
            *chunks, last = events
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
            for index in (0, 1):
                mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
                assert mine[0]["delta"] == {"role": "assistant", "content": ""}
                assert "".join(c["delta"].get("content", "") for c in mine) == '() loc", return\n\n   '
                assert [c["finish_reason"] for c in mine].count("length") == 1
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            # logprobs
            status, full = await post_json(client, "/v1/chat/completions",
                                           {**body, "logprobs": True, "top_logprobs": 2})
            content = full["choices"][0]["logprobs"]["content"]
            assert [c["token"] for c in content] == ["()", " loc", '",', " return", "\n\n   "]

    run(scenario())


def test_client_disconnect_aborts_on_engine(model_info):
    slow = NullEngine(0, model_info, step_time_s=0.05)
    try:
        async def scenario():
            async with frontend_client(model_info, [slow]) as client:
                response = await post(client, "/v1/completions",
                                      {"prompt": "x", "max_tokens": 1000, "stream": True})
                await response.content.readline()
                response.close()
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if not slow.core.has_unfinished():
                        break
                assert not slow.core.has_unfinished()
                assert len(slow.aborted_ids()) == 1

        run(scenario())
    finally:
        slow.close()


def test_routing_spreads_and_pins(model_info, engines):
    async def scenario():
        async with frontend_client(model_info, engines) as client:
            await asyncio.gather(*[post_json(client, "/v1/completions", {"prompt": "x", "max_tokens": 2})
                                   for _ in range(10)])
            counts = [len(e.requests()) for e in engines]
            assert counts == [5, 5]
            for _ in range(3):
                status, _ = await post_json(client, "/v1/completions", {"prompt": "x", "max_tokens": 2},
                                            headers={"X-data-parallel-rank": "1"})
                assert status == 200
            assert len(engines[1].requests()) == 8

    run(scenario())


def test_vanished_rank_resends_requests_without_tokens(model_info):
    stuck = NullEngine(0, model_info, step_time_s=0.02)
    healthy = NullEngine(1, model_info)
    try:
        async def scenario():
            async with frontend_client(model_info, [stuck]) as client:
                state = client.server.app[STATE_KEY]
                stuck.stop()  # rank 0 stops answering: requests sit there without a token
                task = asyncio.ensure_future(post_json(client, "/v1/completions", {"prompt": "x", "max_tokens": 3}))
                await asyncio.sleep(0.2)
                state.apply_topology(topology([stuck.info(EngineState.DEAD), healthy], epoch=2))
                status, full = await task
                assert status == 200 and full["choices"][0]["finish_reason"] == "length"
                assert len(healthy.requests()) == 1
                status, health = await post_json(client, "/tokenize", {"prompt": "x"})
                response = await client.get("/health")
                body = orjson.loads(await response.read())
                assert response.status == 200 and body["status"] == "degraded"
                assert [(r["rank"], r["state"], r["serving"]) for r in body["ranks"]] == [(0, "dead", False),
                                                                                        (1, "ready", True)]
                assert (await client.get("/health?rank=1")).status == 200
                response = await client.get("/health?rank=0")
                assert response.status == 503 and orjson.loads(await response.read())["state"] == "dead"
                assert (await client.get("/health?rank=7")).status == 404
                assert (await client.get("/health?rank=x")).status == 400

        run(scenario())
    finally:
        stuck.close()
        healthy.close()


def test_metrics_count_exactly_what_usage_said(model_info, engines):
    async def scenario():
        async with frontend_client(model_info, engines) as client:
            state = client.server.app[STATE_KEY]
            total_prompt = total_completion = 0
            for i in range(10):
                status, full = await post_json(client, "/v1/completions", {"prompt": f"count {i}", "max_tokens": 10})
                total_prompt += full["usage"]["prompt_tokens"]
                total_completion += full["usage"]["completion_tokens"]
            state.apply_snapshot(LoadSnapshot([EngineLoad(0, num_running=0, kv_blocks_used=1, kv_blocks_total=4),
                                               EngineLoad(1)], wave=3))
            response = await client.get("/metrics")
            assert response.status == 200
            families = {f.name: f for f in text_string_to_metric_families((await response.read()).decode())}

            def total(name, **labels):
                return sum(s.value for s in families[name].samples
                           if s.name == name + "_total" and all(s.labels.get(k) == v for k, v in labels.items()))

            assert total("vllm:prompt_tokens") == total_prompt
            assert total("vllm:generation_tokens") == total_completion == 100
            assert total("vllm:request_success", finished_reason="length") == 10
            engines_seen = {s.labels["engine"] for s in families["vllm:prompt_tokens"].samples}
            assert engines_seen == {"0", "1"}
            ttft = [s for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
            assert sum(s.value for s in ttft) == 10
            kv = {s.labels["engine"]: s.value for s in families["vllm:kv_cache_usage_perc"].samples}
            assert kv == {"0": 0.25, "1": 0.0}
            assert families["dpserve:coordinator_wave"].samples[0].value == 3
            assert "vllm:num_requests_running" in families and "vllm:prefix_cache_hits" in families

    run(scenario())


def test_error_after_stream_started_is_an_error_event_then_done(model_info):
    slow = NullEngine(0, model_info, step_time_s=0.05)
    try:
        async def scenario():
            async with frontend_client(model_info, [slow]) as client:
                state = client.server.app[STATE_KEY]
                response = await post(client, "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500, "stream": True})
                assert response.status == 200
                await response.content.readline()  # the role chunk
                await asyncio.sleep(0.2)  # some tokens flowed
                state.apply_topology(topology([slow.info(EngineState.DEAD)], epoch=2))
                raw = (await response.read()).decode()
                assert raw.endswith("data: [DONE]\n\n")
                last = orjson.loads(raw.split("\n\n")[-3][6:])
                assert set(last) == {"error"} and "went away" in last["error"]["message"]
                assert last["error"]["type"] == "server_error"

        run(scenario())
    finally:
        slow.close()


@pytest.mark.parametrize("limit", [3, 0])
def test_a_stream_whose_rank_dies_goes_on_on_another_rank(model_info, limit):
    """Rank 0 stops at once in the middle of a stream: the frontend sends the request's continuation to rank 1 and
    the client's stream goes on, its text and usage those of the same request without a fault. With
    --migration-limit 0 the stream ends with an error event instead."""
    a, b = NullEngine(0, model_info, step_time_s=0.02), NullEngine(1, model_info, step_time_s=0.02)
    body = {"prompt": "go on", "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}

    def events_of(raw: str) -> list[dict]:
        assert raw.endswith("data: [DONE]\n\n")
        return [orjson.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]

    try:
        async def scenario():
            async with frontend_client(model_info, [a, b], migration_limit=limit) as client:
                state = client.server.app[STATE_KEY]
                baseline = await post(client, "/v1/completions", body, {"X-data-parallel-rank": "1"})
                expected = events_of((await baseline.read()).decode())
                response = await post(client, "/v1/completions", body, {"X-data-parallel-rank": "0"})
                assert response.status == 200
                first = await response.content.readline()  # the first token's event: the stream has started
                await asyncio.sleep(0.2)  # and goes on for a few more steps
                a.stop()
                state.apply_topology(topology([a.info(EngineState.DEAD), b], epoch=2))
                return expected, events_of((first + await response.read()).decode())

        expected, got = run(scenario())
    finally:
        a.close()
        b.close()
    moved = [r for r in b.requests() if r.num_generated > 0]
    if limit == 0:
        assert set(got[-1]) == {"error"} and not moved  # the engine's abort, or "went away"
        return
    text = lambda events: "".join(e["choices"][0]["text"] for e in events if e.get("choices"))  # noqa: E731
    assert "error" not in got[-1]
    assert text(got) == text(expected)
    assert got[-1]["usage"] == expected[-1]["usage"] and got[-1]["usage"]["completion_tokens"] == 40
    assert len(moved) == 1 and 0 < moved[0].num_generated < 40
    assert moved[0].sampling.max_tokens == 40 - moved[0].num_generated


def test_non_stream_client_disconnect_aborts_too(model_info):
    slow = NullEngine(0, model_info, step_time_s=0.05)
    try:
        async def scenario():
            async with frontend_client(model_info, [slow]) as client:
                task = asyncio.ensure_future(post(client, "/v1/completions", {"prompt": "x", "max_tokens": 1000}))
                await asyncio.sleep(0.3)
                task.cancel()
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if not slow.core.has_unfinished():
                        break
                assert not slow.core.has_unfinished() and len(slow.aborted_ids()) == 1

        run(scenario())
    finally:
        slow.close()


def test_periodic_stats_line(model_info, caplog):
    from dpserve_frontend.app import _log_stats

    async def scenario():
        from dpserve_frontend.settings import FrontendSettings
        from dpserve_frontend.state import FrontendState

        state = FrontendState(FrontendSettings(), model_info)
        task = asyncio.ensure_future(_log_stats(state, 0.05))
        state.apply_snapshot(LoadSnapshot([EngineLoad(0, num_running=2, kv_blocks_used=1, kv_blocks_total=4)]))
        await asyncio.sleep(0.07)
        state.apply_snapshot(LoadSnapshot([EngineLoad(0, num_running=2, kv_blocks_used=1, kv_blocks_total=4,
                                                      generation_tokens=50, prefix_queries=10, prefix_hits=5)]))
        await asyncio.sleep(0.1)
        task.cancel()

    with caplog.at_level("INFO", logger="dpserve_frontend.app"):
        run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine 0:")]
    assert lines and "running 2" in lines[0] and "KV cache usage 25.0%" in lines[0]
    assert any("prefix cache hit rate 50.0%" in line for line in lines)
