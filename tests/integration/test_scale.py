"""Elastic DP: `dpserve scale --data-parallel-size K` on a running `dpserve serve`, with streaming load alongside
that must see zero failed requests.

- mp backend: 2 -> 3 (the new rank serves), then 3 -> 1 (ranks 2 and 1 drain: a long stream pinned to rank 2
  finishes although it outlives the engine's own 5 s drain timeout; their processes are gone afterwards);
  refusals (out of range, a second scale while one runs); a removed rank number re-added later serves again.
- ray backend against a Ray cluster of our own: 1 -> 2 -> 1, the removed rank's actor and placement group gone.
Null engines (tokens on a fixed step time) keep this cheap; the serving path is the real one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import (
    ServeProcess,
    _alive,
    descendants,
    engine_metrics,
    free_port,
    iter_sse,
    stop_serve,
    wait_for,
)
from tests.integration.test_coordinator_ray import _cluster_state, ray_cluster  # noqa: F401 - a fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VENV_BIN = os.path.dirname(sys.executable)
DPSERVE = os.path.join(VENV_BIN, "dpserve")
STEP_MS = "20"  # null-engine step time: a 40-token stream is in flight for ~1 s


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        return json.loads(e.read().decode() or "{}")
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def _serving_ranks(base_url: str) -> list[int]:
    return _get_json(base_url + "/health").get("serving_ranks", [])


def _stream(base_url: str, max_tokens: int, headers: dict | None = None, on_first=None) -> int:
    """One streaming completion read to the end; returns its number of content events, raises on any failure."""
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps({"prompt": "Tell me a story", "max_tokens": max_tokens, "ignore_eos": True,
                         "stream": True}).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    num_events, finish_reason, done = 0, None, False
    with urllib.request.urlopen(request, timeout=120) as response:
        for event in iter_sse(response):
            if event is None:
                done = True
                break
            if "error" in event:
                raise AssertionError(f"error event: {event['error']}")
            num_events += 1
            if num_events == 1 and on_first is not None:
                on_first()
            finish_reason = event["choices"][0].get("finish_reason") or finish_reason
    if not done or finish_reason != "length":
        raise AssertionError(f"stream ended without [DONE] or with finish_reason {finish_reason!r}")
    return num_events


class StreamLoad:
    """`num_threads` threads sending streaming completions back to back; every failure is kept."""

    def __init__(self, base_url: str, num_threads: int = 4, max_tokens: tuple[int, int] = (10, 60)):
        self.base_url = base_url
        self.max_tokens = max_tokens
        self.num_ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(num_threads)]

    def _run(self) -> None:
        rng = random.Random()
        while not self._stop.is_set():
            try:
                _stream(self.base_url, rng.randint(*self.max_tokens))
                self.num_ok += 1
            except urllib.error.HTTPError as e:
                self.failures.append(f"{time.strftime('%H:%M:%S')} HTTP {e.code}: {e.read()[:300]!r}")
            except Exception as e:  # noqa: BLE001 - every kind of failure counts
                self.failures.append(f"{time.strftime('%H:%M:%S')} {e!r}")

    def __enter__(self) -> StreamLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)


def _pinned_stream(base_url: str, max_tokens: int, rank: int) -> tuple[threading.Thread, dict]:
    """A stream pinned to `rank` on a thread, returned once its first event arrived; the dict gets "events" (the
    count) when it ends, or "error"."""
    result: dict = {}
    is_running = threading.Event()

    def run():
        try:
            result["events"] = _stream(base_url, max_tokens, {"X-data-parallel-rank": str(rank)}, is_running.set)
        except Exception as e:  # noqa: BLE001
            result["error"] = repr(e)
        is_running.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert is_running.wait(30) and "error" not in result, result
    return thread, result


def _scale(rpc_port: int, size: int, *extra: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [DPSERVE, "scale", "--data-parallel-size", str(size), "--data-parallel-rpc-port", str(rpc_port),
         "--timeout-s", str(timeout_s - 10), *extra],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def _engine_pids(server: ServeProcess) -> dict[int, int]:
    """rank -> pid of the engine processes under `dpserve serve` (mp backend)."""
    found = {}
    for pid, cmdline in server.record_descendants().items():
        if "dpserve_engine.service" in cmdline and "--rank" in cmdline:
            argv = cmdline.split()
            found[int(argv[argv.index("--rank") + 1])] = pid
    return found


# -- mp backend -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(serve_factory):
    server = serve_factory(
        backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True,
        extra_args=("--null-step-time-ms", STEP_MS),
    )
    yield server
    serve_factory.close()  # scaled: no other module may reuse it


@pytest.fixture(autouse=True)
def _print_log_on_failure(request, server_log_on_failure):
    if "server" in request.fixturenames:
        request.node.serve = request.getfixturevalue("server")


def test_scale_up_and_down_under_load_fails_no_request(server):
    with StreamLoad(server.url, num_threads=6) as load:
        wait_for(lambda: load.num_ok >= 6, 60, "the load to get going")

        up = _scale(server.rpc_port, 3)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "done in" in up.stdout and "starting [2]" in up.stdout, up.stdout
        wait_for(lambda: all(_serving_ranks(server.url) == [0, 1, 2] for _ in range(4)), 10,
                  "every frontend to serve ranks 0, 1, 2")
        wait_for(lambda: engine_metrics(server.url).get("vllm:request_success_total", {}).get(2, 0) >= 2, 30,
                  "the new rank 2 to serve unpinned requests")
        pids = _engine_pids(server)
        assert sorted(pids) == [0, 1, 2], pids

        # A stream pinned to rank 2 that outlives the engine's own drain timeout (5 s): 350 x 20 ms = 7 s.
        thread, long_result = _pinned_stream(server.url, 350, rank=2)

        started = time.monotonic()
        down = _scale(server.rpc_port, 1)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "draining [1, 2]" in down.stdout, down.stdout
        thread.join(60)
        assert long_result.get("events") == 350, long_result
        assert time.monotonic() - started > 3, "the scale-down did not wait for the pinned stream"
        wait_for(lambda: all(_serving_ranks(server.url) == [0] for _ in range(4)), 10, "ranks 1 and 2 to leave")
        wait_for(lambda: not any(_alive(pids[r]) for r in (1, 2)), 10, "the removed engines to exit")
        assert sorted(_engine_pids(server)) == [0]
        wait_for(lambda: load.num_ok >= 10, 30, "more load after the scale-down")
    assert load.failures == [], load.failures[:5]
    log = server.log()
    assert "scale 2 -> 3: starting ranks [2], removing ranks []" in log
    assert "scale 3 -> 1: starting ranks [], removing ranks [2, 1]" in log
    assert "rank 2: engine process" in log and "(removed by scale-down)" in log
    assert "starting a replacement" not in log


def test_refusals_and_a_removed_rank_number_serves_again(server):
    assert sorted(_engine_pids(server)) == [0], "runs after the scale-down test"
    too_big = _scale(server.rpc_port, 5000)
    assert too_big.returncode == 1 and "must be between 1 and 1024, got 5000" in too_big.stdout, too_big.stdout
    assert subprocess.run([DPSERVE, "scale", "-dp", "0"], capture_output=True, text=True).returncode == 2

    with StreamLoad(server.url, num_threads=3) as load:
        again = _scale(server.rpc_port, 2)  # rank 1 was removed by the previous test
        assert again.returncode == 0, again.stdout
        wait_for(lambda: all(_serving_ranks(server.url) == [0, 1] for _ in range(4)), 10, "rank 1 to serve again")
        assert _stream(server.url, 8, {"X-data-parallel-rank": "1"}) == 8

        # A scale-down that waits for a long stream pinned to rank 1 is in progress: a second scale is refused.
        thread, long_result = _pinned_stream(server.url, 250, rank=1)
        first = subprocess.Popen(
            [DPSERVE, "scale", "-dp", "1", "--data-parallel-rpc-port", str(server.rpc_port), "--timeout-s", "120"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            wait_for(lambda: "scale 2 -> 1" in server.log(), 30, "the scale-down to start")
            second = _scale(server.rpc_port, 3)
            assert second.returncode == 1 and "a scale to 1 is in progress" in second.stdout, second.stdout
            output = first.communicate(timeout=150)[0]
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        assert first.returncode == 0, output
        thread.join(60)
        assert long_result.get("events") == 250, long_result
        same = _scale(server.rpc_port, 1)
        assert same.returncode == 0 and "done in" in same.stdout, same.stdout
        assert "scale to 1: nothing to do" in server.log()
    assert load.failures == [], load.failures[:5]


def _post_json(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=200) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "{}")


def test_vllm_scale_elastic_ep_endpoint_on_the_frontend(server):
    """vLLM's POST /scale_elastic_ep and /is_scaling_elastic_ep, through an API server, under load."""
    before = _serving_ranks(server.url)
    grown = len(before) + 1
    status, body = _post_json(server.url + "/scale_elastic_ep", {"new_data_parallel_size": 0})
    assert status == 400 and body["error"]["param"] == "new_data_parallel_size", body
    status, body = _post_json(server.url + "/scale_elastic_ep", {"new_data_parallel_size": "two"})
    assert status == 400 and body["error"]["param"] == "new_data_parallel_size", body
    with StreamLoad(server.url, num_threads=2) as load:
        status, body = _post_json(server.url + "/scale_elastic_ep", {"new_data_parallel_size": grown})
        assert status == 200 and body == {"message": f"Scaled to {grown} data parallel engines"}, body
        wait_for(lambda: _serving_ranks(server.url) == list(range(grown)), 10, "the added rank to serve")
        status, body = _post_json(server.url + "/is_scaling_elastic_ep", {})
        assert status == 200 and body == {"is_scaling_elastic_ep": False}, body
        status, body = _post_json(server.url + "/scale_elastic_ep",
                                  {"new_data_parallel_size": len(before), "drain_timeout": 60})
        assert status == 200, body
        wait_for(lambda: _serving_ranks(server.url) == before, 10, "the added rank to leave")
    assert load.failures == [], load.failures[:5]


