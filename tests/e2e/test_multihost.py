"""A real multi-host deployment on one machine: three network namespaces, each its own IP, a Ray node in each.

The Ray head (with the coordinator and a frontend) runs in host 0, Ray workers in hosts 1 and 2. With
`--data-parallel-size 4 --data-parallel-size-local L` the first L ranks must land on the head and the rest on the
workers (checked with Ray's state API), and requests through the frontend must be served on every host.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from tests.e2e import netns

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.netns]

VENV_BIN = os.path.dirname(sys.executable)
RAY = os.path.join(VENV_BIN, "ray")
DPSERVE = os.path.join(VENV_BIN, "dpserve")
RAY_PORT = 6379
HTTP_PORT = 8000
NUM_HOSTS = 3
CPUS_PER_HOST = 4  # logical: two ranks (device bundle + actor bundle each) per host


def _run_in(hosts, host, code: str, env, timeout=120, args: tuple[str, ...] = ()) -> str:
    result = subprocess.run(
        hosts.cmd(host, [sys.executable, "-c", code, *args]), env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def cluster():
    reason = netns.can_create_namespaces()
    if reason is not None:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    hosts = netns.Hosts(NUM_HOSTS)
    workdir = tempfile.mkdtemp(prefix="dpserve-netns-")
    env = dict(
        os.environ,
        HOME=workdir,  # keeps Ray's token file and caches out of the real home
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(16),
        RAY_USAGE_STATS_ENABLED="0",
        DPSERVE_CACHE_DIR=os.environ.get("DPSERVE_CACHE_DIR", os.path.expanduser("~/.cache/dpserve")),
        PYTHONPATH=os.getcwd(),
    )
    try:
        hosts.create()
        head_ip = hosts.ips[0]
        subprocess.run(
            hosts.cmd(0, [RAY, "start", "--head", "--node-ip-address", head_ip, "--port", str(RAY_PORT),
                          "--num-cpus", str(CPUS_PER_HOST), "--include-dashboard", "true",
                          "--dashboard-host", head_ip, "--temp-dir", os.path.join(workdir, "ray"),
                          "--disable-usage-stats"]),
            env=env, check=True, capture_output=True, timeout=180,
        )
        for host in range(1, NUM_HOSTS):
            subprocess.run(
                hosts.cmd(host, [RAY, "start", "--address", f"{head_ip}:{RAY_PORT}", "--node-ip-address",
                                 hosts.ips[host], "--num-cpus", str(CPUS_PER_HOST)]),
                env=env, check=True, capture_output=True, timeout=180,
            )
        yield hosts, env
    finally:
        hosts.stop_processes()  # never `ray stop`: it stops every Ray instance on the machine, another worker's too
        hosts.destroy()
        shutil.rmtree(workdir, ignore_errors=True)


_PLACEMENT = textwrap.dedent(
    """
    import json, ray, sys
    from ray.util.state import list_actors
    # the head's address, never "auto": that finds every Ray on the machine (the other test worker's too) and
    # refuses to choose
    address = sys.argv[1]
    ray.init(address=address, logging_level="ERROR")
    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    ranks = {}
    for actor in list_actors(address=address, filters=[("state", "=", "ALIVE")]):
        if (actor.name or "").startswith("dpserve-engine-"):
            ranks[int(actor.name.rsplit("-", 1)[1])] = ip_of[actor.node_id]
    print(json.dumps(ranks))
    """
)

_LOAD = textwrap.dedent(
    """
    import asyncio, json, sys, aiohttp
    url = sys.argv[1]
    async def one(session, i):
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()
    async def main():
        async with aiohttp.ClientSession() as s:
            await asyncio.gather(*(one(s, i) for i in range(24)))
            async with s.get(url + "/metrics") as r:
                print(await r.text())
    asyncio.run(main())
    """
)


def _served_per_rank(metrics_text: str) -> dict[int, float]:
    from prometheus_client.parser import text_string_to_metric_families

    served: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "vllm:request_success":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                rank = int(sample.labels["engine"])
                served[rank] = served.get(rank, 0.0) + sample.value
    return served


def _wait_no_engine_actors(hosts, env, timeout_s: float = 90.0) -> None:
    """The previous deployment's actors must be gone before the next one's placement is read."""
    deadline = time.time() + timeout_s
    while json.loads(_run_in(hosts, 0, _PLACEMENT, env, args=(f"{hosts.ips[0]}:{RAY_PORT}",))):
        assert time.time() < deadline, "engine actors of a stopped deployment are still alive"
        time.sleep(1)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("local", [2, 0])
def test_ranks_land_on_the_right_hosts_and_all_serve(cluster, local):
    hosts, env = cluster
    head_ip = hosts.ips[0]
    _wait_no_engine_actors(hosts, env)
    log = tempfile.NamedTemporaryFile("w+", prefix="dpserve-netns-serve-", suffix=".log", delete=False)
    server = subprocess.Popen(
        hosts.cmd(0, [DPSERVE, "serve", "--ray-address", f"{head_ip}:{RAY_PORT}",
                      "--data-parallel-address", head_ip, "--data-parallel-size", "4",
                      "--data-parallel-size-local", str(local), "--host", head_ip, "--port", str(HTTP_PORT),
                      "--max-num-seqs", "8", "--max-model-len", "512", "--num-kv-blocks", "256",
                      # the three "hosts" share this machine's cores: one thread per rank, not each host's all
                      "--num-threads", "1"]),
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://{head_ip}:{HTTP_PORT}"
    try:
        _run_in(hosts, 0, textwrap.dedent(f"""
            import json, time, urllib.request
            deadline = time.time() + 600
            while True:
                try:
                    # "ok", not "degraded": every rank is connected, not just the first one up.
                    if json.load(urllib.request.urlopen("{url}/health", timeout=2)).get("status") == "ok": break
                except Exception:
                    if time.time() > deadline: raise
                time.sleep(1)
            """), env, timeout=660)
        placement = json.loads(_run_in(hosts, 0, _PLACEMENT, env, args=(f"{head_ip}:{RAY_PORT}",)))
        placement = {int(k): v for k, v in placement.items()}
        assert sorted(placement) == [0, 1, 2, 3], placement
        for rank, ip in placement.items():
            if rank < local:
                assert ip == head_ip, f"rank {rank} should be on the head, is on {ip}"
            else:
                assert ip != head_ip, f"rank {rank} should be off the head, is on {ip}"
        served = _served_per_rank(_run_in(hosts, 0, _LOAD.replace("sys.argv[1]", repr(url)), env, timeout=300))
        hosts_serving = {placement[rank] for rank, count in served.items() if count > 0}
        expected = set(hosts.ips[1:]) | ({head_ip} if local else set())
        assert hosts_serving == expected, f"served per rank {served}, placement {placement}"
    except BaseException:
        log.seek(0)
        print(log.read()[-8000:])
        raise
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        os.unlink(log.name)
