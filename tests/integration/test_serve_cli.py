"""`dpserve serve` as a process: start-up failures and a dead Ray instance end it with a clear message and nothing
left; SIGTERM under load drains (issue #16's graceful shutdown) and a second signal stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import ServeProcess, descendants, free_port, start_serve, stop_serve, wait_for

pytestmark = pytest.mark.timeout(120)

DPSERVE = os.path.join(os.path.dirname(sys.executable), "dpserve")


def test_engine_that_cannot_load_its_model_fails_start_up_by_name():
    port, rpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [DPSERVE, "serve", "--data-parallel-backend", "mp", "-dp", "2", "--model", "/nonexistent/model.gguf",
         "--host", "127.0.0.1", "--port", str(port), "--data-parallel-rpc-port", str(rpc_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(descendants(proc.pid))
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("dpserve serve kept running with a model that cannot load")
    output = proc.stdout.read()
    assert proc.returncode == 1, output[-4000:]
    assert "cannot load model /nonexistent/model.gguf" in output
    assert "failed to start" in output and "coordinator exited with code 1" in output
    time.sleep(0.5)
    assert not [pid for pid in seen if os.path.exists(f"/proc/{pid}")], seen


def test_the_local_ray_instance_dying_stops_everything(tmp_path):
    """A coordinator or API server that dies once serving is restarted (test_coordinator_restart.py); the local Ray
    instance that `dpserve serve` started is not: without it no rank can be placed, so the deployment stops."""
    server: ServeProcess = start_serve(backend="ray", data_parallel_size=1, api_server_count=1, null_engine=True,
                                       log_dir=str(tmp_path))
    try:
        children = server.record_descendants()
        ray_head = next(pid for pid, cmd in children.items() if "ray start --head" in cmd.replace("\0", " ")
                        or ("start" in cmd and "--head" in cmd and "--block" in cmd))  # fmt: skip
        os.kill(ray_head, signal.SIGKILL)
        assert server.proc.wait(60) == 1
        assert "the local Ray instance exited" in server.log(), server.log()[-3000:]
    finally:
        problems = stop_serve(server)
    assert not problems, problems


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_second_signal_stops_at_once(tmp_path, backend):
    """Ray's teardown calls may block while the first signal's drain is under way: the second signal's kill is
    bounded (a liveness bound below, not a timing)."""
    server: ServeProcess = start_serve(backend=backend, data_parallel_size=2, api_server_count=1, null_engine=True,
                                       log_dir=str(tmp_path))
    try:
        server.record_descendants()
        os.killpg(server.proc.pid, signal.SIGTERM)
        time.sleep(0.05)
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(15)
        assert "second signal: stopping at once" in server.log(), server.log()[-3000:]
    finally:
        problems = stop_serve(server)
    assert not problems, problems


def _http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict, str]:
    """(status, headers, body text) of a GET (or a POST of `body`); HTTP errors are answers too."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def _stream_events(url: str, max_tokens: int, on_first: threading.Event) -> list[dict | str]:
    """A streamed completion read to its end: its events, "[DONE]" last if it came."""
    body = {"prompt": "Tell me a story", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    events: list[dict | str] = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
            on_first.set()
    return events


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["mp", pytest.param("ray", marks=pytest.mark.ray)])
def test_sigterm_under_load_drains_then_exits_0_with_nothing_left(tmp_path, backend):
    """SIGTERM with requests in flight: /health answers 503 (the port stays open), new requests 503 with Retry-After,
    short requests finish whole, streams that outlive --shutdown-timeout end with an error event and [DONE]; then
    `dpserve serve` exits 0 within the timeout's bound and no process it started (Ray's included) is left."""
    shutdown_timeout_s = 4.0
    server: ServeProcess = start_serve(
        backend=backend, data_parallel_size=2, api_server_count=2, null_engine=True, log_dir=str(tmp_path),
        extra_args=("--null-step-time-ms", "20", "--shutdown-timeout", str(shutdown_timeout_s)),
    )  # fmt: skip
    results: dict[str, list] = {"short": [], "long": [], "errors": []}
    threads: list[threading.Thread] = []
    try:

        def stream(kind: str, max_tokens: int, first: threading.Event):
            try:
                results[kind].append(_stream_events(server.url, max_tokens, first))
            except Exception as e:  # noqa: BLE001 - reported below
                results["errors"].append(repr(e))

        def start(kind: str, max_tokens: int, count: int) -> None:
            firsts = [threading.Event() for _ in range(count)]
            for first in firsts:
                threads.append(threading.Thread(target=stream, args=(kind, max_tokens, first), daemon=True))
                threads[-1].start()
            assert all(first.wait(30) for first in firsts), results["errors"]

        start("long", 900, 4)  # ~18 s at 20 ms a step: past the timeout (max_model_len is 1024)
        start("short", 40, 8)  # ~1 s: well inside it; each has its first event, so it is in flight
        server.record_descendants()  # the engines, Ray's processes and workers, under load
        server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: _http(server.url + "/health", timeout=5)[0] == 503, 10, "/health to answer 503")
        status, headers, text = _http(server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 5})
        assert status == 503 and headers.get("Retry-After") == "1", (status, text)
        assert json.loads(text)["error"]["code"] == "shutting_down"
        assert server.proc.wait(shutdown_timeout_s + 60) == 0, server.log()[-4000:]
        for thread in threads:
            thread.join(10)
        assert not results["errors"], results["errors"]
        assert len(results["short"]) == 8 and len(results["long"]) == 4
        for events in results["short"]:  # whole: every event a token, finished by max_tokens, then [DONE]
            assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events[-3:]
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        for events in results["long"]:
            assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
            assert events[-2]["error"]["code"] == "shutting_down"
            assert "--shutdown-timeout" in events[-2]["error"]["message"]
        assert "--shutdown-timeout (4 s) ran out: ended" in server.log()
    finally:
        problems = stop_serve(server)  # the server has exited: this checks that nothing it started is left
    assert not problems, problems
