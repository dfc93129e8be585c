"""A coordinator or API server that dies under load, inside `dpserve serve` (deployment.py restarts it):

- the coordinator SIGKILLed (mp and ray backends): no request fails, `dpserve serve` starts it again, it
  re-attaches to the running engines (the same engine pids: nothing restarted), and a scale step works after;
- an API server SIGKILLed: the other keeps the port and serves, it is started again, and the engines free the
  requests it had (FrontendGone once the coordinator found it silent).
Null engines (tokens on a fixed step time); the serving path and the processes are the real ones.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from tests.conftest import ServeProcess, wait_for
from tests.integration.test_scale import STEP_MS, StreamLoad, _scale, _serving_ranks, _stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _engine_pids(server: ServeProcess) -> dict[int, int]:
    """rank -> engine pid, as the deployment reports them (each engine's own pid, under either backend)."""
    with urllib.request.urlopen(server.url + "/status.json", timeout=5) as response:
        return {r["rank"]: r["pid"] for r in json.load(response)["ranks"] if r["state"] == "ready"}


def _child_pid(server: ServeProcess, marker: str) -> int:
    found = [pid for pid, cmd in server.record_descendants().items() if marker in cmd and "-c" in cmd]
    assert found, f"no {marker} process under dpserve serve"
    return min(found)


@pytest.mark.parametrize("backend", ["mp", pytest.param("ray", marks=pytest.mark.ray)])
def test_a_killed_coordinator_comes_back_and_reattaches_without_a_failed_request(serve_factory, backend):
    server = serve_factory(backend=backend, data_parallel_size=2, api_server_count=2, null_engine=True,
                           extra_args=("--null-step-time-ms", STEP_MS))  # fmt: skip
    try:
        before = _engine_pids(server)
        assert sorted(before) == [0, 1]
        coordinator = _child_pid(server, "dpserve_coordinator.main")
        with StreamLoad(server.url, num_threads=4) as load:
            wait_for(lambda: load.num_ok >= 4, 60, "the load to get going")
            os.kill(coordinator, signal.SIGKILL)
            wait_for(lambda: "coordinator is back" in server.log(), 90, "the coordinator to come back")
            done = load.num_ok
            wait_for(lambda: load.num_ok >= done + 8, 60, "the load to go on")
        assert load.failures == [], load.failures[:5]
        log = server.log()
        assert "re-attached 2 rank(s) [0, 1]" in log, log[-4000:]
        assert _engine_pids(server) == before  # the same engine processes: nothing restarted or recompiled
        assert _child_pid(server, "dpserve_coordinator.main") != coordinator
        up = _scale(server.rpc_port, 3)
        assert up.returncode == 0, up.stdout + up.stderr + server.log()[-4000:]
        wait_for(lambda: _serving_ranks(server.url) == [0, 1, 2], 20, "rank 2 to serve")
        assert {rank: pid for rank, pid in _engine_pids(server).items() if rank < 2} == before
    finally:
        serve_factory.close()  # killed and scaled: no other test may reuse it


def _running(server: ServeProcess) -> int:
    with urllib.request.urlopen(server.url + "/status.json", timeout=5) as response:
        return sum(r["running"] for r in json.load(response)["ranks"])


def test_a_killed_api_server_is_restarted_while_the_other_keeps_the_port(serve_factory):
    server = serve_factory(backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True,
                           extra_args=("--null-step-time-ms", STEP_MS))  # fmt: skip
    try:
        frontend = _child_pid(server, "dpserve_frontend.main")
        # streams of 12-18 s: those on the killed API server still run on the engines when it is found silent (5 s)
        with StreamLoad(server.url, num_threads=8, max_tokens=(600, 900)) as load:
            wait_for(lambda: _running(server) >= 8, 60, "eight streams on the engines")
            os.kill(frontend, signal.SIGKILL)  # its clients' connections drop: those requests are lost to them
            wait_for(lambda: "is back (restart 1)" in server.log(), 60, "the API server to come back")
            for _ in range(6):  # the port is served throughout (the kernel spreads new connections over the live)
                assert _stream(server.url, 8) == 8
            wait_for(lambda: "is gone: aborting its" in server.log(), 30, "the engines to free its requests")
            lost = list(load.failures)  # the streams that were on the killed API server
        assert load.failures == lost and load.num_ok >= 1, load.failures[len(lost):][:5]  # nothing else failed
        assert 1 <= len(lost) <= 8 and all("without [DONE]" in f or "Remote end closed" in f or "reset" in f.lower()
                                           for f in lost), lost  # fmt: skip
        assert "silent for 5 s: dropped" in server.log()
        assert _serving_ranks(server.url) == [0, 1]
        assert frontend not in server.record_descendants()
    finally:
        serve_factory.close()


def test_a_rank_that_dies_while_the_coordinator_is_away_is_dropped_by_the_frontends(serve_factory):
    """The coordinator SIGKILLed, then rank 1's engine: with nobody to announce the death, each API server sees
    the rank's connection gone (engine_liveness.py) and moves its requests to rank 0; no request fails, and the
    restarted coordinator starts rank 1 anew once the others re-attached."""
    server = serve_factory(backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True,
                           extra_args=("--null-step-time-ms", STEP_MS))  # fmt: skip
    try:
        pids = _engine_pids(server)
        coordinator = _child_pid(server, "dpserve_coordinator.main")
        with StreamLoad(server.url, num_threads=4) as load:
            wait_for(lambda: load.num_ok >= 4, 60, "the load to get going")
            os.kill(coordinator, signal.SIGKILL)
            os.kill(pids[1], signal.SIGKILL)
            wait_for(lambda: "while the coordinator is away" in server.log(), 30, "the API servers to drop rank 1")
            done = load.num_ok
            wait_for(lambda: load.num_ok >= done + 8, 60, "the load to go on, on rank 0")
            wait_for(lambda: _serving_ranks(server.url) == [0, 1], 90, "rank 1 to serve again")
        assert load.failures == [], load.failures[:5]
        # every API server follows the new coordinator once it has re-registered (it retries every 5 s)
        after = wait_for(lambda: (p := _engine_pids(server)).get(1) not in (None, pids[1]) and p, 30, "new pid")
        assert after[0] == pids[0]
    finally:
        serve_factory.close()


def test_a_coordinator_run_by_hand_is_started_again_and_adopts_its_mp_engines(tmp_path):
    """`dpserve-coordinator` (mp) SIGKILLed: its engines go on (they watch no process; their deployment's silence
    for --register-timeout-s would end them); the same command line again finds them heartbeating to its port and
    adopts them: the same pids. SIGTERM then stops them all."""
    import secrets
    import subprocess
    import sys
    import time

    from tests.conftest import free_port

    def start(ready_file: str) -> subprocess.Popen:
        cmd = [os.path.join(os.path.dirname(sys.executable), "dpserve-coordinator"), "--data-parallel-backend", "mp",
               "--data-parallel-size", "2", "--null-engine", "--deployment-id", deployment,
               "--data-parallel-rpc-port", str(port), "--ready-file", ready_file]  # fmt: skip
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip

    def ready(proc: subprocess.Popen, ready_file: str) -> dict[int, int]:
        deadline = time.monotonic() + 90
        while not os.path.exists(ready_file):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        with open(ready_file) as f:
            return {e["rank"]: e["pid"] for e in json.load(f)["engines"]}

    deployment, port = f"dep-{secrets.token_hex(6)}", free_port()
    first = start(str(tmp_path / "ready-1.json"))
    second = None
    pids: dict[int, int] = {}
    try:
        pids = ready(first, str(tmp_path / "ready-1.json"))
        first.kill()
        first.wait(10)
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids.values())  # the engines go on
        second = start(str(tmp_path / "ready-2.json"))
        assert ready(second, str(tmp_path / "ready-2.json")) == pids
        second.send_signal(signal.SIGTERM)
        output = second.communicate(timeout=60)[0]
        assert second.returncode == 0, output[-4000:]
        assert "re-attached 2 rank(s) [0, 1]" in output, output[-4000:]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{pid}") for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in pids.values() if os.path.exists(f"/proc/{pid}")]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"engine processes left: {left}"
