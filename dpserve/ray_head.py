"""The local Ray instance of `dpserve serve` (ray backend without --ray-address): `ray start --head --block` as a
child of `dpserve serve`, not of the coordinator, so that it outlives a coordinator that dies and the next one
connects to it and adopts the engine actors it left (ray_backend.py). Stopped after the coordinator.

`ray start --block` stays in the foreground and stops every Ray process it started when it gets SIGTERM; any
process still naming the instance's temp dir after that is killed (the same check the tests make).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

from dpserve_coordinator.settings import local_ray_num_cpus
from dpserve_shared.net import free_port

_READY_LINE = b"Ray runtime started"
_START_TIMEOUT_S = 90.0
_STOP_TIMEOUT_S = 15.0


class RayHeadError(Exception):
    pass


def ray_env(base: dict[str, str]) -> dict[str, str]:
    """The environment for the Ray instance and its drivers: token auth on (a per-instance token, never written to
    ~/.ray), no usage stats, engines at nice 0 (Ray's workers run at 15 by default), no stack trace on SIGTERM."""
    env = dict(base)
    has_token = any(env.get(v) for v in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")) or os.path.exists(
        os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    )
    if not has_token:
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    env.setdefault("RAY_AUTH_MODE", "token")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    env.setdefault("RAY_worker_niceness", "0")
    return env


class RayHead:
    def __init__(self, temp_dir: str, host: str, data_parallel_size_local: int, env: dict[str, str],
                 preexec_fn=None):  # fmt: skip
        self.temp_dir = temp_dir
        self.host = host if host not in ("", "0.0.0.0", "::", "localhost") else "127.0.0.1"
        self.port = free_port(self.host)
        self.env = env
        self.log_path = os.path.join(temp_dir, "ray-start.log")
        self._num_cpus = local_ray_num_cpus(data_parallel_size_local)
        self._preexec_fn = preexec_fn
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        cmd = [
            ray_bin, "start", "--head", "--block",
            "--node-ip-address", self.host,
            "--port", str(self.port),
            "--num-cpus", str(self._num_cpus),
            "--include-dashboard", "false",
            "--temp-dir", self.temp_dir,
            "--object-store-memory", str(100 * 1024 * 1024),
            "--disable-usage-stats",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=self._preexec_fn)  # fmt: skip

    def wait_ready(self, should_stop=lambda: False) -> None:
        """Until `ray start` says the runtime started; RayHeadError with its log if it exits or takes too long."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise RayHeadError(f"the local Ray instance did not start (`ray start --head`):\n{self.log_tail()}")
            with open(self.log_path, "rb") as f:
                if _READY_LINE in f.read():
                    return
            if should_stop():
                return
            time.sleep(0.1)

    def log_tail(self, limit: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-limit:]
        except OSError:
            return ""

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (`ray start --block` stops its processes), SIGKILL after a timeout; then whatever still names the
        temp dir."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in _pids_naming(self.temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _pids_naming(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found
