"""A rank in a step longer than the coordinator's engine timeout (10 s) stays alive: heartbeats do not wait for
steps. Before they had their own thread, one long prefill on a starved CPU got a live rank declared DEAD and
its streams failed."""

import json
import urllib.request

import pytest

from tests.conftest import start_serve, stop_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_step_longer_than_the_engine_timeout_does_not_kill_the_rank(tmp_path):
    server = start_serve(
        backend="mp", data_parallel_size=1, api_server_count=1, null_engine=True,
        extra_args=("--null-step-time-ms", "11000"), log_dir=str(tmp_path),
    )  # fmt: skip
    try:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as response:
            model = json.loads(response.read())["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 1}).encode()
        request = urllib.request.Request(
            server.url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            result = json.loads(response.read())
        assert result["usage"]["completion_tokens"] == 1
        log = server.log()
        assert "missed heartbeats" not in log and "registering again" not in log, log[-3000:]
    finally:
        killed = stop_serve(server)
    assert not killed, killed