# -- ray backend ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _running(server: ServeProcess):
    """Around a test's use of `server`: its log tail printed if the test fails, and it is stopped (and nothing it
    started may be left) either way."""
    try:
        yield server
    except BaseException:
        print(f"\n----- {server.log_path} (tail) -----\n{server.log()[-8000:]}")
        raise
    finally:
        problems = stop_serve(server)
    assert not problems, problems


def _start_serve_on_cluster(address: str, env: dict, log_path: str, size: int = 1) -> ServeProcess:
    port, rpc_port = free_port(), free_port()
    cmd = [DPSERVE, "serve", "--data-parallel-backend", "ray", "--ray-address", address,
           "--data-parallel-size", str(size), "--api-server-count", "1", "--host", "127.0.0.1", "--port", str(port),
           "--data-parallel-rpc-port", str(rpc_port), "--max-model-len", "1024", "--max-num-seqs", "32",
           "--null-engine", "--null-step-time-ms", STEP_MS]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(env, PYTHONUNBUFFERED="1"), start_new_session=True)
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", port, rpc_port, "ray", log_path, None)
    deadline = time.monotonic() + 180
    while "dpserve: serving on" not in server.log():
        server.record_descendants()
        assert proc.poll() is None, f"dpserve serve exited with {proc.returncode}:\n{server.log()[-6000:]}"
        assert time.monotonic() < deadline, f"dpserve serve not ready:\n{server.log()[-6000:]}"
        time.sleep(0.5)
    return server


