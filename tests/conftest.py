"""Shared fixtures: `dpserve serve` as a real subprocess, started once per configuration per test session.

`serve_factory` (session scope) starts `dpserve serve` in its own process group on free ports, waits for
/health with a timeout (printing the server's log on failure), and on teardown SIGTERMs it, then SIGKILLs its
group and every process it started, failing if any of them (engines, frontends, coordinator, Ray's raylet /
gcs_server / ray:: workers) had to be killed or survived. Each server owns its local Ray instance in a fresh
short temp dir (Ray's socket paths must stay short), so Ray starts once per server and never touches ~/.ray.

    def test_x(serve_factory):
        server = serve_factory(backend="mp", data_parallel_size=2, api_server_count=2, null_engine=True)
        requests.get(server.url + "/health")

The same configuration asked twice in a session gets the same server; a different one stops the previous one
first (2 cores: one server at a time).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from dpserve_shared.net import free_port  # noqa: F401 - the tests import it from here

# Engines run eager PyTorch unless a test asks otherwise: compiling the decode step costs ~2 min per engine on a
# cold cache (tests/model/test_engine_real.py covers the compiled path). Subprocesses inherit it.
os.environ.setdefault("DPSERVE_ENFORCE_EAGER", "1")
# Every ZMQ socket speaks CURVE with one cluster key (dpserve_shared.zmq_security): one per test session, in the
# environment, so that `dpserve serve`, services started by hand, in-process services (their settings' default)
# and the tests' own peers (ZmqSecurity.from_environment()) all hold it. Subprocesses inherit it.
os.environ.setdefault("DPSERVE_CLUSTER_KEY", os.urandom(32).hex())
# `make test` runs two workers (pytest-xdist) on 2 cores: an OpenMP thread that spins while it waits takes the core
# the other worker's processes need (the model tests ran ~10 x longer beside another worker). Subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The threads an in-process model test gives torch: the cores shared by the workers running beside it.
TORCH_THREADS = max(1, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))

VENV_BIN = os.path.dirname(sys.executable)
DPSERVE = os.path.join(VENV_BIN, "dpserve")
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
_RAY_PROCESS_NAMES = ("raylet", "gcs_server", "ray::", "ray/dashboard", "ray/_private", "ray/autoscaler")


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        table[int(entry)] = (ppid, cmdline)
    return table


def descendants(pid: int) -> dict[int, str]:
    table = _proc_table()
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, cmdline) in table.items():
            if ppid == parent and child not in found:
                found[child] = cmdline
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with its pid, what tells it from a later process that
    got the same pid once it ended (pids are reused; another test's process may hold it now)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclasses.dataclass
class ServeProcess:
    """A running `dpserve serve` and what is needed to check it left nothing behind."""

    proc: subprocess.Popen
    url: str
    port: int
    rpc_port: int
    backend: str
    log_path: str
    ray_temp_dir: str | None
    seen: dict[int, str] = dataclasses.field(default_factory=dict)  # every descendant ever observed
    started: dict[int, int | None] = dataclasses.field(default_factory=dict)  # ...and when it started

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def record_descendants(self) -> dict[int, str]:
        now = descendants(self.proc.pid)
        self.started.update({pid: _start_time(pid) for pid in now})
        self.seen.update(now)
        return now

    def markers(self) -> list[str]:
        found = [f"tcp://127.0.0.1:{self.rpc_port}"]
        if self.ray_temp_dir:
            found.append(self.ray_temp_dir)
        return found

    def stray_processes(self) -> dict[int, str]:
        """Processes this server started that are still alive: by ancestry or by its unique addresses/dirs."""
        table = _proc_table()
        stray = {pid: cmd for pid, cmd in self.seen.items()
                 if pid in table and _alive(pid) and _start_time(pid) == self.started.get(pid)}  # fmt: skip
        for pid, (_, cmdline) in table.items():
            if pid != os.getpid() and any(m in cmdline for m in self.markers()) and _alive(pid):
                stray[pid] = cmdline
        return stray


def start_serve(
    *,
    backend: str,
    data_parallel_size: int = 2,
    api_server_count: int = 2,
    null_engine: bool = False,
    extra_args: tuple[str, ...] = (),
    log_dir: str,
    timeout_s: float = STARTUP_TIMEOUT_S,
    rpc_port: int | None = None,
) -> ServeProcess:
    port, rpc_port = free_port(), rpc_port or free_port()
    ray_temp_dir = tempfile.mkdtemp(prefix="dpr", dir="/tmp") if backend == "ray" else None
    cmd = [
        DPSERVE, "serve",
        "--data-parallel-backend", backend,
        "--data-parallel-size", str(data_parallel_size),
        "--api-server-count", str(api_server_count),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--data-parallel-rpc-port", str(rpc_port),
        "--max-model-len", "1024",
        "--max-num-seqs", "32",
        # A model rank's KV cache: 256 blocks (4096 tokens, ~190 MB in fp32) rather than the 1 GiB default, as a
        # served rank populates its whole cache at start and the suite starts dozens on two cores. (The null
        # engine's blocks size its simulated prefix cache: its default stays.) A test's own extra_args win.
        *([] if null_engine else ["--num-kv-blocks", "256"]),
        *(["--ray-temp-dir", ray_temp_dir] if ray_temp_dir else []),
        *(["--null-engine", "--null-step-time-ms", "5"] if null_engine else []),
        *extra_args,
    ]  # fmt: skip
    log_path = os.path.join(log_dir, f"serve-{backend}-{'null' if null_engine else 'model'}-{port}.log")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    server = ServeProcess(proc, f"http://127.0.0.1:{port}", port, rpc_port, backend, log_path, ray_temp_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        server.record_descendants()
        if proc.poll() is not None:
            text = server.log()
            stop_serve(server)
            pytest.fail(f"dpserve serve exited with {proc.returncode} during start-up:\n{text[-6000:]}")
        if "dpserve: serving on" in server.log() and _health_ok(server.url):
            return server
        if time.monotonic() > deadline:
            text = server.log()
            stop_serve(server)
            pytest.fail(f"dpserve serve not ready after {timeout_s:.0f} s:\n{text[-6000:]}")
        time.sleep(0.5)


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` every 0.2 s until it returns something truthy (returned); fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200 and b'"degraded"' not in response.read()
    except (urllib.error.URLError, OSError):
        return False


def stop_serve(server: ServeProcess) -> list[str]:
    """SIGTERM, wait, SIGKILL the group and every process it started; return what had to be killed."""
    server.record_descendants()
    problems = []
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            problems.append(f"dpserve serve did not exit within {STOP_TIMEOUT_S:.0f} s of SIGTERM")
    deadline = time.monotonic() + 10.0  # children may still be finishing their own exit
    while server.stray_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid, cmdline in server.stray_processes().items():
        problems.append(f"left running: pid {pid}: {cmdline[:200]}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()
    if server.ray_temp_dir:
        shutil.rmtree(server.ray_temp_dir, ignore_errors=True)
    return problems


class ServeFactory:
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.key: tuple | None = None
        self.server: ServeProcess | None = None
        self.problems: list[str] = []
        self.ray_temp_dirs: list[str] = []

    def __call__(self, **config) -> ServeProcess:
        key = tuple(sorted(config.items()))
        if self.server is not None and self.key == key and self.server.proc.poll() is None:
            return self.server
        self.close()
        started = time.monotonic()
        self.server = start_serve(log_dir=self.log_dir, **config)
        if self.server.ray_temp_dir:
            self.ray_temp_dirs.append(self.server.ray_temp_dir)
        self.key = key
        print(f"\n[serve_factory] {config} ready in {time.monotonic() - started:.1f} s ({self.server.log_path})")
        return self.server

    def close(self) -> None:
        if self.server is None:
            return
        server, self.server, self.key = self.server, None, None
        problems = stop_serve(server)
        if problems:
            self.problems.append(f"{server.log_path}:\n  " + "\n  ".join(problems) + "\n" + server.log()[-4000:])


@pytest.fixture(scope="session")
def engine_cache_dir() -> str:
    """The engines' own cache dir (~/.cache/dpserve unless DPSERVE_CACHE_DIR): the C++ kernels built there once
    per machine serve in-process tests and every engine the tests start."""
    from dpserve_engine.config import EngineConfig

    return EngineConfig().cache_dir


@pytest.fixture(scope="session")
def model_info():
    """The bundled model's ModelInfo (tokenizer data, chat template, special ids; no weights): the frontend's tests
    and the null engine core use it."""
    from dpserve_engine.model_info import load_model_info
    from dpserve_engine.settings import EngineConfig

    return load_model_info(EngineConfig())


@pytest.fixture(scope="session")
def serve_factory(tmp_path_factory):
    """Starts (or reuses) one `dpserve serve`; on teardown asserts nothing it started is left running."""
    had_ray_home = os.path.exists(os.path.expanduser("~/.ray"))
    factory = ServeFactory(str(tmp_path_factory.mktemp("serve-logs")))
    yield factory
    factory.close()
    assert not factory.problems, "\n".join(factory.problems)
    leftovers = {
        pid: cmd
        for pid, (_, cmd) in _proc_table().items()
        if any(n in cmd for n in _RAY_PROCESS_NAMES) and any(d in cmd for d in factory.ray_temp_dirs)
    }
    assert not leftovers, f"Ray processes left: {leftovers}"
    if not had_ray_home:
        assert not os.path.exists(os.path.expanduser("~/.ray")), "a test run created ~/.ray"


@pytest.fixture
def server_log_on_failure(request):
    """Use with a ServeProcess in `request.node.serve`: prints its log tail when the test fails."""
    yield
    server = getattr(request.node, "serve", None)
    report = getattr(request.node, "rep_call", None)
    if server is not None and report is not None and report.failed:
        print(f"\n----- {server.log_path} (tail) -----\n{server.log()[-8000:]}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def iter_sse(response):
    """The `data:` events of a streamed (SSE) HTTP response, parsed, in order; `data: [DONE]` yields None and
    ends it (a stream cut short ends without the None)."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            yield None
            return
        yield json.loads(payload)


def engine_metrics(base_url: str) -> dict[str, dict[int, float]]:
    """Per-engine samples from a server's /metrics: metric name -> rank -> value (summed over other labels)."""
    from dpserve.bench.metrics import engine_metrics as scrape

    return scrape(base_url)
