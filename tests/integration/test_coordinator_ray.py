"""The coordinator against an existing Ray cluster (`--ray-address`): named actors in one placement group per rank
while it runs, nothing left in the cluster after SIGTERM, and an impossible layout refused at once."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from tests.conftest import _proc_table, descendants, free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(300)]

VENV_BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster of our own (killed by its temp dir, never `ray stop`, which would hit others' Ray)."""
    temp_dir = tempfile.mkdtemp(prefix="dpr", dir="/tmp")
    port = free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_DISABLE_FAILURE_SIGNAL_HANDLER="1")
    started = subprocess.run(
        [os.path.join(VENV_BIN, "ray"), "start", "--head", "--port", str(port), "--num-cpus", "5",
         "--temp-dir", temp_dir, "--include-dashboard", "false", "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
        address = re.search(r"--address='([^']+)'", started.stdout + started.stderr).group(1)
        yield address, env
    finally:
        _kill_cluster(temp_dir, f":{port}")
        shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_cluster(temp_dir: str, gcs_port: str) -> None:
    """Every process of our cluster: those naming its temp dir or GCS port, and all their descendants."""
    port = re.compile(re.escape(gcs_port) + r"(?!\d)")  # a whole number: ":2800" is not another cluster's ":28003"
    roots = [
        pid
        for pid, (_, cmd) in _proc_table().items()
        if (temp_dir in cmd or ("ray" in cmd and "--address=" in cmd and port.search(cmd))) and pid != os.getpid()
    ]
    pids = set(roots)
    for pid in roots:
        pids.update(descendants(pid))
    for sig, pause_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.5)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(pause_s)


def _cluster_state(address: str, env: dict) -> dict:
    env = dict(env, RAY_AUTH_MODE="token")
    code = textwrap.dedent(f"""
        import json, ray
        from ray.util import placement_group_table
        ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
        actors = ray.util.list_named_actors(all_namespaces=True)
        groups = [{{"name": g["name"], "state": g["state"], "bundles": list(g["bundles"].values())}}
                  for g in placement_group_table().values()]
        print(json.dumps({{"actors": actors, "groups": groups}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _coordinator(address: str, env: dict, *args: str, ready_file: str | None = None) -> subprocess.Popen:
    cmd = [os.path.join(VENV_BIN, "dpserve-coordinator"), "--ray-address", address,
           "--data-parallel-rpc-port", str(free_port()), "--null-engine", *args]
    if ready_file:
        cmd += ["--ready-file", ready_file]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_named_actors_and_groups_while_running_and_none_after(ray_cluster, tmp_path):
    address, env = ray_cluster
    ready_file = str(tmp_path / "ready.json")
    proc = _coordinator(address, env, "--data-parallel-size", "2", ready_file=ready_file)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready_file):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "coordinator not ready"
            time.sleep(0.2)
        ready = json.load(open(ready_file))
        assert [e["rank"] for e in ready["engines"]] == [0, 1]
        assert all(e["state"] == "ready" for e in ready["engines"])
        engine_pids = [e["pid"] for e in ready["engines"]]

        state = _cluster_state(address, env)
        names = sorted(a["name"] for a in state["actors"] if a["namespace"].startswith("dpserve-"))
        assert names == ["dpserve-engine-0", "dpserve-engine-1"]
        groups = sorted((g for g in state["groups"] if g["name"].startswith("dpserve-rank-")), key=lambda g: g["name"])
        assert [(g["name"], g["state"]) for g in groups] == [
            ("dpserve-rank-0", "CREATED"),
            ("dpserve-rank-1", "CREATED"),
        ]
        head_ip = address.rsplit(":", 1)[0]
        assert groups[0]["bundles"] == [{"CPU": 1.0, f"node:{head_ip}": 0.001}, {"CPU": 1.0}]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            output = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0]
            pytest.fail(f"coordinator did not stop within 60 s of SIGTERM:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    assert "placement groups released" in output
    state = _cluster_state(address, env)
    assert not [a for a in state["actors"] if a["namespace"].startswith("dpserve-")], state
    assert all(g["state"] == "REMOVED" for g in state["groups"] if g["name"].startswith("dpserve-rank-")), state
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in engine_pids):
        assert time.monotonic() < deadline, f"engine processes left: {engine_pids}"
        time.sleep(0.2)
    assert not descendants(proc.pid)


def test_impossible_layout_fails_at_once_naming_the_missing_resources(ray_cluster):
    address, env = ray_cluster
    head_ip = address.rsplit(":", 1)[0]
    proc = _coordinator(address, env, "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                        "--data-parallel-address", head_ip)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, output[-4000:]
    assert "ranks [1] do not fit on the non-head Ray nodes" in output  # planned, not a placement-group timeout
    state = _cluster_state(address, env)
    assert not [a for a in state["actors"] if a["namespace"].startswith("dpserve-")]
    assert all(g["state"] == "REMOVED" for g in state["groups"] if g["name"].startswith("dpserve-rank-"))


def _wait_ready_file(proc: subprocess.Popen, ready_file: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready_file):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "coordinator not ready"
        time.sleep(0.2)
    with open(ready_file) as f:
        return json.load(f)


def test_a_coordinator_started_again_by_hand_adopts_the_engine_actors_it_left(ray_cluster, tmp_path):
    """SIGKILL leaves the detached actors, their groups and engines running; the same command line again (the same
    --deployment-id and control port) finds them by name and waits for their engines to register: same pids."""
    address, env = ray_cluster
    args = ("--data-parallel-size", "2", "--deployment-id", f"dep-{secrets.token_hex(6)}",
            "--data-parallel-rpc-port", str(free_port()))  # fmt: skip
    first = _coordinator(address, env, *args, ready_file=str(tmp_path / "ready-1.json"))
    second = None
    try:
        pids = {e["rank"]: e["pid"] for e in _wait_ready_file(first, str(tmp_path / "ready-1.json"))["engines"]}
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        second = _coordinator(address, env, *args, ready_file=str(tmp_path / "ready-2.json"))
        ready = _wait_ready_file(second, str(tmp_path / "ready-2.json"))
        assert {e["rank"]: e["pid"] for e in ready["engines"]} == pids
        assert all(e["state"] == "ready" for e in ready["engines"])
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        output = second.communicate(timeout=60)[0] if second is not None else ""
        print(output[-8000:])  # shown by pytest when the test fails, whichever assertion it was
    assert "adopted actor dpserve-engine-0" in output and "re-attached 2 rank(s) [0, 1]" in output, output[-4000:]
    assert second.returncode == 0, output[-4000:]
    state = _cluster_state(address, env)
    assert not [a for a in state["actors"] if a["namespace"].startswith("dpserve-")], state
    assert all(g["state"] == "REMOVED" for g in state["groups"] if g["name"].startswith("dpserve-rank-")), state