def _dpserve_state(address: str, env: dict) -> tuple[list[str], dict[str, list[str]]]:
    """(our actor names, placement group name -> states of every group ever created with that name)."""
    state = _cluster_state(address, env)
    actors = sorted(a["name"] for a in state["actors"] if a["namespace"].startswith("dpserve-"))
    groups: dict[str, list[str]] = {}
    for group in state["groups"]:
        if group["name"].startswith("dpserve-rank-"):
            groups.setdefault(group["name"], []).append(group["state"])
    return actors, groups


@pytest.mark.ray
def test_ray_scale_up_and_down_releases_the_actor_and_placement_group(ray_cluster, tmp_path):  # noqa: F811
    address, env = ray_cluster
    server = _start_serve_on_cluster(address, env, str(tmp_path / "serve-ray.log"))
    with _running(server):
        with StreamLoad(server.url, num_threads=2) as load:
            wait_for(lambda: load.num_ok >= 2, 60, "the load to get going")
            up = _scale(server.rpc_port, 2)
            assert up.returncode == 0, up.stdout + server.log()[-4000:]
            actors, groups = _dpserve_state(address, env)
            assert actors == ["dpserve-engine-0", "dpserve-engine-1"]
            assert groups == {"dpserve-rank-0": ["CREATED"], "dpserve-rank-1": ["CREATED"]}
            wait_for(lambda: _serving_ranks(server.url) == [0, 1], 10, "rank 1 to serve")
            assert _stream(server.url, 8, {"X-data-parallel-rank": "1"}) == 8

            down = _scale(server.rpc_port, 1)
            assert down.returncode == 0, down.stdout + server.log()[-4000:]
            actors, groups = _dpserve_state(address, env)
            assert actors == ["dpserve-engine-0"]
            assert groups["dpserve-rank-0"] == ["CREATED"] and set(groups["dpserve-rank-1"]) == {"REMOVED"}, groups
            wait_for(lambda: _serving_ranks(server.url) == [0], 10, "rank 1 to leave")
            wait_for(lambda: load.num_ok >= 6, 30, "more load after the scale-down")
        assert load.failures == [], load.failures[:5]
        log = server.log()
        assert "rank 1: placement on" in log and "placement group dpserve-rank-1 removed" in log
    actors, groups = _dpserve_state(address, env)
    assert not actors and all(set(states) == {"REMOVED"} for states in groups.values()), (actors, groups)


