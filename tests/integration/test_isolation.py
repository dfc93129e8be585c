"""Deployments side by side on one host stay apart (issue #20): real `dpserve serve` processes, Ray and ZMQ.

Three null-engine deployments, each DP=2 behind 2 API servers: A (ray) and B (mp) side by side on their own ports,
then A stopped while C starts on A's control port (the default port's case: a user restarts right away). C either
fails at once naming the port and the flag, or starts; retried as a user would, it must then keep both of its
ranks. Each deployment's ranks are served only by its own engines: a burst of 40 requests on each is answered by
both of its ranks, and no deployment's rank is shut down, unregistered or replaced by another's doing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from tests.conftest import engine_metrics, start_serve, stop_serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

BURST = 40
_TROUBLE = ("shutting down: draining", "unregistered", "starting a replacement", "refused engine", "DEAD")


def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        return json.load(response)


def _successes(url: str) -> dict[int, float]:
    return engine_metrics(url).get("vllm:request_success_total", {})


def _burst(url: str, results: list) -> None:
    """BURST concurrent completions; appends (status, completion tokens) per request to `results`."""
    model = _model(url)

    def one(i: int) -> None:
        body = json.dumps({"model": model, "prompt": f"request {i}", "max_tokens": 8}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                results.append((response.status, json.load(response)["usage"]["completion_tokens"]))
        except Exception as e:  # noqa: BLE001 - recorded, asserted below
            results.append((getattr(e, "code", None), repr(e)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)


def _bursts(*urls: str) -> None:
    """A burst on each deployment at the same time; each must be served in full, by both of its ranks."""
    before = {url: _successes(url) for url in urls}
    results = {url: [] for url in urls}
    threads = [threading.Thread(target=_burst, args=(url, results[url])) for url in urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for url in urls:
        assert results[url] == [(200, 8)] * BURST, results[url]
        after = _successes(url)
        served = {rank: after.get(rank, 0.0) - before[url].get(rank, 0.0) for rank in (0, 1)}
        assert sum(served.values()) == BURST and all(served.values()), f"{url}: requests per rank {served}"
        assert {k: v for k, v in _health(url).items() if k != "ranks"} == {"status": "ok", "serving_ranks": [0, 1],
                                                                                "data_parallel_size": 2}


def _deployment_id(server) -> str:
    match = re.search(r"deployment (dep-[0-9a-f]+)", server.log())
    assert match, server.log()[-3000:]
    return match.group(1)


def _trouble(server) -> list[str]:
    return [line for line in server.log().splitlines() if any(t in line for t in _TROUBLE)]


def test_deployments_side_by_side_and_one_stopping_while_another_starts(tmp_path):
    servers, problems = [], []
    common = dict(data_parallel_size=2, api_server_count=2, null_engine=True, log_dir=str(tmp_path))
    try:
        a = start_serve(backend="ray", **common)
        servers.append(a)
        b = start_serve(backend="mp", **common)
        servers.append(b)
        assert _deployment_id(a) != _deployment_id(b)
        _bursts(a.url, b.url)

        # A stops; C starts on A's control port at once, and again (as a user would) while the port is taken.
        os.killpg(a.proc.pid, signal.SIGTERM)
        c = None
        deadline = time.monotonic() + 120
        while c is None:
            try:
                c = start_serve(backend="ray", rpc_port=a.rpc_port, **common)
            except pytest.fail.Exception as e:
                text = str(e)
                taken = "is already in use" in text or "cannot bind the control socket" in text  # serve's check first
                assert taken and "--data-parallel-rpc-port" in text, text[-3000:]
                assert time.monotonic() < deadline, "A never released its control port"
                time.sleep(0.5)
        servers.append(c)
        a.rpc_port = 0  # C's now: A's leftovers are found by ancestry, not by that address
        problems += stop_serve(a)
        servers.remove(a)
        assert _deployment_id(c) != _deployment_id(a)

        time.sleep(10)  # the report: a READY rank was told to shut down 8 s later
        _bursts(b.url, c.url)
        for server in (b, c):
            assert not _trouble(server), "\n".join(_trouble(server))
        for server, other in ((b, a), (c, a), (c, b)):
            assert _deployment_id(other) not in server.log()
    except BaseException:
        for server in servers:
            print(f"\n----- {server.log_path} (tail) -----\n{server.log()[-6000:]}")
        raise
    finally:
        for server in servers:
            problems += stop_serve(server)
    assert not problems, problems
