"""Admission control and the drain, in process: the frontend app (or a whole `ApiServer`) against real engine loops
(EngineService over NullEngineCore, in threads).

- a request past --max-num-queued-requests on every rank is answered 503 at once, with Retry-After and an OpenAI
  error body, and nothing reaches an engine; counted in /metrics;
- a request that waited longer than --max-queue-time-s in the engine's queue: 503 with Retry-After (not streamed),
  an error event then [DONE] (streamed: the headers were sent);
- SIGTERM's drain (`ApiServer.stop(drain=True)`): /health answers 503 at once on a new connection (the port stays
  open), new requests 503 with Retry-After, a short request in flight finishes, the ones still running when
  --shutdown-timeout runs out end with an error and are aborted on the engine.
"""

import asyncio
import time

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpserve_frontend.app import STATE_KEY
from dpserve_frontend.server import ApiServer
from dpserve_frontend.settings import FrontendSettings
from dpserve_frontend.state import ServerState
from tests.conftest import free_port
from tests.integration._frontend_helpers import NullEngine, frontend_client, run, topology

pytestmark = pytest.mark.timeout(90)


def post(client, path, body):
    return client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"})


def completion(max_tokens, stream=False):
    return {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


async def assert_retry_later(response, reason, flag):
    assert response.status == 503
    assert response.headers["Retry-After"] == "1"
    error = orjson.loads(await response.read())["error"]
    assert error["code"] == reason and flag in error["message"]
    assert error["type"] == ("server_error" if reason == "shutting_down" else "server_overloaded")


def rejections(metrics_text: str) -> dict[str, float]:
    found = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "dpserve:admission_rejections_total":
                found[sample.labels["reason"]] = sample.value
    return found


def test_past_the_request_cap_on_every_rank_is_a_503_and_nothing_is_sent(model_info):
    engines = [NullEngine(0, model_info, step_time_s=0.02), NullEngine(1, model_info, step_time_s=0.02)]
    try:
        async def scenario():
            async with frontend_client(model_info, engines, max_num_queued_requests=1) as client:
                # No snapshot arrives here (no coordinator): each rank's queue is what this frontend sent to it.
                first = [asyncio.ensure_future(post(client, "/v1/completions", completion(20))) for _ in range(2)]
                await asyncio.sleep(0.1)
                refused = await post(client, "/v1/completions", completion(20))
                await assert_retry_later(refused, "queued_requests", "--max-num-queued-requests 1")
                pinned = await client.post("/v1/completions", data=orjson.dumps(completion(5)),
                                           headers={"Content-Type": "application/json", "X-data-parallel-rank": "1"})
                await assert_retry_later(pinned, "queued_requests", "rank 1's queue is full")
                for response in await asyncio.gather(*first):
                    assert response.status == 200
                    assert orjson.loads(await response.read())["usage"]["completion_tokens"] == 20
                metrics = await (await client.get("/metrics")).text()
                assert rejections(metrics) == {"queued_requests": 2.0}
                decisions = {sample.labels["reason"]: sample.value
                             for family in text_string_to_metric_families(metrics) for sample in family.samples
                             if sample.name == "dpserve:routing_decisions_total"}  # fmt: skip
                assert decisions == {"load": 2.0}  # the refused ones were never routed
                assert client.server.app[STATE_KEY].pool.num_in_flight == 0

        run(scenario())
        assert sum(len(engine.requests()) for engine in engines) == 2  # the refused ones never reached an engine
    finally:
        for engine in engines:
            engine.close()


def test_a_request_that_waited_longer_than_max_queue_time_is_a_503(model_info):
    # one running request at a time: the first holds the rank for 60 steps of at least 20 ms
    engine = NullEngine(0, model_info, step_time_s=0.02, max_num_seqs=1, max_queue_time_s=0.3)
    try:
        async def scenario():
            async with frontend_client(model_info, [engine]) as client:
                long = asyncio.ensure_future(post(client, "/v1/completions", completion(60)))
                await asyncio.sleep(0.1)
                waited = await post(client, "/v1/completions", completion(2))
                await assert_retry_later(waited, "queue_time", "--max-queue-time-s 0.3")
                stream = await post(client, "/v1/completions", completion(2, stream=True))
                assert stream.status == 200  # the headers went out before the engine gave up on it
                raw = (await stream.read()).decode()
                assert raw.endswith("data: [DONE]\n\n")
                error = orjson.loads(raw.split("\n\n")[-3][6:])["error"]
                assert error["code"] == "queue_time" and "--max-queue-time-s" in error["message"]
                assert (await long).status == 200
                metrics = await (await client.get("/metrics")).text()
                assert rejections(metrics) == {"queue_time": 2.0}

        run(scenario())
    finally:
        engine.close()


def test_drain_answers_503_with_the_port_open_and_ends_what_outlives_the_shutdown_timeout(model_info):
    engine = NullEngine(0, model_info, step_time_s=0.02)
    try:
        async def scenario():
            port = free_port()
            server = ApiServer(FrontendSettings(frontend_id="fe-drain", host="127.0.0.1", port=port,
                                                stats_interval_s=0, shutdown_timeout_s=3.0))  # fmt: skip
            state = server.app[STATE_KEY]
            state.set_model(model_info)
            running = asyncio.ensure_future(server.run())
            for _ in range(500):
                if server.state is ServerState.SERVING:
                    break
                await asyncio.sleep(0.01)
            state.apply_topology(topology([engine]))
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as session:
                assert (await session.get(url + "/health")).status == 200

                def send(body):
                    return session.post(url + "/v1/completions", data=orjson.dumps(body),
                                        headers={"Content-Type": "application/json"})

                short = asyncio.ensure_future(send(completion(25)))  # ~0.5 s: finishes during the drain
                long = asyncio.ensure_future(send(completion(500)))  # ~10 s: outlives the 3 s timeout
                long_stream = await send(completion(500, stream=True))
                assert long_stream.status == 200
                await long_stream.content.readline()  # the first event: it is running
                while state.pool.num_in_flight < 3:
                    await asyncio.sleep(0.01)
                server.stop()
                assert server.state is ServerState.DRAINING
                async with aiohttp.ClientSession() as fresh:  # a new connection: the port is still open
                    health = await fresh.get(url + "/health")
                    assert health.status == 503 and (await health.json())["status"] == "draining"
                    refused = await fresh.post(url + "/v1/completions", data=orjson.dumps(completion(5)),
                                               headers={"Content-Type": "application/json"})
                    await assert_retry_later(refused, "shutting_down", "shutting down")
                short = await short
                assert short.status == 200 and (await short.json())["usage"]["completion_tokens"] == 25
                await assert_retry_later(await long, "shutting_down", "--shutdown-timeout (3 s)")
                raw = (await long_stream.read()).decode()
                assert raw.endswith("data: [DONE]\n\n")
                error = orjson.loads(raw.split("\n\n")[-3][6:])["error"]
                assert error["code"] == "shutting_down" and "--shutdown-timeout" in error["message"]
            await asyncio.wait_for(running, 15)
            assert server.state is ServerState.STOPPED

        run(scenario())
        for _ in range(100):  # the aborts reach the engine's loop
            if len(engine.aborted_ids()) >= 2:
                break
            time.sleep(0.05)
        assert len(engine.aborted_ids()) == 2 and len(engine.requests()) == 3  # the refused one never got there
    finally:
        engine.close()