@pytest.mark.ray
def test_local_ray_instance_has_room_to_scale_up(serve_factory):
    """Without --ray-address the local Ray instance is started with room for 8 ranks: 1 -> 3 -> 1 works."""
    server = serve_factory(
        backend="ray", data_parallel_size=1, api_server_count=1, null_engine=True,
        extra_args=("--null-step-time-ms", STEP_MS),
    )
    try:
        with StreamLoad(server.url, num_threads=2) as load:
            wait_for(lambda: load.num_ok >= 2, 60, "the load to get going")
            up = _scale(server.rpc_port, 3)
            assert up.returncode == 0, up.stdout + up.stderr + server.log()[-4000:]
            wait_for(lambda: _serving_ranks(server.url) == [0, 1, 2], 10, "ranks 1 and 2 to serve")
            assert _stream(server.url, 8, {"X-data-parallel-rank": "2"}) == 8
            down = _scale(server.rpc_port, 1)
            assert down.returncode == 0, down.stdout + down.stderr + server.log()[-4000:]
            wait_for(lambda: _serving_ranks(server.url) == [0], 10, "ranks 1 and 2 to leave")
        assert load.failures == [], load.failures[:5]
    finally:
        serve_factory.close()  # scaled: no other test may reuse it


def _ray_kill(address: str, env: dict, actor: str) -> None:
    code = textwrap.dedent(f"""
        import ray
        ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
        found = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == {actor!r}]
        assert len(found) == 1, found  # one deployment on the cluster: its namespace is dpserve-<deployment id>
        ray.kill(ray.get_actor({actor!r}, namespace=found[0]["namespace"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, RAY_AUTH_MODE="token"), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.ray
def test_an_actor_killed_through_ray_is_a_rank_death_like_any_other(ray_cluster, tmp_path):  # noqa: F811
    """ray.kill on a rank's EngineHost: its engine process dies with it (PR_SET_PDEATHSIG), the rank is DEAD, its
    streams move to the other rank, and a replacement actor serves the rank again; no stream fails."""
    address, env = ray_cluster
    server = _start_serve_on_cluster(address, env, str(tmp_path / "serve-ray.log"), size=2)
    with _running(server):
        with StreamLoad(server.url, num_threads=4) as load:
            wait_for(lambda: load.num_ok >= 4, 60, "the load to get going")
            _ray_kill(address, env, "dpserve-engine-1")
            wait_for(lambda: _serving_ranks(server.url) == [0, 1] and _restarts(server.url, 1) >= 1, 60,
                     "rank 1 replaced")  # fmt: skip
            done = load.num_ok
            wait_for(lambda: load.num_ok >= done + 4, 60, "the load to go on")
        assert load.failures == [], load.failures[:5]


def _restarts(url: str, rank: int) -> int:
    with urllib.request.urlopen(url + "/health", timeout=5) as response:
        return {r["rank"]: r for r in json.load(response)["ranks"]}[rank]["restarts"]
