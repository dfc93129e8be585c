"""`dpserve-frontend` as a real process against a fake coordinator and a real engine loop (EngineService over
NullEngineCore, in a thread): two processes share one port (SO_REUSEPORT), SIGTERM drains in-flight requests, then
Unregister; debug logs one line per request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from dpserve_shared.schema import Heartbeat, RegisterFrontend, Unregister
from tests.conftest import free_port
from tests.integration._frontend_helpers import FakeCoordinator, NullEngine

pytestmark = pytest.mark.timeout(120)

FRONTEND = os.path.join(os.path.dirname(sys.executable), "dpserve-frontend")


def get(url, timeout=30):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(url, max_tokens, timeout=60):
    body = json.dumps({"prompt": "hi", "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, json.loads(response.read())


def wait_healthy(url, procs, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        try:
            if get(url + "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("frontend not healthy in time")


def test_two_processes_one_port_and_sigterm_drains(model_info, tmp_path):
    engine = NullEngine(0, model_info, step_time_s=0.01)
    coordinator = FakeCoordinator(model_info, [engine])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    procs = []
    try:
        for i in range(2):
            procs.append(subprocess.Popen(
                [FRONTEND, "--coordinator", coordinator.control_addr, "--host", "127.0.0.1", "--port", str(port),
                 "--frontend-id", f"fe-{i}", "--log-level", "debug", "--drain-timeout", "20"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True,
            ))
        wait_healthy(url, procs)
        # one of them answering /health says nothing of the other: wait until both registered
        deadline = time.monotonic() + 60
        while {m.frontend_id for m in coordinator.of_type(RegisterFrontend)} != {"fe-0", "fe-1"}:
            assert time.monotonic() < deadline, {m.frontend_id for m in coordinator.of_type(RegisterFrontend)}
            for proc in procs:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            time.sleep(0.1)
        for _ in range(6):
            assert complete(url, 3)[0] == 200
        # metrics are summed over both processes
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        success = [line for line in text.splitlines() if line.startswith("vllm:request_success_total")]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in success) == 6
        # a long request in flight on fe-?; SIGTERM both: in-flight work completes, then they exit
        results = []
        worker = threading.Thread(target=lambda: results.append(complete(url, 150)))
        worker.start()
        time.sleep(0.5)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        worker.join(timeout=30)
        assert results and results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] == 150
        logs = []
        for proc in procs:
            assert proc.wait(timeout=30) == 0
            logs.append(proc.stderr.read().decode())
        assert {m.sender_id for m in coordinator.of_type(Unregister)} == {"fe-0", "fe-1"}
        assert coordinator.of_type(Heartbeat)
        finished = sum(log.count("finished on rank") for log in logs)
        assert finished == 7, logs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        coordinator.close()
        engine.close()
