"""Elastic expert parallelism (issue #18): re-forming the expert-parallel group of a running `dpserve serve
--enable-expert-parallel` (null engines in their expert-parallel mode: every step and dummy step runs gather +
scatter_sum over a real gloo group), mp backend, 2 API servers, streaming load alongside that must see no failed
request.

- scaling 2 -> 3 (`dpserve scale`) -> 2 (vLLM's POST /scale_elastic_ep): each step re-forms the group (generation
  2, then 3) with the new world size; the new rank serves; the removed one drains and exits (mp and ray);
- SIGKILL of a rank: the survivors' collectives fail at once, they keep their requests, the supervisor starts a
  replacement, the coordinator re-forms the group with it; a stream pinned to the survivor loses no token, and its
  longest silence is the interruption (printed; docs/benchmarks.md "session 11: elastic EP");
- the same death under the ray backend (the engine process of an EngineHost actor killed).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from tests.conftest import _alive, _proc_table, engine_metrics, wait_for
from tests.integration.test_scale import StreamLoad, _engine_pids, _scale, _serving_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EP_ARGS = ("--enable-expert-parallel", "--null-step-time-ms", "20")


@pytest.fixture(params=["mp", pytest.param("ray", marks=pytest.mark.ray)])
def ep_server(serve_factory, request, server_log_on_failure):
    serve_factory.close()  # one deployment at a time on 2 cores; this one is scaled
    server = serve_factory(backend=request.param, data_parallel_size=2, api_server_count=2, null_engine=True,
                           extra_args=EP_ARGS)  # fmt: skip
    request.node.serve = server
    yield server
    serve_factory.close()


def _post_json(url: str, body: dict, timeout_s: float = 200) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "{}")


def _successes(url: str) -> dict[int, float]:
    return engine_metrics(url).get("vllm:request_success_total", {})


def test_scaling_2_to_3_to_2_under_load_re_forms_the_group_and_fails_no_request(ep_server):
    url = ep_server.url
    with StreamLoad(url, num_threads=4, max_tokens=(10, 40)) as load:
        wait_for(lambda: load.num_ok >= 4, 60, "the load to get going")

        up = _scale(ep_server.rpc_port, 3)
        assert up.returncode == 0, up.stdout + up.stderr
        wait_for(lambda: all(_serving_ranks(url) == [0, 1, 2] for _ in range(4)), 20, "ranks 0, 1, 2 serving")
        wait_for(lambda: _successes(url).get(2, 0) >= 2, 60, "the new rank 2 to serve requests")
        pid_2 = _engine_pid(ep_server, 2)

        status, body = _post_json(url + "/scale_elastic_ep", {"new_data_parallel_size": 2})
        assert status == 200, body
        assert body["message"] == "Scaled to 2 data parallel engines"
        wait_for(lambda: all(_serving_ranks(url) == [0, 1] for _ in range(4)), 20, "rank 2 to leave")
        wait_for(lambda: not _alive(pid_2), 20, "the removed rank's engine to exit")
        served = dict(_successes(url))
        wait_for(lambda: load.num_ok >= 20 and _successes(url).get(1, 0) > served.get(1, 0), 60,
                 "ranks 0 and 1 to serve in the re-formed group of 2")  # fmt: skip
    assert load.failures == [], load.failures[:5]
    log = ep_server.log()
    assert "expert-parallel group, generation 2: 3 ranks joined" in log
    assert "expert-parallel group, generation 3: 2 ranks joined" in log
    assert "leaving the expert-parallel group of generation 1 for generation 2" in log
    assert "starting a replacement" not in log and "lock-step step failed" not in log


def _pinned_stream_events(url: str, max_tokens: int, rank: int, times: list[float], done: dict) -> None:
    """A stream pinned to `rank`: the arrival time of every content event goes to `times`; `done` gets its end."""
    body = json.dumps({"prompt": "a long story", "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
    request = urllib.request.Request(url + "/v1/completions", body.encode(),
                                     {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
    try:
        with urllib.request.urlopen(request, timeout=200) as response:
            for raw in response:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done["ok"] = True
                    return
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        done["error"] = event["error"]
                        return
                    times.append(time.monotonic())
    except Exception as e:  # noqa: BLE001 - reported by the test
        done["error"] = repr(e)


@pytest.mark.parametrize("size, victim", [(2, 1), (3, 0)], ids=["dp2-rank1", "dp3-rank0"])
def test_killing_a_rank_under_load_re_forms_the_group_with_its_replacement_and_fails_no_request(
        size, victim, serve_factory, request, server_log_on_failure):  # fmt: skip
    """DP=3, rank 0: the group's TCPStore host and WaveComplete sender dies, and the two survivors' collectives
    with each other fail only when the other one tears its group down."""
    serve_factory.close()
    ep_server = serve_factory(backend="mp", data_parallel_size=size, api_server_count=2, null_engine=True,
                              extra_args=EP_ARGS)  # fmt: skip
    request.node.serve = ep_server
    url = ep_server.url
    survivor_rank = size - 1 if victim == 0 else 0
    times: list[float] = []
    done: dict = {}
    survivor = threading.Thread(target=_pinned_stream_events, args=(url, 600, survivor_rank, times, done),
                                daemon=True)  # fmt: skip
    with StreamLoad(url, num_threads=4, max_tokens=(10, 40)) as load:
        wait_for(lambda: load.num_ok >= 4, 60, "the load to get going")
        survivor.start()
        wait_for(lambda: len(times) >= 20, 30, f"the pinned stream on rank {survivor_rank} to run")
        victim_pid = _engine_pids(ep_server)[victim]
        killed_s = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)
        wait_for(lambda: (_engine_pids(ep_server).get(victim) not in (None, victim_pid)
                          and all(_serving_ranks(url) == list(range(size)) for _ in range(4))), 90,
                 f"a replacement rank {victim} serving")  # fmt: skip
        served = dict(_successes(url))
        wait_for(lambda: _successes(url).get(victim, 0) >= served.get(victim, 0) + 2, 60,
                 "the replacement to serve requests")  # fmt: skip
        survivor.join(120)
        wait_for(lambda: load.num_ok >= 20, 60, "more load after the replacement")
    assert done.get("ok") and len(times) == 600, (done, len(times))  # the survivor's request kept every token
    # the survivor's stream goes silent when its collective fails (a step after the kill), until the re-formation
    gap_s, resumed_s = max((b - a, b) for a, b in zip(times, times[1:]) if b > killed_s)
    print(f"\nDP={size}, rank {victim} killed -> first token of rank {survivor_rank}'s stream after the re-formation: "
          f"{resumed_s - killed_s:.2f} s "
          f"(its silence {gap_s:.2f} s)")
    assert load.failures == [], load.failures[:5]
    log = ep_server.log()
    assert "left the expert-parallel group of generation 1" in log  # the survivor's collective failed
    assert f"expert-parallel group, generation 2: {size} ranks joined" in log
    assert "expert-parallel group repaired" in log
    serve_factory.close()


def _engine_pid(server, rank: int) -> int | None:
    """The pid of the rank's engine process wherever it runs (under Ray its parent is a Ray worker)."""
    for pid, (_, cmdline) in _proc_table().items():
        if ("dpserve_engine.service" in cmdline and f":{server.rpc_port} " in cmdline
                and f"--rank {rank} " in cmdline + " "):  # fmt: skip
            return pid
    return None


@pytest.mark.ray
def test_ray_backend_a_killed_rank_is_replaced_and_the_group_re_formed(serve_factory, request,
                                                                       server_log_on_failure):  # fmt: skip
    serve_factory.close()
    server = serve_factory(backend="ray", data_parallel_size=2, api_server_count=1, null_engine=True,
                           extra_args=EP_ARGS)  # fmt: skip
    request.node.serve = server
    url = server.url
    with StreamLoad(url, num_threads=4, max_tokens=(10, 40)) as load:
        wait_for(lambda: load.num_ok >= 4, 60, "the load to get going")
        victim = _engine_pid(server, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: "expert-parallel group repaired" in server.log(), 120, "the group re-formed")
        done = load.num_ok
        wait_for(lambda: load.num_ok >= done + 8, 60, "the load to go on")
    assert load.failures == [], load.failures[:5]
    assert _engine_pid(server, 1) not in (None, victim)
    serve_factory.close()
