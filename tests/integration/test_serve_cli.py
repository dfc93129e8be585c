"""`dpserve serve` as a process: start-up failures and a dead Ray instance end it with a clear message and nothing
left; signals stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ServeProcess, descendants, free_port, start_serve, stop_serve

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
