"""Services join and leave at runtime, with a load running alongside that must see zero failures.

- a frontend started later (`dpserve-frontend --coordinator ...`) registers and serves;
- a frontend that dies leaves the others untouched, and the engines abort its in-flight requests;
- an engine started by hand (`dpserve-engine --coordinator ...`, mp style) registers, gets a free rank and
  receives unpinned traffic; when it stops, the others carry on.
Null engines (the product's no-model mode) keep this fast; the serving path is the real one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from tests.conftest import engine_metrics, free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VENV_BIN = os.path.dirname(sys.executable)
STEP_MS = "20"  # null-engine step time: long streams stay in flight for seconds


@pytest.fixture(scope="module")
def server(serve_factory):
    server = serve_factory(
        backend="mp", data_parallel_size=2, api_server_count=1, null_engine=True,
        extra_args=("--null-step-time-ms", STEP_MS),
    )
    yield server
    serve_factory.close()


@pytest.fixture(autouse=True)
def _print_log_on_failure(request, server, server_log_on_failure):
    request.node.serve = server


def _get(url: str, timeout: float = 5.0) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read().decode()
            code = response.status
    except urllib.error.HTTPError as e:
        body, code = e.read().decode(), e.code
    except (urllib.error.URLError, OSError):  # not listening (yet, or any more)
        return 0, {}
    try:
        return code, json.loads(body)
    except ValueError:
        return code, body


def _complete(base_url: str, max_tokens: int = 4, headers: dict | None = None) -> dict:
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps({"prompt": "Hello there", "max_tokens": max_tokens, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def _metrics(base_url: str) -> dict[str, dict[int, float]]:
    return engine_metrics(base_url)


class Load:
    """Sequential small requests against one URL in a thread; every failure is kept."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.num_ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _complete(self.base_url)
                self.num_ok += 1
            except Exception as e:  # noqa: BLE001 - every kind of failure counts
                self.failures.append(repr(e))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def _spawn(argv: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _open_stream(base_url: str, max_tokens: int):
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps({"prompt": "Tell me a long story", "max_tokens": max_tokens, "ignore_eos": True,
                         "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    response = urllib.request.urlopen(request, timeout=60)
    for raw in response:  # wait for the first content event: the request is running on an engine
        if raw.startswith(b"data:"):
            return response
    raise AssertionError("stream ended before its first event")


def test_frontend_joins_serves_and_its_death_aborts_its_requests(server, tmp_path):
    port = free_port()
    late_url = f"http://127.0.0.1:{port}"
    with Load(server.url) as load:
        late = _spawn(
            [os.path.join(VENV_BIN, "dpserve-frontend"), "--coordinator", f"tcp://127.0.0.1:{server.rpc_port}",
             "--host", "127.0.0.1", "--port", str(port)],
            str(tmp_path / "late-frontend.log"),
        )
        try:
            wait_for(lambda: _get(late_url + "/health")[1].get("status") == "ok", 60, "the late frontend's /health")
            assert _complete(late_url)["choices"][0]["finish_reason"] == "length"
            # Long streams through the late frontend, then it dies without a word (SIGKILL).
            streams = [_open_stream(late_url, max_tokens=900) for _ in range(3)]
            # Engine gauges come from the coordinator's load snapshots: give them a moment.
            wait_for(lambda: sum(_metrics(server.url).get("vllm:num_requests_running", {}).values()) >= 3,
                      10, "the three streams to show as running")
            _stop(late, signal.SIGKILL)
            for stream in streams:
                stream.close()
            # The coordinator notices the silence and tells the engines to drop its requests, long before the
            # streams would have finished by themselves (900 tokens x 20 ms = 18 s).
            wait_for(
                lambda: sum(_metrics(server.url).get("vllm:num_requests_running", {0: 1}).values()) == 0,
                15, "the dead frontend's requests to be aborted on the engines",
            )
        finally:
            _stop(late, signal.SIGKILL)
    assert load.num_ok > 0
    assert load.failures == [], load.failures[:5]


def test_engine_started_by_hand_registers_and_receives_traffic(server, tmp_path):
    with Load(server.url) as load:
        engine = _spawn(
            [os.path.join(VENV_BIN, "dpserve-engine"), "--coordinator", f"tcp://127.0.0.1:{server.rpc_port}",
             "--null-engine", "--null-step-time-ms", STEP_MS, "--max-model-len", "1024"],
            str(tmp_path / "hand-engine.log"),
        )
        try:
            health = wait_for(
                lambda: (lambda h: h if len(h[1].get("serving_ranks", [])) == 3 else None)(_get(server.url + "/health")),
                60, "a third serving rank",
            )
            new_rank = max(health[1]["serving_ranks"])
            assert new_rank == 2
            before = _metrics(server.url).get("vllm:request_success_total", {}).get(new_rank, 0.0)
            threads = [threading.Thread(target=_complete, args=(server.url, 16)) for _ in range(24)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert _complete(server.url, headers={"X-data-parallel-rank": str(new_rank)})["choices"]
            after = _metrics(server.url).get("vllm:request_success_total", {}).get(new_rank, 0.0)
            assert after - before >= 2, f"rank {new_rank} served {after - before} requests"
        finally:
            _stop(engine)
        wait_for(lambda: len(_get(server.url + "/health")[1].get("serving_ranks", [])) == 2, 30,
                  "the hand-started engine to leave the topology")
        assert _complete(server.url)["choices"]
    assert load.failures == [], load.failures[:5]
